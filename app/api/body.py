"""Request bodies: FastAPI parses none. A route that takes JSON reads it with `read_json`,
which parses it strictly (`app.ingest.jsontext`), checks it against limits, validates it and
hands it to the service's `prepare`, all in one step:

- small bodies (up to `INLINE_BYTES`) in the request's task;
- larger ones in a thread, with Python's cyclic garbage collector paused meanwhile (a
  collection walks every live object while the body's millions of new ones are being
  built: seconds during which no thread runs), at most `LARGE_AT_ONCE` at a time. What the
  body was parsed into is freed a little at a time (`app.ingest.freeing`); what comes back is
  what `prepare` keeps (a stored spec, counts), or the problem to answer, and is freed the
  same way once the response is sent.

Validation takes a body a piece at a time (`app.schemas.pieces`), each piece in one
short call. A route whose body holds one large list (a training job's groups) may read a
large body an item at a time (`Reading.stream`): each item is checked, validated and
kept in its final form as the parser reaches it, so the parsed list never exists whole;
at the first problem the body is read whole, which reports every problem in order.

The route documents the body with `json_body(model)`, the same OpenAPI request body
FastAPI would write for a `model` parameter.
"""

from __future__ import annotations

import asyncio
import email.message
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from fastapi import Request
from pydantic import BaseModel

from app.errors import (
    InvalidInputError,
    LimitExceededError,
    ProblemError,
    UnsupportedMediaTypeError,
    format_path,
)
from app.ingest import jsontext
from app.ingest.edge import body_of
from app.ingest.freeing import dispose, dispose_after_response, gc_paused
from app.schemas.common import FieldError
from app.schemas.pieces import Piece, validate
from app.settings import Settings

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")
M_in = TypeVar("M_in", bound=BaseModel, contravariant=True)
R_out = TypeVar("R_out", covariant=True)

INLINE_BYTES = 64 * 1024
"""Bodies up to this size are read in the request's task; larger ones in a thread."""
LARGE_AT_ONCE = 2
"""Large bodies read at once (each holds several times its size in memory meanwhile)."""
MAX_ERRORS = 100
"""Invalid fields listed in one answer."""

BODY_MODELS: list[type[BaseModel]] = []
"""Models documented as request bodies (`json_body`); `app.main` adds their schemas."""


def json_body(*models: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: `model` as its required JSON body, as FastAPI writes it;
    several models: one of them (a body that `Reading.variants` tells apart)."""
    refs = []
    for model in models:
        if model not in BODY_MODELS:
            BODY_MODELS.append(model)
        refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


class Stream(Protocol[M_in, R_out]):
    """A body's large list read an item at a time (`Reading.stream`): `streams` takes the
    items as they are parsed (`app.ingest.jsontext.loads`) and raises `jsontext.Unstreamable` at
    the first one with a problem to report; `finish` makes of the body, validated with
    that list empty, what `prepare` would make of it whole, or None to have it read whole."""

    @property
    def streams(self) -> jsontext.Streams: ...

    def finish(self, body: M_in, raw: bytes) -> R_out | None: ...


@dataclass(frozen=True)
class Reading(Generic[M, R]):
    """How a route reads its body: the model, its pieces, the limits to check on the
    parsed JSON (`limits(data, settings)`: the problems, as FieldErrors, for a 413), and
    what the service keeps of a valid body (`prepare(body, raw, settings)`). With
    `stream`, a large body is first read a piece at a time, and whole only if that finds
    something to report (see `Stream`)."""

    model: type[M]
    prepare: Callable[[M, bytes, Settings], R]
    pieces: Sequence[Piece] = ()
    limits: Callable[[Any, Settings], list[FieldError]] | None = None
    stream: Callable[[Settings], Stream[M, R]] | None = None
    variants: Mapping[str, Reading[Any, R]] = field(default_factory=dict)
    """Other shapes of the body, by the value of its `key` field (a training job's
    `method`): a body whose `key` names one is read as that one says; any other value is
    refused at `key`, naming those accepted. A body without `key` is read as this one."""
    also: Callable[[Any], list[dict[str, Any]]] | None = None
    """Checks the service makes of a valid body (a repeated example id), made of the parsed
    body as well: where validation fails, their errors follow its own, so that one answer
    names every problem (pydantic's errors, as `validate` returns them)."""
    key: str = "method"
    default: str = ""
    """The value of `key` this reading stands for (listed among the accepted ones)."""


async def read_json(request: Request, reading: Reading[M, R]) -> R:
    """Read, check, validate and prepare the request's JSON body (see the module).
    Raises the ProblemError to answer: 422 (with the path of each bad field) or 413."""
    raw = await body_of(request)
    settings: Settings = request.app.state.settings
    content_type = request.headers.get("content-type")

    def read() -> R | ProblemError:
        return _read(raw, content_type, reading, settings)

    if len(raw) <= INLINE_BYTES:
        outcome = read()
    else:
        outcome = await off_the_loop(request, read)
        dispose_after_response(request.scope, outcome)
    if isinstance(outcome, ProblemError):
        raise outcome
    return outcome


async def parse_json(request: Request) -> Any:
    """The request's body parsed strictly (`app.ingest.jsontext.loads`), in a thread when large.
    Raises `JsonTextError` or `JsonValueErrors`."""
    raw = await body_of(request)
    depth = request.app.state.settings.max_json_depth
    if len(raw) <= INLINE_BYTES:
        return jsontext.loads(raw, max_depth=depth)
    return await off_the_loop(request, lambda: jsontext.loads(raw, max_depth=depth))


async def off_the_loop(request: Request, work: Callable[[], R]) -> R:
    """`work()` on a large body in a thread, with the garbage collector paused, at most
    LARGE_AT_ONCE at once per app: a slot is given back when the thread ends, even if the
    request is gone before (a thread cannot be stopped)."""
    state = request.app.state
    if getattr(state, "large_bodies", None) is None:
        state.large_bodies = asyncio.Semaphore(LARGE_AT_ONCE)
    slots: asyncio.Semaphore = state.large_bodies
    await slots.acquire()
    running = asyncio.ensure_future(asyncio.to_thread(_without_gc_pauses, work))
    running.add_done_callback(lambda _: slots.release())
    return await asyncio.shield(running)


def _without_gc_pauses(work: Callable[[], R]) -> R:
    # What `work` builds is freed before it returns, inside the pause, in this thread.
    with gc_paused():
        return work()


def _read(
    raw: bytes, content_type: str | None, reading: Reading[M, R], settings: Settings
) -> R | ProblemError:
    """The body read, or the problem to answer. A problem is returned, not raised: an
    exception raised here would carry this thread's frames, and the body with them, to
    the event loop. What the body was parsed into is freed in the background, a little
    at a time (`dispose`): freed at once, millions of objects would hold the GIL."""
    trash: list[Any] = []
    try:
        return _read_into(raw, content_type, reading, settings, trash)
    finally:
        if len(raw) > INLINE_BYTES:
            dispose(trash)


def _read_into(
    raw: bytes,
    content_type: str | None,
    reading: Reading[M, R],
    settings: Settings,
    trash: list[Any],
) -> R | ProblemError:
    if not raw:
        return _invalid(
            [FieldError(location="body", path="", message="Field required", type="missing")]
        )
    problem = _content_type_problem(content_type)
    if problem is not None:
        return problem
    if reading.stream is not None and len(raw) > INLINE_BYTES:
        streamed = _read_streamed(raw, reading, reading.stream(settings), settings, trash)
        if streamed is not None:
            return streamed
    try:
        data = jsontext.loads(raw, max_depth=settings.max_json_depth, max_errors=MAX_ERRORS)
    except jsontext.JsonTextError as exc:
        trash.append(exc.document)
        exc.document = None
        return _invalid([_text_error(exc)])
    except jsontext.JsonValueErrors as refused:
        trash.append(refused.document)
        refused.document = None
        return _invalid([_text_error(e) for e in refused.errors])
    trash.append(data)
    chosen = _variant(reading, data)
    if isinstance(chosen, FieldError):
        return _invalid([chosen])
    reading = chosen
    if reading.limits is not None:
        over = reading.limits(data, settings)
        if over:
            return LimitExceededError(
                f"{len(over)} limit(s) of this service exceeded; nothing was stored",
                errors=over,
            )
    also = reading.also(data) if reading.also is not None else []  # before `validate`
    body, errors, more = validate(reading.model, data, reading.pieces, MAX_ERRORS)
    if body is None:
        return _invalid(field_errors_of(errors + also), more=more)
    trash.append(body)
    return reading.prepare(body, raw, settings)


def _read_streamed(
    raw: bytes, reading: Reading[M, R], stream: Stream[M, R], settings: Settings, trash: list[Any]
) -> R | ProblemError | None:
    """What `prepare` makes of a body read a piece at a time, or None where the body must
    be read whole: it has something to report, which only the whole body reports in full
    and in order (a fault, a limit, a value the parser checks whole). A text that is not
    JSON is the exception: every item before the fault was taken, so the fault is the
    first thing to report, as the whole reading reports it, and it is reported here."""
    try:
        data = jsontext.loads(raw, max_depth=settings.max_json_depth, streams=stream.streams)
    except jsontext.JsonTextError as exc:
        trash.append(exc.document)
        exc.document = None
        return _invalid([_text_error(exc)])
    except jsontext.Unstreamable:
        return None
    trash.append(data)
    if reading.limits is not None and reading.limits(data, settings):
        return None
    body, _, _ = validate(reading.model, data, reading.pieces, MAX_ERRORS)
    if body is None:
        return None
    trash.append(body)
    return stream.finish(body, raw)


def _variant(reading: Reading[M, R], data: Any) -> Reading[Any, R] | FieldError:
    """The reading the body's `key` names (`Reading.variants`), or the error at `key`."""
    if not reading.variants or not isinstance(data, dict) or reading.key not in data:
        return reading
    value = data[reading.key]
    if value == reading.default:
        return reading
    if isinstance(value, str) and value in reading.variants:
        return reading.variants[value]
    accepted = ", ".join(f"`{v}`" for v in (reading.default, *reading.variants))
    return FieldError(
        location="body",
        path=reading.key,
        message=f"must be one of {accepted}",
        type="literal_error",
    )


def _invalid(errors: list[FieldError], *, more: bool = False) -> InvalidInputError:
    listed = errors[:MAX_ERRORS]
    if more or len(listed) < len(errors):
        detail = f"more than {len(listed)} invalid fields in the request; the first are listed"
    else:
        detail = f"{len(listed)} invalid field(s) in the request"
    return InvalidInputError(detail, errors=listed)


def _content_type_problem(content_type: str | None) -> ProblemError | None:
    """A 415 for a body not sent as JSON (curl's `-d` sends a form's type; a JSON text sent
    as `text/plain` is not read as JSON either), naming the header to send; a 422 for JSON
    in a charset other than UTF-8."""
    message = email.message.Message()
    message["content-type"] = content_type or ""
    subtype = message.get_content_subtype()
    if (
        not content_type
        or message.get_content_maintype() != "application"
        or not (subtype == "json" or subtype.endswith("+json"))
    ):
        sent = f"Content-Type {content_type.split(';')[0]!r}" if content_type else "no Content-Type"
        detail = (
            f"this route reads a JSON body: send Content-Type: application/json ({sent} was sent)"
        )
        error = FieldError(
            location="header", path="content-type", message=detail, type="media_type"
        )
        return UnsupportedMediaTypeError(detail, errors=[error])
    charset = message.get_param("charset")
    if isinstance(charset, str) and charset.lower().replace("-", "") not in ("utf8", "usascii"):
        return _invalid(
            [
                FieldError(
                    location="body",
                    path="",
                    message=f"JSON bodies are UTF-8 (RFC 8259); this one says charset={charset}",
                    type="json_invalid",
                )
            ]
        )
    return None


def _text_error(exc: jsontext.JsonTextError) -> FieldError:
    if exc.pos is not None:
        message = f"JSON decode error: {exc.message} at character {exc.pos}"
    else:
        message = exc.message
    return FieldError(location="body", path=format_path(exc.path), message=message, type=exc.type)


def field_errors_of(errors: list[dict[str, Any]]) -> list[FieldError]:
    return [
        FieldError(
            location="body",
            path=format_path(err["loc"]),
            message=str(err.get("msg", "invalid")),
            type=str(err.get("type", "invalid")),
        )
        for err in errors
    ]
