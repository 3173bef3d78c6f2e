"""One pooled client for a model's OpenAI-compatible endpoint: bounded concurrency,
per-request deadlines, retries with backoff on transient failures.

The transport is aiohttp: its HTTP parser is C, and a request costs the client about a
fifth of the CPU httpx's does (`bench/fanout.py`: at 64 requests in flight httpx needed
two cores to keep a 50 ms endpoint busy). The model endpoint is the operator's own (the
gateway or a backend's server), so the egress policy of `app/egress.py`, which guards
calls to services a job names, does not apply here.
"""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from app.egress import default_tls_context

# Statuses worth retrying: request timeout, rate limited, and every server error.
RETRY_STATUSES = frozenset({408, 429})
MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 30.0
# The most bytes of one answer read: a chat.completion with logprobs for every token of a
# long answer, and `n` of them, stays far below it.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
# Idle connections are closed after this many seconds: under the 5 s after which uvicorn
# (the cpu backend's server, vLLM's) closes them itself, so a request is not sent on a
# connection the server is closing (one retry lost).
KEEPALIVE_S = 4.0


class SamplingError(Exception):
    """A chat completion that did not come back. `transient`: retrying later may succeed
    (connection errors, timeouts, 429, 5xx, after the client's own retries); otherwise the
    request itself is wrong (4xx) and would fail again."""

    def __init__(self, message: str, *, transient: bool, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.transient = transient
        self.status = status


def _too_large(status: int) -> SamplingError:
    """An answer over MAX_ANSWER_BYTES: refused, and not worth another try."""
    return SamplingError(
        f"HTTP {status} with an answer over {MAX_ANSWER_BYTES} bytes",
        transient=False,
        status=status,
    )


class SamplingClient:
    """POSTs chat completions to `{base_url}/chat/completions` (`base_url` ends in `/v1`),
    at most `concurrency` at once, over at most `concurrency` kept-alive connections. Each
    attempt has `timeout` seconds in all (connecting, sending, every byte of the answer).
    A 429 (the model is saturated: admission control) is waited out, after its
    `Retry-After`, without spending an attempt: runs and rollouts wait their turn. A
    cancelled caller (its job cancelled, its lease lost) closes the connection, and the
    endpoint stops generating for it."""

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
        url = base_url.rstrip("/") + "/chat/completions"
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError for a port that is not one
        except ValueError:
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.url = url
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._headers = {"accept": "application/json", "content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None
        self._slots = asyncio.Semaphore(concurrency)

    def _client(self) -> aiohttp.ClientSession:
        """The session, made on first use (aiohttp makes it on a running loop)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self.concurrency,
                limit_per_host=self.concurrency,
                keepalive_timeout=KEEPALIVE_S,
                ssl=default_tls_context(),
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                # `chat` bounds each attempt with asyncio.timeout; aiohttp's own timers
                # would only cost CPU on every request.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=None),
                skip_auto_headers=("User-Agent",),
                raise_for_status=False,
                # HTTP(S)_PROXY and NO_PROXY, as httpx honoured them, read once here:
                # aiohttp's trust_env reads them again for every request (0.4 ms each).
                proxy=_proxy_for(self.url),
            )
        return self._session

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The endpoint's chat.completion for `body`, or `SamplingError`."""
        try:
            content = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise SamplingError(f"the request is not valid JSON: {exc}", transient=False) from None
        client = self._client()
        attempts = self.retries + 1
        last_error, last_status = "", None
        attempt = 0
        while attempt < attempts:
            retry_after: float | None = None
            saturated = False
            async with self._slots:
                try:
                    async with asyncio.timeout(self.timeout):
                        status, answer, reason, retry_header = await self._post(client, content)
                except (TimeoutError, aiohttp.ServerTimeoutError):
                    last_error, last_status = f"timed out after {self.timeout:g} s", None
                except aiohttp.ClientConnectorError as exc:
                    last_error, last_status = f"ConnectError: {_os_reason(exc)}", None
                except aiohttp.ClientError as exc:
                    detail = str(exc) or "no detail"
                    last_error, last_status = f"{type(exc).__name__}: {detail}", None
                else:
                    if 200 <= status < 300:
                        return _completion(status, answer)
                    message = f"HTTP {status}: {_error_message(answer, reason)}"
                    if status not in RETRY_STATUSES and status < 500:
                        raise SamplingError(message, transient=False, status=status)
                    last_error, last_status = message, status
                    retry_after = _retry_after(retry_header)
                    # A saturated endpoint (429): wait our turn; it costs no attempt.
                    saturated = status == 429
            if saturated:
                await asyncio.sleep(self._delay(0, retry_after))
                continue
            attempt += 1
            if attempt < attempts:
                await asyncio.sleep(self._delay(attempt - 1, retry_after))
        raise SamplingError(
            f"chat completion failed after {attempts} attempts: {last_error}",
            transient=True,
            status=last_status,
        )

    async def _post(
        self, client: aiohttp.ClientSession, content: bytes
    ) -> tuple[int, bytes, str, str | None]:
        """One attempt: status, body (at most MAX_ANSWER_BYTES), reason, Retry-After."""
        # Redirects are not followed (an answer elsewhere is not this endpoint's): a 3xx
        # is an error like any other 4xx.
        async with client.post(self.url, data=content, allow_redirects=False) as response:
            if (response.content_length or 0) > MAX_ANSWER_BYTES:
                raise _too_large(response.status)
            parts: list[bytes] = []
            size = 0
            async for chunk in response.content.iter_any():  # every chunk, to the end
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    raise _too_large(response.status)
                parts.append(chunk)
            return (
                response.status,
                b"".join(parts),
                response.reason or "",
                response.headers.get("retry-after"),
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
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> SamplingClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


def tokens_of(answer: dict[str, Any]) -> tuple[int, int]:
    """(prompt, completion) tokens of a chat.completion, as its `usage` says; (0, 0) for
    an answer without one (an endpoint that does not count)."""
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return 0, 0
    return _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _proxy_for(url: str) -> str | None:
    """The proxy the environment names for `url` (HTTP_PROXY / HTTPS_PROXY, unless
    NO_PROXY holds its host), or None."""
    parts = urlsplit(url)
    if urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return urllib.request.getproxies().get(parts.scheme)


def _os_reason(exc: aiohttp.ClientConnectorError) -> str:
    return exc.os_error.strerror or type(exc.os_error).__name__


def _json(answer: bytes) -> Any:
    try:
        return json.loads(answer)
    except (ValueError, RecursionError):
        return None


def _completion(status: int, answer: bytes) -> dict[str, Any]:
    parsed = _json(answer)
    if not isinstance(parsed, dict):
        raise SamplingError(
            f"HTTP {status} with a body that is not a JSON object: {_snippet(answer)}",
            transient=False,
            status=status,
        )
    return parsed


def _error_message(answer: bytes, reason: str) -> str:
    """The server's own message: OpenAI's `{"error": {"message"}}`, a few other common
    envelopes, or the body's text."""
    parsed = _json(answer)
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        for value in (error, parsed.get("detail"), parsed.get("message")):
            if isinstance(value, str) and value:
                return value
    return _snippet(answer) or reason or "no detail"


def _retry_after(value: str | None) -> float | None:
    try:
        seconds = float(value or "")
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def _snippet(answer: bytes, limit: int = 500) -> str:
    text = answer[: limit * 4].decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."
