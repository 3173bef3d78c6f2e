"""Wake-ups: a queued job wakes idle workers, an appended event wakes its streams.

In one process this is plain asyncio. On Postgres the same signals also travel between
processes with LISTEN/NOTIFY (sent inside the writing transaction, so they are delivered
only if it commits). Polling stays as the fallback, so a lost signal only costs latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import asyncpg
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

log = logging.getLogger(__name__)

JOBS_CHANNEL = "trainyard_jobs"
EVENTS_CHANNEL = "trainyard_events"


async def send(executor: AsyncSession | AsyncConnection, channel: str, payload: str) -> None:
    """Queue a cross-process notification, delivered when the transaction commits."""
    bind = executor.get_bind() if isinstance(executor, AsyncSession) else executor
    if bind.dialect.name == "postgresql":
        await executor.execute(text("SELECT pg_notify(:c, :p)"), {"c": channel, "p": payload})


class Notifier:
    def __init__(self) -> None:
        self._jobs = asyncio.Event()
        self.models_version = 0
        self._event_waiters: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self._conn: Any = None

    def jobs_changed(self) -> None:
        self._jobs.set()

    def models_changed(self) -> None:
        """A model was registered: workers in this process start serving it."""
        self.models_version += 1
        self._jobs.set()

    async def wait_for_jobs(self, timeout: float) -> bool:  # noqa: ASYNC109
        """Wait until a job is queued (True) or the timeout passes (False)."""
        try:
            await asyncio.wait_for(self._jobs.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self._jobs.clear()

    def events_appended(self, job_id: str) -> None:
        for waiter in self._event_waiters.get(job_id, ()):
            waiter.set()

    @contextlib.contextmanager
    def watch_events(self, job_id: str) -> Iterator[asyncio.Event]:
        """An event set whenever `job_id` gets new events, from now until the block ends.
        Clear it before reading, so a signal that arrives in between is never lost."""
        waiter = asyncio.Event()
        self._event_waiters[job_id].add(waiter)
        try:
            yield waiter
        finally:
            waiters = self._event_waiters[job_id]
            waiters.discard(waiter)
            if not waiters:
                del self._event_waiters[job_id]

    async def listen(self, database_url: str) -> None:
        """On Postgres, also receive other processes' signals (best effort)."""
        url = make_url(database_url)
        if url.get_backend_name() != "postgresql":
            return
        dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
        try:
            self._conn = await asyncpg.connect(dsn)
            await self._conn.add_listener(JOBS_CHANNEL, self._on_notify)
            await self._conn.add_listener(EVENTS_CHANNEL, self._on_notify)
        except (OSError, asyncpg.PostgresError) as exc:
            log.warning("LISTEN unavailable, falling back to polling: %s", exc)
            self._conn = None

    def _on_notify(self, _conn: Any, _pid: int, channel: str, payload: str) -> None:
        if channel == JOBS_CHANNEL:
            self.jobs_changed()
        else:
            self.events_appended(payload)

    async def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None
