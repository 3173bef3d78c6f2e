"""The audit log: every request that changed something (or tried to), recorded after its
answer was sent, in batches written by one background task: a request never waits on it.
Never a secret and never a body: who (key, project), what (method, route template,
resource id), its status and its request id."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, delete, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import utcnow, write_connection
from app.models import AuditEventRow

log = logging.getLogger(__name__)

events = cast(Table, AuditEventRow.__table__)
BATCH = 200
MAX_QUEUED = 10_000
PRUNE_BATCH = 1000


def new_event_id(at: datetime) -> str:
    """`aud_` and a time-ordered id: the cursor orders by it."""
    return f"aud_{int(at.timestamp() * 1_000_000):016x}{secrets.token_hex(4)}"


class BatchWriter:
    """Rows of `table` queued in memory (at most MAX_QUEUED: past that, a request waits
    for room after its answer is sent, so memory stays bounded and nothing is dropped) and
    written `BATCH` at a time by one background task (the gateway's usage rows, too:
    `app.tenants.metering`)."""

    table: Table
    name: str

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(MAX_QUEUED)
        self._task: asyncio.Task[None] | None = None
        self._writing = asyncio.Lock()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def put(self, row: dict[str, Any]) -> None:
        await self._queue.put(row)

    def offer(self, row: dict[str, Any]) -> bool:
        """Queue `row` now if there is room (False when full: `put` it later, waiting)."""
        try:
            self._queue.put_nowait(row)
        except asyncio.QueueFull:
            return False
        return True

    async def _run(self) -> None:
        while True:
            first = await self._queue.get()
            await asyncio.shield(self._write([first]))  # close() never cuts a batch

    async def _write(self, batch: list[dict[str, Any]]) -> None:
        async with self._writing:
            while len(batch) < BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            for attempt in range(3):
                try:
                    async with write_connection(self.engine) as conn:
                        await conn.execute(insert(self.table), batch)
                    return
                except Exception:
                    if attempt == 2:
                        log.exception("%s: %d rows not written", self.name, len(batch))
                        return
                    await asyncio.sleep(0.5 * (attempt + 1))

    async def flush(self) -> None:
        """Write what is queued now (a read of the log sees every answer sent before it)."""
        while not self._queue.empty():
            await self._write([])
        async with self._writing:  # a batch the background task took is written too
            pass

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()


class AuditLog(BatchWriter):
    """The audit log's events, written in batches."""

    table = events
    name = "audit-log"

    async def record(self, **event: Any) -> None:
        await self.put(self.row(**event))

    def offer_event(self, **event: Any) -> bool:
        """Queue the event before the answer's last byte is sent, so a read of the log
        that follows the answer (after `flush`) sees it; False when the queue is full."""
        return self.offer(self.row(**event))

    @staticmethod
    def row(**event: Any) -> dict[str, Any]:
        at = utcnow()
        return {"id": new_event_id(at), "at": at, **event}


async def prune(
    engine: AsyncEngine,
    retention_seconds: float,
    *,
    batch: int = PRUNE_BATCH,
    stopping: asyncio.Event | None = None,
) -> int:
    """Delete audit events older than the retention, oldest first, `batch` per transaction.
    Workers may prune at the same time: a row gone already is not deleted twice."""
    cutoff = utcnow() - timedelta(seconds=retention_seconds)
    old = select(events.c.id).where(events.c.at < cutoff).order_by(events.c.at).limit(batch)
    removed = 0
    while True:
        async with write_connection(engine) as conn:
            ids = list((await conn.execute(old)).scalars())
            if ids:
                await conn.execute(delete(events).where(events.c.id.in_(ids)))
        removed += len(ids)
        if len(ids) < batch or (stopping is not None and stopping.is_set()):
            if removed:
                log.info("audit: deleted %d events past retention", removed)
            return removed
        await asyncio.sleep(0)
