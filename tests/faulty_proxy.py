"""A loopback HTTP/1.1 proxy that misbehaves on cue, between a client and the real server:
it drops connections (before forwarding a request, or after, losing the answer), answers
on its own (503 with Retry-After, 429), or cuts an event stream after some events.

One request per connection: each forwarded request goes upstream with `Connection: close`,
so the server closes too and no client ever reuses a connection the proxy has closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Action:
    kind: str  # forward | drop_before | drop_after | answer | cut_stream
    status: int = 0
    headers: tuple[tuple[str, str], ...] = ()
    events: int = 0


FORWARD = Action("forward")
DROP_BEFORE = Action("drop_before")  # close without forwarding: nothing reached the server
DROP_AFTER = Action("drop_after")  # forward, read the answer, close without relaying it


def answer(status: int, retry_after: str | None = None) -> Action:
    """Answer with a problem+json body of this status, without forwarding."""
    headers = (("Retry-After", retry_after),) if retry_after is not None else ()
    return Action("answer", status=status, headers=headers)


def cut_stream(events: int) -> Action:
    """Forward, relay the answer until `events` SSE events have passed, then close."""
    return Action("cut_stream", events=events)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    at: float
    action: Action


@dataclass
class FaultyProxy:
    """`plan[(METHOD, path prefix)]`: the actions for the first requests that match, in
    order; forwarded once they are used up (and for anything else)."""

    upstream: str  # host:port of the real server
    plan: dict[tuple[str, str], list[Action]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    url: str = ""
    _used: defaultdict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    _server: asyncio.Server | None = None

    async def __aenter__(self) -> FaultyProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 5)

    def requests(self, method: str, prefix: str) -> list[Seen]:
        return [s for s in self.seen if s.method == method and s.path.startswith(prefix)]

    def _action(self, method: str, path: str) -> Action:
        for (want_method, prefix), actions in self.plan.items():
            if method == want_method and path.split("?")[0].startswith(prefix):
                index = self._used[(want_method, prefix)]
                self._used[(want_method, prefix)] += 1
                return actions[index] if index < len(actions) else FORWARD
        return FORWARD

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        action = self._action(method, target)
        self.seen.append(Seen(method, target, headers, time.monotonic(), action))
        if action.kind == "drop_before":
            writer.transport.abort()
            return
        if action.kind == "answer":
            writer.write(_problem(action))
            await writer.drain()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection(
            *self.upstream.rsplit(":", 1)
        )
        try:
            request = [lines[0]] + [
                line for line in lines[1:] if line and not line.lower().startswith("connection:")
            ]
            request.append("Connection: close")
            upstream_writer.write(("\r\n".join(request) + "\r\n\r\n").encode("latin-1") + body)
            await upstream_writer.drain()
            if action.kind == "drop_after":
                await upstream_reader.read()  # the server answered; the answer is lost
                writer.transport.abort()
                return
            await self._relay(upstream_reader, writer, action)
        finally:
            upstream_writer.close()

    async def _relay(
        self, upstream: asyncio.StreamReader, writer: asyncio.StreamWriter, action: Action
    ) -> None:
        passed = 0
        while chunk := await upstream.read(65536):
            writer.write(chunk)
            await writer.drain()
            if action.kind == "cut_stream":
                passed += chunk.count(b"\nid: ")
                if passed >= action.events:
                    writer.transport.abort()  # mid-stream, as a dead connection would
                    return


def _problem(action: Action) -> bytes:
    body = json.dumps(
        {
            "type": "urn:test:proxy",
            "title": "From the proxy",
            "status": action.status,
            "detail": f"the proxy answered {action.status}",
        }
    ).encode()
    head = [
        f"HTTP/1.1 {action.status} From the proxy",
        "Content-Type: application/problem+json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in action.headers),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body
