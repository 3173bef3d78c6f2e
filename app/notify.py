"""Wake-ups: a queued job wakes idle workers, an appended event wakes its streams.

In one process this is plain asyncio. On Postgres the same signals also travel between
processes with LISTEN/NOTIFY: triggers on `jobs` and `job_events` (migration 0003) send
them from inside the writing transaction, so they are delivered only if it commits.
Polling stays as the fallback, so a lost signal only costs latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from sqlalchemy.engine import make_url

log = logging.getLogger(__name__)

JOBS_CHANNEL = "trainyard_jobs"
EVENTS_CHANNEL = "trainyard_events"


class Notifier:
    def __init__(self) -> None:
        self._jobs = asyncio.Event()
        # Webhook deliveries may be due (this process's sender waits on it).
        self.webhooks = asyncio.Event()
        self.models_version = 0
        self._event_waiters: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self._conn: Any = None
        self._dsn = ""
        self._channels: tuple[str, ...] = ()
        self._closing = False
        self._reconnect: asyncio.Future[None] | None = None

    def jobs_changed(self) -> None:
        self._jobs.set()

    def webhooks_due(self) -> None:
        """A state change or a test message may have queued webhook deliveries."""
        self.webhooks.set()

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

    async def listen(self, database_url: str, *, events: bool = True) -> None:
        """On Postgres, also receive other processes' signals, and keep receiving them: a
        lost LISTEN connection (a database restart) is re-opened in the background.
        `events=False`: only queued jobs (a worker process streams no events)."""
        self._channels = (JOBS_CHANNEL, EVENTS_CHANNEL) if events else (JOBS_CHANNEL,)
        url = make_url(database_url)
        if url.get_backend_name() != "postgresql":
            return
        self._dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
        if not await self._connect():
            self._reconnect_later()

    async def _connect(self) -> bool:
        import asyncpg  # Postgres only: a SQLite process never loads the driver

        conn = None
        try:
            conn = await asyncpg.connect(self._dsn)
            for channel in self._channels:
                await conn.add_listener(channel, self._on_notify)
        except Exception as exc:  # whatever it is (a restart also raises InterfaceError and
            # timeouts): the reconnect loop must go on, a loop that died would never listen
            log.warning("LISTEN unavailable, polling until it is back: %s", exc)
            if conn is not None:
                conn.terminate()
            return False
        conn.add_termination_listener(lambda _conn: self._reconnect_later())
        self._conn = conn
        # Whatever was signalled while we were deaf: have everyone look again.
        self.jobs_changed()
        for job_id in list(self._event_waiters):
            self.events_appended(job_id)
        return True

    def _reconnect_later(self) -> None:
        self._conn = None
        if not self._closing and (self._reconnect is None or self._reconnect.done()):
            self._reconnect = asyncio.ensure_future(self._reconnect_loop())

    async def _reconnect_loop(self) -> None:
        delay = 0.5
        while not self._closing and not await self._connect():
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

    def _on_notify(self, _conn: Any, _pid: int, channel: str, payload: str) -> None:
        if channel == JOBS_CHANNEL:
            self.jobs_changed()
        else:
            self.events_appended(payload)

    @property
    def listening(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    async def close(self) -> None:
        self._closing = True
        if self._reconnect is not None:
            self._reconnect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconnect
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None
