"""One pooled client for a model's OpenAI-compatible endpoint: bounded concurrency,
per-request deadlines, retries with backoff on transient failures."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import ssl
from types import TracebackType
from typing import Any

import httpx

# Statuses worth retrying: request timeout, rate limited, and every server error.
RETRY_STATUSES = frozenset({408, 429})
MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 30.0
# Most connections in one httpx pool (see `SamplingClient.__init__`).
POOL_SIZE = 8


class SamplingError(Exception):
    """A chat completion that did not come back. `transient`: retrying later may succeed
    (connection errors, timeouts, 429, 5xx, after the client's own retries); otherwise the
    request itself is wrong (4xx) and would fail again."""

    def __init__(self, message: str, *, transient: bool, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.transient = transient
        self.status = status


class SamplingClient:
    """POSTs chat completions to `{base_url}/chat/completions` (`base_url` ends in `/v1`),
    at most `concurrency` at once, over at most `concurrency` kept-alive connections."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        concurrency: int = 8,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.2,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if retries < 0 or backoff < 0:
            raise ValueError("retries and backoff must not be negative")
        url = httpx.URL(base_url.rstrip("/") + "/chat/completions")
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.url = url
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        headers = {"accept": "application/json", "content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        # Connections are split over pools of at most POOL_SIZE: httpcore 1.0.x rescans its
        # whole pool, per idle connection, on every request and every response
        # (encode/httpcore#1035), so one pool of 64 connections spent 85% of the client's
        # CPU there (fan-out 11.8x the ideal in bench/fanout.py). A request borrows a free
        # slot, and with it that slot's pool, so no pool ever has to queue a request. Pools
        # of 8 did better on the benchmark than pools of 1, 2 or 4.
        sizes = [min(POOL_SIZE, concurrency - start) for start in range(0, concurrency, POOL_SIZE)]
        self._clients = [
            httpx.AsyncClient(
                headers=headers,
                timeout=httpx.Timeout(timeout),
                verify=_tls_context(),
                limits=httpx.Limits(max_connections=size, max_keepalive_connections=size),
            )
            for size in sizes
        ]
        self._free = [
            client for client, size in zip(self._clients, sizes, strict=True) for _ in range(size)
        ]
        self._slots = asyncio.Semaphore(concurrency)

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The endpoint's chat.completion for `body`, or `SamplingError`."""
        try:
            content = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise SamplingError(f"the request is not valid JSON: {exc}", transient=False) from None
        attempts = self.retries + 1
        last_error, last_status = "", None
        for attempt in range(attempts):
            retry_after: float | None = None
            async with self._slots:
                client = self._free.pop()
                try:
                    async with asyncio.timeout(self.timeout):
                        response = await client.post(self.url, content=content)
                except httpx.UnsupportedProtocol as exc:
                    raise SamplingError(str(exc), transient=False) from None
                except (TimeoutError, httpx.TimeoutException):
                    last_error, last_status = f"timed out after {self.timeout:g} s", None
                except httpx.TransportError as exc:
                    detail = str(exc) or "no detail"
                    last_error, last_status = f"{type(exc).__name__}: {detail}", None
                else:
                    status = response.status_code
                    if 200 <= status < 300:
                        return _completion(response)
                    message = f"HTTP {status}: {_error_message(response)}"
                    if status not in RETRY_STATUSES and status < 500:
                        raise SamplingError(message, transient=False, status=status)
                    last_error, last_status = message, status
                    retry_after = _retry_after(response)
                finally:
                    self._free.append(client)
            if attempt + 1 < attempts:
                await asyncio.sleep(self._delay(attempt, retry_after))
        raise SamplingError(
            f"chat completion failed after {attempts} attempts: {last_error}",
            transient=True,
            status=last_status,
        )

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        """Exponential backoff from `backoff` with jitter in [d/2, d]; at least what the
        server asked for in Retry-After (bounded)."""
        delay = min(self.backoff * 2.0**attempt, MAX_BACKOFF_S)
        delay = delay / 2 + random.random() * delay / 2
        if retry_after is not None:
            delay = max(delay, min(retry_after, MAX_RETRY_AFTER_S))
        return delay

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()

    async def __aenter__(self) -> SamplingClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default verifying context, built once per process and shared: building one
    loads the CA bundle (~25 ms), which every new pool would otherwise do again."""
    return httpx.create_ssl_context()


def _completion(response: httpx.Response) -> dict[str, Any]:
    try:
        parsed = response.json()
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise SamplingError(
            f"HTTP {response.status_code} with a body that is not a JSON object: "
            f"{_snippet(response.text)}",
            transient=False,
            status=response.status_code,
        )
    return parsed


def _error_message(response: httpx.Response) -> str:
    """The server's own message: OpenAI's `{"error": {"message"}}`, a few other common
    envelopes, or the body's text."""
    try:
        parsed = response.json()
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        for value in (error, parsed.get("detail"), parsed.get("message")):
            if isinstance(value, str) and value:
                return value
    return _snippet(response.text) or response.reason_phrase or "no detail"


def _retry_after(response: httpx.Response) -> float | None:
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def _snippet(text: str, limit: int = 500) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."
