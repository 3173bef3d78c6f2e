"""What every request passes before a route: the API key, then its body (deadline and size),
then HEAD served as GET. Pure ASGI middleware, so each answers before the next reads
anything: a request without a valid key is refused before a byte of its body is read."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import secrets
from collections.abc import Collection, Sequence
from typing import Any

from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import problem_response
from app.ingest.freeing import AFTER_RESPONSE, dispose
from app.tenants import Tenants
from app.tenants.keys import ADMIN, SECRET_PREFIX, TINKER_KEY_PREFIX, Principal

log = logging.getLogger(__name__)
UNAUTHORIZED_DETAIL = "Missing or invalid API key: send `Authorization: Bearer <key>`"
TINKER_UNAUTHORIZED_DETAIL = (
    "Missing or invalid API key: send `X-API-Key: tml-<key>` (the Tinker SDK sends "
    "TINKER_API_KEY so) or `Authorization: Bearer <key>`"
)
_CLOSE = {"Connection": "close"}

BODY = "trainyard.body"
"""The scope key under which `RequestBody` leaves the body it read (see `body_of`)."""
JOIN_IN_THREAD = 1 << 20
TINKER_PATHS = "/tinker/"
"""Paths of the Tinker surface, whose SDK sends its key as `X-API-Key`."""
TINKER_API = "/tinker/api/v1/"
# What a Tinker request needs of a key that is not admin, by its route's first segment:
# training `write`; sampling `sample` (or `write`: a key that trains samples its runs); a
# run's info and the RestClient's views `read` (or `write`), its deletions `write`. The
# handshake, sessions,
# capabilities, futures and telemetry: any key (what they reach is the key's project's).
TINKER_SCOPES: dict[str, tuple[str, frozenset[str]]] = {
    **dict.fromkeys(
        (
            "create_model",
            "forward_backward",
            "optim_step",
            "save_weights",
            "save_weights_for_sampler",
            "load_weights",
        ),
        ("write", frozenset({"write"})),
    ),
    **dict.fromkeys(
        ("create_sampling_session", "asample", "samplers"),
        ("sample", frozenset({"sample", "write"})),
    ),
    **dict.fromkeys(
        ("get_info", "training_runs", "checkpoints", "weights_info"),
        ("read", frozenset({"read", "write"})),
    ),
}


async def body_of(request: Request) -> bytes:
    """The request's body, as `RequestBody` read it. Starlette's `Request.body()` would
    join it with an empty last chunk: a copy of the whole body on the event loop."""
    body = request.scope.get(BODY)
    return body if isinstance(body, bytes) else await request.body()


def bearer_token(authorization: str | None) -> str | None:
    """The credentials of an `Authorization: Bearer …` header, read as FastAPI's HTTPBearer
    reads them (scheme case-insensitive, credentials stripped); None without one."""
    if not authorization:
        return None
    scheme, _, credentials = authorization.partition(" ")
    credentials = credentials.strip()
    if scheme.lower() != "bearer" or not credentials:
        return None
    return credentials


def key_matches(keys: Sequence[SecretStr], given: str | None) -> bool:
    """Whether `given` is one of `keys`, compared with every key in constant time, so the
    time taken says nothing about which key (or how much of one) matched."""
    candidate = (given or "").encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(candidate, key.get_secret_value().encode())
    return matched and given is not None


def _route_path(scope: Scope) -> str:
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _has_body(headers: Headers) -> bool:
    length = headers.get("content-length")
    return "transfer-encoding" in headers or (length is not None and length.strip() != "0")


METRICS = "/metrics"
SCRAPER = Principal(key_id=None, project_id=None, scopes=frozenset({"metrics"}))
"""A key from TRAINYARD_METRICS_KEYS: it reads `/metrics` (unless open) and nothing else."""
PRINCIPAL = "trainyard.principal"
"""The scope key under which `ApiKeys` leaves the request's `Principal` (`principal_of`)."""
GATEWAY_PATHS = "/openai/"
READS = frozenset({"GET", "HEAD"})
CHANGES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
READ_ONLY_POSTS = frozenset(
    {
        "/openai/v1/chat/completions",
        *(
            TINKER_API + name
            for name in (
                "client/config",
                "client/dynamic_config",
                "session_heartbeat",
                "get_info",
                "asample",
                "retrieve_future",
                "telemetry",
            )
        ),
    }
)
"""POSTs that change nothing (sampling, the Tinker SDK's handshake, polls, keep-alives and
telemetry, which it discards): left out of the audit log, whose SDK clients poll often."""
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")
_SMALL_ANSWER = 65536  # an answer read for the created resource's id, at most


def principal_of(scope: Scope) -> Principal:
    """Who the request is (the edge put it there); ADMIN where no edge ran."""
    principal = scope.get(PRINCIPAL)
    return principal if isinstance(principal, Principal) else ADMIN


def missing_scope(principal: Principal, method: str, path: str) -> str | None:
    """The scope this request needs and the key lacks (None: it may go on). What a key may
    do within projects and keys is the routes' to say (`app.api.deps.Caller`)."""
    if principal.admin:
        return None
    scopes = principal.scopes
    if path == METRICS:
        return None if "metrics" in scopes else "admin"
    if path.startswith(GATEWAY_PATHS):
        return None if "sample" in scopes else "sample"
    if path.startswith(TINKER_PATHS):
        if method == "DELETE":  # the RestClient's delete_checkpoint
            return None if "write" in scopes else "write"
        needed = TINKER_SCOPES.get(path.removeprefix(TINKER_API).split("/", 1)[0])
        return None if needed is None or scopes & needed[1] else needed[0]
    if path.startswith("/v1/workers") and method in CHANGES:
        return "admin"
    if method in READS:
        return None if scopes & {"read", "write"} else "read"
    return None if "write" in scopes else "write"


def _openai_error(status: int, message: str, code: str, headers: dict[str, str]) -> Any:
    kind = "invalid_request_error" if status == 401 else "permission_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": code}},
        status_code=status,
        headers=headers,
    )


class ApiKeys:
    """Who a request is, from its headers alone, before the app reads a byte of its body
    (the server discards what still arrives of it; `trainyard serve` for at most
    TRAINYARD_BODY_TIMEOUT_SECONDS): a key from TRAINYARD_API_KEYS (admin), or a project
    key (`ty_…`, or `tml-ty_…` as the Tinker SDK sends it) looked up by its hash in
    `app.tenants.keys.KeyBook`'s cache, or on `/metrics` alone a key from
    TRAINYARD_METRICS_KEYS. 401 for no key, an unknown, revoked or expired one; 403 naming
    the scope the key lacks (the gateway answers both in OpenAI's envelope). Without keys
    in the setting or the database the service is open. Open: the paths in `open_paths`,
    exactly.

    Every other request gets an `X-Request-ID` (the client's, if sane) in its answer, and
    one that may change something (POST, PUT, PATCH, DELETE, but for `READ_ONLY_POSTS`) is
    recorded in the audit log, whatever its answer: queued as the answer's last byte is sent
    (`app.tenants.audit`), so a read of the log that follows the answer finds it."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: Sequence[SecretStr],
        open_paths: Collection[str],
        metrics_keys: Sequence[SecretStr] = (),
    ) -> None:
        self.app = app
        self.keys = list(keys)
        self.metrics_keys = list(metrics_keys)
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in self.open_paths:
            await self.app(scope, receive, send)
            return
        path = _route_path(scope)
        headers = Headers(scope=scope)
        tenants: Tenants | None = getattr(getattr(scope.get("app"), "state", None), "tenants", None)
        given = bearer_token(headers.get("authorization"))
        if given is None and path.startswith(TINKER_PATHS):
            given = headers.get("x-api-key")  # how the Tinker SDK sends its key
        secret = given.removeprefix(TINKER_KEY_PREFIX) if given is not None else None
        principal: Principal | None = None
        try:
            if self.keys and key_matches(self.keys, given):
                principal = ADMIN
            elif path == METRICS and self.metrics_keys and key_matches(self.metrics_keys, given):
                principal = SCRAPER
            elif secret is not None and secret.startswith(SECRET_PREFIX) and tenants is not None:
                principal = await tenants.keys.principal(secret)
            if (
                principal is None
                and not self.keys
                and (tenants is None or not await tenants.keys.any_keys())
            ):
                principal = ADMIN  # no key anywhere: open, as before projects
        except Exception as exc:  # the keys could not be read: refuse, never let in
            log.warning("keys: could not be read (%s)", exc)
            response = problem_response(
                503,
                "Service Unavailable",
                "The keys could not be read; try again",
                request=Request(scope),
                slug="unavailable",
                headers={"Retry-After": "1"},
            )
            await response(scope, receive, send)
            return
        request_id = headers.get("x-request-id", "")
        if not REQUEST_ID.match(request_id):
            request_id = "req_" + secrets.token_hex(12)
        method: str = scope["method"]
        audited = tenants is not None and method in CHANGES and path not in READ_ONLY_POSTS
        answer: dict[str, Any] = {"status": 0}
        recorded = False

        def audit_event() -> dict[str, Any]:
            who = principal or Principal(key_id=None, project_id=None, scopes=frozenset())
            return {
                "key_id": who.key_id,
                "project_id": who.project_id,
                "method": method,
                "route": _template(scope, path),
                "resource_id": _resource_id(scope, answer),
                "status": answer["status"],
                "request_id": request_id,
            }

        async def send_with_id(message: Message) -> None:
            nonlocal recorded
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                answer["headers"] = message.get("headers", [])
                message["headers"] = [
                    *answer["headers"],
                    (b"x-request-id", request_id.encode()),
                ]
            elif (
                audited
                and "body" not in answer
                and answer["status"] in (200, 201, 202)
                and not message.get("more_body", False)
                and len(message.get("body", b"")) <= _SMALL_ANSWER
            ):
                answer["body"] = message.get("body", b"")
            if (
                audited
                and tenants is not None
                and not recorded
                and message["type"] == "http.response.body"
                and not message.get("more_body", False)
            ):
                # Queued before the answer's last byte leaves: a client that reads the log
                # after this answer finds it there (past a full queue, the finally waits).
                recorded = tenants.audit.offer_event(**audit_event())
            await send(message)

        try:
            if principal is None:
                await self._refuse(scope, receive, send_with_id, path, 401, None)
                return
            scope[PRINCIPAL] = principal
            lacking = missing_scope(principal, method, path)
            if lacking is not None:
                await self._refuse(scope, receive, send_with_id, path, 403, lacking)
                return
            await self.app(scope, receive, send_with_id)
        finally:
            if audited and answer["status"] and tenants is not None and not recorded:
                await tenants.audit.record(**audit_event())

    async def _refuse(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        path: str,
        status: int,
        lacking: str | None,
    ) -> None:
        if status == 401:
            detail, code = UNAUTHORIZED_DETAIL, "invalid_api_key"
            if path.startswith(TINKER_PATHS):
                detail = TINKER_UNAUTHORIZED_DETAIL
            headers = {"WWW-Authenticate": "Bearer"}
        else:
            detail, code = f"This key lacks the `{lacking}` scope", "missing_scope"
            headers = {}
        if path.startswith(GATEWAY_PATHS):
            response = _openai_error(status, detail, code, headers)
        elif status == 401:
            response = problem_response(
                401, "Unauthorized", detail, request=Request(scope), headers=headers
            )
        else:
            response = problem_response(
                403,
                "Forbidden",
                detail,
                request=Request(scope),
                slug="missing-scope",
                missing_scope=lacking,
            )
        await response(scope, receive, send)


def _template(scope: Scope, path: str) -> str:
    route = scope.get("route")
    template = getattr(route, "path", None)
    return (template if isinstance(template, str) else path)[:256]


def _resource_id(scope: Scope, answer: dict[str, Any]) -> str | None:
    """The resource a change was made to: the last parameter of its path, else the id in
    the created resource's `Location`, else the `id` (or `name`) of a small JSON answer."""
    params = scope.get("path_params") or {}
    created = _created_id(answer)
    if params and (answer["status"] != 201 or created is None):
        return str(list(params.values())[-1])[:256]
    return created


def _created_id(answer: dict[str, Any]) -> str | None:
    for name, value in answer.get("headers", []):
        if name.lower() == b"location":
            return value.decode("latin-1").rstrip("/").rsplit("/", 1)[-1][:256] or None
    body = answer.get("body")
    if body:
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if isinstance(data, dict):
            for key in ("id", "name"):
                if isinstance(data.get(key), str):
                    return str(data[key])[:256]
    return None


class RequestBody:
    """Reads a request's body whole before the app does, within a size limit and a
    deadline, and hands it on in one piece.

    - A declared `Content-Length` over the limit gets 413 before a byte is read; a body
      without one (chunked) is counted as it arrives and refused once it passes the limit:
      the same `body-too-large` problem either way.
    - A body that has not fully arrived `timeout_seconds` after the request started gets
      408 (`request-timeout`) and the connection is closed: a client sending a byte a
      second holds nothing for long.
    After a 413 the connection stays open, so that the client reads the answer rather than
    a reset: the server discards the rest of the body as it arrives.
    """

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, timeout_seconds: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.timeout_seconds = timeout_seconds

    def _too_large(self, scope: Scope, size: int | None) -> Any:
        got = f"The body has {size} bytes; " if size is not None else "The body is too large; "
        return problem_response(
            413,
            "Content Too Large",
            got + f"the limit is {self.max_body_bytes}",
            request=Request(scope),
            slug="body-too-large",
        )

    def _timed_out(self, scope: Scope) -> Any:
        return problem_response(
            408,
            "Request Timeout",
            f"The body did not arrive within {self.timeout_seconds:g} seconds",
            request=Request(scope),
            slug="request-timeout",
            headers=_CLOSE,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, int(declared))(scope, receive, send)
            return
        if not _has_body(headers):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout_seconds):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client is gone: nobody to answer
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        await self._too_large(scope, None)(scope, receive, send)
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await self._timed_out(scope)(scope, receive, send)
            return
        # bytes.join copies without the GIL from 1 MiB on: in a thread, the loop serves
        # meanwhile (50 MB took 20-100 ms here, more on a loaded machine).
        body = (
            b"".join(chunks) if size < JOIN_IN_THREAD else await asyncio.to_thread(b"".join, chunks)
        )
        del chunks
        scope[BODY] = body
        handed = False

        async def replay() -> Message:
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            # What the route built from a large body: freed in the background, a piece at
            # a time, now that the route's frames (and their references) are gone.
            built = scope.pop(AFTER_RESPONSE, None)
            if built:
                dispose(built)


class HeadAsGet:
    """HEAD on a GET route answers as GET does (status, headers, `Content-Length`) with no
    body. FastAPI's routes match GET only, so HEAD would be a 405 whose `Allow` lists GET.
    A streamed answer (an event stream) ends as soon as its headers are sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        inner = {**scope, "method": "GET"}
        done = False

        async def head_send(message: Message) -> None:
            nonlocal done
            if done:
                return
            if message["type"] == "http.response.body":
                done = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await send(message)

        async def head_receive() -> Message:
            if done:
                return {"type": "http.disconnect"}
            return await receive()

        try:
            await self.app(inner, head_receive, head_send)
        finally:
            if "route" in inner:  # for the metrics, which label requests by route
                scope["route"] = inner["route"]
