"""How `trainyard serve` runs uvicorn: its HTTP/1.1 protocol with deadlines and limits on
the connection itself, which no ASGI middleware can see.

- A client has TRAINYARD_HEADER_TIMEOUT_SECONDS to send a request's line and headers once
  it connected or began the request: after that it gets 408 (or, if it sent nothing at
  all, the connection is closed).
- Request line plus headers over TRAINYARD_MAX_HEADER_BYTES get 431.
- An idle keep-alive connection is closed after TRAINYARD_KEEP_ALIVE_SECONDS.
- A body the app answered before reading (401 without a key, 413) is discarded as it
  arrives, for at most TRAINYARD_BODY_TIMEOUT_SECONDS; then the connection is closed.

The body deadline itself (408 for a body that arrives too slowly) is ASGI middleware,
`app.ingest.edge.RequestBody`, so it holds under any server.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.errors import PROBLEM_JSON, PROBLEM_TYPE
from app.settings import Settings


class _HeadersTooLarge(Exception):
    pass


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline, a header size limit, and a
    bounded drain of bodies answered early. Subclassed per server by `protocol()`."""

    header_timeout: float = 10.0
    max_header_bytes: int = 32 * 1024
    drain_timeout: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._drain_timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = True
        self._raw_header_bytes = 0  # bytes received since the last headers completed
        self._header_bytes = 0  # request line and header fields of this request, parsed
        self._refusal: tuple[int, str] | None = None

    # -- the connection ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_headers:
            self._raw_header_bytes += len(data)
        super().data_received(data)
        if (
            self._awaiting_headers
            and self._raw_header_bytes > self.max_header_bytes
            and not self.transport.is_closing()
        ):
            self._refuse(431, self._too_large_detail())

    def send_400_response(self, msg: str) -> None:
        if self._refusal is not None:  # our own callback stopped the parser
            self._refuse(*self._refusal)
            return
        super().send_400_response(msg)

    # -- parser callbacks ----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_headers = True
        self._header_bytes = 0
        if self._header_timer is None:
            self._arm_header_timer()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._raw_header_bytes = 0
        self._cancel(self._header_timer)
        self._header_timer = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_headers = True
        if self._drain_timer is not None:
            # The rest of a body answered early has arrived: the connection is idle now,
            # and uvicorn armed its keep-alive timer before the body ended; arm it again.
            self._cancel(self._drain_timer)
            self._drain_timer = None
            if not self.transport.is_closing() and self.timeout_keep_alive_task is None:
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle  # the cycle just answered (a pipelined next one is not answered)
        if (
            cycle is not None
            and cycle.response_complete
            and cycle.more_body
            and not self.transport.is_closing()
        ):
            # Answered before the body arrived whole: uvicorn discards the rest as it comes,
            # for a bounded time.
            self._drain_timer = self.loop.call_later(self.drain_timeout, self._drain_expired)

    # -- helpers -----------------------------------------------------------------------------

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.max_header_bytes:
            self._refusal = (431, self._too_large_detail())
            raise _HeadersTooLarge  # stops the parser; uvicorn then calls send_400_response

    def _too_large_detail(self) -> str:
        return f"The request line and headers exceed {self.max_header_bytes} bytes"

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_expired)

    def _header_expired(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request's headers are arriving while a response is under way:
            # that response is not cut; the next request's deadline starts again.
            self._arm_header_timer()
            return
        if self._raw_header_bytes == 0:
            self.transport.close()  # connected and said nothing: no answer owed
            return
        self._refuse(
            408, f"The request's headers did not arrive within {self.header_timeout:g} seconds"
        )

    def _drain_expired(self) -> None:
        self._drain_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, status: int, detail: str) -> None:
        """Answer problem+json and close, outside any request (none was parsed)."""
        self._cancel_timers()
        phrase = HTTPStatus(status).phrase
        slug = {408: "request-timeout", 431: "headers-too-large"}[status]
        body = json.dumps(
            {"type": PROBLEM_TYPE + slug, "title": phrase, "status": status, "detail": detail}
        ).encode()
        head = [f"HTTP/1.1 {status} {phrase}"]
        head += [f"{n.decode()}: {v.decode()}" for n, v in self.server_state.default_headers]
        head += [
            f"content-type: {PROBLEM_JSON}",
            f"content-length: {len(body)}",
            "connection: close",
        ]
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        self.transport.close()

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._drain_timer):
            self._cancel(timer)
        self._header_timer = self._drain_timer = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


def protocol(settings: Settings) -> type[GuardedHttpProtocol]:
    """The protocol class with `settings`' deadlines and limits."""
    return type(
        "TrainyardHttpProtocol",
        (GuardedHttpProtocol,),
        {
            "header_timeout": settings.header_timeout_seconds,
            "max_header_bytes": settings.max_header_bytes,
            "drain_timeout": settings.body_timeout_seconds,
        },
    )


def config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn config of `trainyard serve` for `app` (tests run the app under it too)."""
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "http": protocol(settings),
        "timeout_keep_alive": settings.keep_alive_seconds,
        # Open event streams would hold shutdown (and the worker's lease hand-back) forever.
        "timeout_graceful_shutdown": 10,
        "log_level": settings.log_level,
    }
    options.update(overrides)
    return uvicorn.Config(app, **options)
