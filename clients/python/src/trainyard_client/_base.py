"""What the sync and the async client share besides the calls: settings, headers, the
operation tags on methods."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx

from trainyard_client._version import __version__
from trainyard_client.errors import WaitTimeoutError

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = 30.0

F = TypeVar("F", bound=Callable[..., Any])


def operation(operation_id: str) -> Callable[[F], F]:
    """Tag a client method with the `operationId` it calls (`{jobs}`: `training_jobs` or
    `rollout_jobs`, after the resource); the tests check every operation has one."""

    def tag(method: F) -> F:
        method.__operation__ = operation_id  # type: ignore[attr-defined]
        return method

    return tag


def resolve_url(url: str | None) -> str:
    return (url or os.environ.get("TRAINYARD_URL") or DEFAULT_URL).rstrip("/")


def resolve_api_key(api_key: str | None) -> str | None:
    """The key a client sends: `api_key`, else `TRAINYARD_API_KEY`; None (no key) when
    neither holds one. Every call made for the client's user is sent with this one key,
    OpenAI clients built from it (ART's, NAT's) included."""
    key = api_key if api_key is not None else os.environ.get("TRAINYARD_API_KEY")
    return key or None


def headers(api_key: str | None) -> dict[str, str]:
    """A client's headers; `api_key` as `resolve_api_key` returned it."""
    out = {"User-Agent": f"trainyard-client/{__version__}"}
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


def timeout_of(timeout: float | httpx.Timeout) -> httpx.Timeout:
    return timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None, job_id: str) -> float | None:
    """Seconds left before `deadline` (None: no deadline); WaitTimeoutError once passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise WaitTimeoutError(f"job {job_id} had not ended when the wait timed out")
    return left


def stream_timeout(base: httpx.Timeout, left: float | None, read: float) -> httpx.Timeout:
    """The client's timeouts, with the read timeout of an event stream (and never past
    the wait's deadline)."""
    read = read if left is None else min(read, left)
    return httpx.Timeout(connect=base.connect, read=read, write=base.write, pool=base.pool)


@contextlib.contextmanager
def sink(to: str | Path | IO[bytes]) -> Iterator[IO[bytes]]:
    """A path opened for writing (closed after), or the file given (left open)."""
    if isinstance(to, str | Path):
        with Path(to).open("wb") as file:
            yield file
    else:
        yield to
