"""Errors: every refusal from the API is an `APIError` carrying its RFC 9457 problem."""

from __future__ import annotations

from typing import Any

import httpx

from trainyard_client.models import FieldError, Problem


class TrainyardError(Exception):
    """Base of every error this package raises."""


class TrainyardConnectionError(TrainyardError):
    """The server could not be reached (or the connection broke) on every attempt."""

    def __init__(self, message: str, *, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


class WaitTimeoutError(TrainyardError, TimeoutError):
    """`wait()` or `events()` ran out of time before the job ended (the job goes on)."""


class APIError(TrainyardError):
    """The server answered with an error status and a problem+json body.

    `status`, `type` (`urn:trainyard:problem:…`), `title`, `detail` and `errors` come from
    the problem; `paths` are the failing fields' paths (`collection.trajectories[0][1]…`).
    `attempts` counts the requests sent, retries included; `doubtful`: an earlier one may
    have had its effect (its answer was lost), so this answer may be about that effect.
    """

    status_code = 0

    def __init__(
        self,
        problem: Problem,
        *,
        response: httpx.Response,
        attempts: int = 1,
        doubtful: bool = False,
    ) -> None:
        self.problem = problem
        self.response = response
        self.attempts = attempts
        self.doubtful = doubtful
        super().__init__(self._message())

    @property
    def status(self) -> int:
        return self.problem.status

    @property
    def type(self) -> str:
        return self.problem.type

    @property
    def title(self) -> str:
        return self.problem.title

    @property
    def detail(self) -> str | None:
        return self.problem.detail

    @property
    def errors(self) -> list[FieldError]:
        return list(self.problem.errors or [])

    @property
    def paths(self) -> list[str]:
        """The failing fields: a body field by its path
        (`collection.trajectories[0][1].episode[2].logprobs`), others as `location:path`
        (`header:idempotency-key`, `query:limit`)."""
        return [e.path if e.location == "body" else f"{e.location}:{e.path}" for e in self.errors]

    @property
    def retry_after(self) -> str | None:
        value = self.response.headers.get("Retry-After")
        return None if value is None else str(value)

    def _message(self) -> str:
        text = f"{self.problem.status} {self.problem.title}"
        if self.problem.detail:
            text += f": {self.problem.detail}"
        for error in self.errors[:10]:
            text += f"\n  {error.location} {error.path or '(whole)'}: {error.message}"
        if len(self.errors) > 10:
            text += f"\n  … and {len(self.errors) - 10} more"
        return text


class BadRequestError(APIError):
    status_code = 400


class AuthenticationError(APIError):
    """401: no API key, or not one the server knows."""

    status_code = 401


class NotFoundError(APIError):
    status_code = 404


class ConflictError(APIError):
    """409: the resource's state forbids it (a finished job cancelled, a protected step)."""

    status_code = 409


class PayloadTooLargeError(APIError):
    status_code = 413


class ValidationError(APIError):
    """422: the request was refused field by field (`errors`, `paths`); nothing was stored."""

    status_code = 422


class RateLimitedError(APIError):
    """429: too many requests, or a quota of the project refuses a submission (the
    problem's `quota` and `limit` name it); nothing was stored. The client retries it
    after `Retry-After` unless that is longer than its `max_retry_after`."""

    status_code = 429


class ServerError(APIError):
    """5xx other than 503."""

    status_code = 500


class ServiceUnavailableError(ServerError):
    """503: a dependency (the database) is away; the retries ran out."""

    status_code = 503


_BY_STATUS: dict[int, type[APIError]] = {
    cls.status_code: cls
    for cls in (
        BadRequestError,
        AuthenticationError,
        NotFoundError,
        ConflictError,
        PayloadTooLargeError,
        ValidationError,
        RateLimitedError,
        ServiceUnavailableError,
    )
}


def problem_of(response: httpx.Response) -> Problem:
    """The response's problem body, or one made from its status when it has none (a proxy's
    HTML error page, an empty 502)."""
    body: Any = None
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("status"), int) and "title" in body:
        try:
            return Problem.model_validate(body)
        except ValueError:
            pass
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        # The OpenAI-compatible gateway answers in OpenAI's envelope.
        error = body["error"]
        return Problem(
            type=str(error.get("type") or "about:blank"),
            title=response.reason_phrase or "Error",
            status=response.status_code,
            detail=str(error.get("message") or "") or None,
        )
    return Problem(
        type="about:blank",
        title=response.reason_phrase or "Error",
        status=response.status_code,
        detail=response.text[:500] or None,
    )


def error_for(response: httpx.Response, *, attempts: int = 1, doubtful: bool = False) -> APIError:
    """The typed error for an error response."""
    status = response.status_code
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else APIError)
    return cls(problem_of(response), response=response, attempts=attempts, doubtful=doubtful)
