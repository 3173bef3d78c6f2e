"""Every error leaves the service as RFC 9457 `application/problem+json`."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    IntegrityError,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.status import HTTP_422_UNPROCESSABLE_CONTENT

from app.db import is_locked, is_unavailable
from app.schemas.common import FieldError, Problem

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"
PROBLEM_TYPE = "urn:trainyard:problem:"
_LOCATIONS = {"body", "query", "path", "header", "cookie"}


class ProblemError(Exception):
    """Raised by services; rendered as problem+json by the handler below."""

    status = 400
    title = "Bad Request"
    slug: str | None = None

    def __init__(
        self,
        detail: str,
        *,
        errors: Sequence[FieldError] | None = None,
        headers: dict[str, str] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors = list(errors) if errors is not None else None
        self.headers = headers
        self.extensions = extensions


class NotFoundError(ProblemError):
    status, title, slug = 404, "Not Found", "not-found"


def not_found(
    kind: str, ident: object, *, param: str, detail: str | None = None, location: str = "path"
) -> NotFoundError:
    """The 404 of a resource the caller named: `detail` says which (`no run 'run_x'`), and
    `errors` names the parameter that named it, as a 422 names a body field."""
    message = detail or f"no {kind} {ident!r}"
    error = FieldError.model_validate(
        {"location": location, "path": param, "message": message, "type": "not_found"}
    )
    return NotFoundError(message, errors=[error])


class ConflictError(ProblemError):
    status, title, slug = 409, "Conflict", "conflict"


class ForbiddenError(ProblemError):
    """The key is valid but lacks a scope (`missing_scope` names it)."""

    status, title, slug = 403, "Forbidden", "missing-scope"


class InvalidInputError(ProblemError):
    status, title, slug = 422, "Unprocessable Content", "validation-error"


class LimitExceededError(ProblemError):
    """The request is larger than a limit of the service allows (`errors` names each)."""

    status, title, slug = 413, "Content Too Large", "limit-exceeded"


class UnsupportedMediaTypeError(ProblemError):
    """The body is not in a media type the route reads (`errors` names the header)."""

    status, title, slug = 415, "Unsupported Media Type", "unsupported-media-type"


class UnavailableError(ProblemError):
    status, title, slug = 503, "Service Unavailable", "unavailable"


def format_path(loc: Iterable[str | int]) -> str:
    """("collection", "trajectories", 3, 1) -> "collection.trajectories[3][1]"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def field_errors(
    errors: Iterable[dict[str, Any]], default_location: str = "body"
) -> list[FieldError]:
    result = []
    for err in errors:
        loc = list(err.get("loc", ()))
        location = default_location
        if loc and loc[0] in _LOCATIONS:
            location = loc.pop(0)
        message = str(err.get("msg", "invalid"))
        if err.get("type") == "json_invalid" and loc and isinstance(loc[-1], int):
            # FastAPI puts the character offset of a JSON syntax error where a field's path
            # goes: the error is about the whole body, at that offset.
            reason = (err.get("ctx") or {}).get("error")
            message = f"{message}: {reason}" if reason else message
            message += f" at character {loc.pop()}"
        result.append(
            FieldError(
                location=location,
                path=format_path(loc),
                message=message,
                type=str(err.get("type", "invalid")),
            )
        )
    return result


def problem_response(
    status: int,
    title: str,
    detail: str | None = None,
    *,
    request: Request | None = None,
    slug: str | None = None,
    errors: Sequence[FieldError] | None = None,
    headers: dict[str, str] | None = None,
    **extensions: Any,
) -> JSONResponse:
    body = Problem(
        type=PROBLEM_TYPE + slug if slug else "about:blank",
        title=title,
        status=status,
        detail=detail,
        instance=request.url.path if request is not None else None,
        errors=list(errors) if errors is not None else None,
        **extensions,
    )
    return JSONResponse(
        body.model_dump(mode="json", exclude_none=True),
        status_code=status,
        media_type=PROBLEM_JSON,
        headers=headers,
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(ProblemError)
    async def _problem(request: Request, exc: ProblemError) -> JSONResponse:
        return problem_response(
            exc.status,
            exc.title,
            exc.detail,
            request=request,
            slug=exc.slug,
            errors=exc.errors,
            headers=exc.headers,
            **exc.extensions,
        )

    def _invalid(request: Request, errors: list[FieldError]) -> JSONResponse:
        return problem_response(
            HTTP_422_UNPROCESSABLE_CONTENT,
            "Unprocessable Content",
            f"{len(errors)} invalid field(s) in the request",
            request=request,
            slug="validation-error",
            errors=errors,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _invalid(request, field_errors(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        undecodable = _undecodable_body(exc)
        if undecodable is not None:
            return _invalid(request, [undecodable])
        title = _reason(exc.status_code)
        detail = exc.detail if exc.detail and exc.detail != title else None
        if exc.status_code == 404 and detail is None:
            detail = f"No route matches {request.method} {request.url.path}"
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            allow = _allowed_methods(request, (headers or {}).get("Allow"))
            headers = {**(headers or {}), "Allow": allow}
        return problem_response(exc.status_code, title, detail, request=request, headers=headers)

    @app.exception_handler(IntegrityError)
    async def _integrity(request: Request, exc: IntegrityError) -> JSONResponse:
        log.info("integrity error on %s: %s", request.url.path, exc.orig)
        return problem_response(
            409,
            "Conflict",
            "The request conflicts with existing data",
            request=request,
            slug="conflict",
        )

    @app.exception_handler(DBAPIError)
    async def _database(request: Request, exc: DBAPIError) -> JSONResponse:
        if is_unavailable(exc):
            detail = "The database is busy" if is_locked(exc) else "The database is unavailable"
            log.warning("database error on %s: %s", request.url.path, exc.orig)
            return problem_response(
                503,
                "Service Unavailable",
                detail,
                request=request,
                slug="database-unavailable",
                headers={"Retry-After": "1"},
            )
        if isinstance(exc, DataError) or str(getattr(exc.orig, "sqlstate", "")).startswith("22"):
            # The database refused a value the schema let through (Postgres: a NUL
            # character in a string, a number out of range): SQLSTATE class 22.
            log.info("data error on %s: %s", request.url.path, exc.orig)
            return problem_response(
                422,
                "Unprocessable Content",
                "A value in the request cannot be stored (a NUL character in a string, or a "
                "number out of range)",
                request=request,
                slug="validation-error",
            )
        log.exception("database error on %s %s", request.method, request.url.path)
        return problem_response(500, "Internal Server Error", None, request=request)

    @app.exception_handler(OSError)
    async def _os_error(request: Request, exc: OSError) -> JSONResponse:
        # Connection refused / reset on the way to the database or a backend.
        log.warning("I/O error on %s: %r", request.url.path, exc)
        return problem_response(
            503,
            "Service Unavailable",
            "A dependency is unreachable",
            request=request,
            slug="unavailable",
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(500, "Internal Server Error", None, request=request)


def _undecodable_body(exc: StarletteHTTPException) -> FieldError | None:
    """FastAPI reports a JSON syntax error as a 422 `json_invalid`, but answers a bare 400
    when the body fails to decode otherwise: bytes that are not UTF-8, nesting deeper than
    the JSON parser's recursion limit, an integer too long to convert. Those are the same
    bad input."""
    cause = exc.__cause__
    if exc.status_code != 400:
        return None
    if isinstance(cause, UnicodeDecodeError):
        message = f"the body is not UTF-8 text: {cause.reason} at byte {cause.start}"
    elif isinstance(cause, RecursionError):
        message = "the body nests arrays or objects too deeply to parse"
    elif isinstance(cause, ValueError):  # e.g. an integer of more than 4300 digits
        message = "the body is not valid JSON: " + str(cause).split(";")[0]
    else:
        return None
    return FieldError(location="body", path="", message=message, type="json_invalid")


def _allowed_methods(request: Request, allow: str | None) -> str:
    """Every method the request's path serves. Starlette's 405 names only the methods of
    the first route whose path matched, and GET and POST of one path are two routes: add
    those the OpenAPI document lists for the path."""
    methods = {m.strip() for m in (allow or "").split(",") if m.strip()}
    path = request.scope["path"]
    for template, operations in request.app.openapi().get("paths", {}).items():
        pattern = re.sub(r"\\\{[^/]*?\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, path):
            methods.update(method.upper() for method in operations)
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods))


def _reason(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"
