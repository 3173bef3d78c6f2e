"""Tinker's futures: every training or sampling request answers with a request id at once,
and `retrieve_future` long-polls for its result.

A future lives in the serving process's memory; a training run's operations are also in
its journal (`app.tinker.journal`), which answers a retrieve after a restart. A request id
is derived from the model, the kind and the SDK's `seq_id`, so a request the SDK sends again
(a lost reply) gets the future of the first, and runs once. Sampling is not journaled: a
sample's future does not outlive its process (a retrieve of it then gets 410, the SDK's
"Promise expired").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

# How long `retrieve_future` waits for a result before answering 408 (the SDK asks again;
# it gives each retrieve 45 s).
LONG_POLL_SECONDS = 20.0
# Results kept after they are ready, for retrieves that come late or again.
KEEP = 4096


@dataclass
class Result:
    """A finished request: a protobuf payload, a JSON payload, or a failure."""

    proto: bytes | None = None
    json: dict[str, Any] | None = None
    error: str | None = None
    category: str = "user"


class Futures:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[Result]] = {}
        self._owners: dict[str, str | None] = {}
        self._order: list[str] = []

    def submit(self, request_id: str, work: Awaitable[Result], *, owner: str | None) -> str:
        """Start `work` as `request_id` unless it exists (a retried request). `owner`: the
        project whose keys may retrieve it (None: any key's)."""
        if request_id in self._tasks:
            if asyncio.iscoroutine(work):
                work.close()
            return request_id
        self._tasks[request_id] = asyncio.ensure_future(work)
        self._owners[request_id] = owner
        self._order.append(request_id)
        while len(self._order) > KEEP:
            gone = self._order.pop(0)
            self._tasks.pop(gone, None)
            self._owners.pop(gone, None)
        return request_id

    def known(self, request_id: str) -> bool:
        return request_id in self._tasks

    def owner(self, request_id: str) -> str | None:
        return self._owners.get(request_id)

    async def wait(self, request_id: str, seconds: float = LONG_POLL_SECONDS) -> Result | None:
        """The result, or None when it is not ready within `seconds`. KeyError: unknown id."""
        task = self._tasks[request_id]
        done, _ = await asyncio.wait({task}, timeout=seconds)
        if not done:
            return None
        exc = task.exception()
        if exc is not None:
            return Result(error=f"{type(exc).__name__}: {exc}", category="server")
        return task.result()

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self._owners.clear()
