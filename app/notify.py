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
# What the LISTEN session is called in pg_stat_activity (unless the URL names one).
APPLICATION_NAME = "trainyard-notify"
# A connection the network dropped without a word (a failover, a partition: no FIN) is
# found by a query every PROBE_EVERY_S that must answer within PROBE_TIMEOUT_S.
PROBE_EVERY_S = 30.0
PROBE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0  # connect and LISTEN, together
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 5.0


class Notifier:
    def __init__(
        self, *, probe_every: float = PROBE_EVERY_S, probe_timeout: float = PROBE_TIMEOUT_S
    ) -> None:
        self._jobs = asyncio.Event()
        # Webhook deliveries may be due (this process's sender waits on it).
        self.webhooks = asyncio.Event()
        self.models_version = 0
        self._event_waiters: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self._probe_every = probe_every
        self._probe_timeout = probe_timeout
        self._conn: Any = None  # the LISTEN connection while it is known to be alive
        self._dsn = ""
        self._server_settings: dict[str, str] = {}
        self._channels: tuple[str, ...] = ()
        self._keeper: asyncio.Task[None] | None = None

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
        task keeps one LISTEN connection open, and opens a new one whenever it is lost (a
        database restart, a terminated backend, a network that stopped answering).
        `events=False`: only queued jobs (a worker process streams no events)."""
        self._channels = (JOBS_CHANNEL, EVENTS_CHANNEL) if events else (JOBS_CHANNEL,)
        url = make_url(database_url)
        if url.get_backend_name() != "postgresql":
            return
        self._dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
        if "application_name" not in url.query:
            self._server_settings = {"application_name": APPLICATION_NAME}
        first = await self._connect()  # a process that can listen at start does, at once
        self._keeper = asyncio.create_task(self._keep_listening(first), name="trainyard-listen")

    async def _keep_listening(self, conn: Any) -> None:
        delay = RETRY_FIRST_S
        was_lost = False
        while True:
            if conn is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                conn = await self._connect()
                continue
            if was_lost:
                log.info("LISTEN re-opened")
            delay = RETRY_FIRST_S
            self._conn = conn
            # Whatever was signalled while we were deaf: have everyone look again.
            self.jobs_changed()
            for job_id in list(self._event_waiters):
                self.events_appended(job_id)
            reason = await self._until_lost(conn)
            self._conn = None
            conn.terminate()
            log.warning("LISTEN connection lost (%s); polling until it is back", reason)
            was_lost = True
            conn = await self._connect()

    async def _until_lost(self, conn: Any) -> str:
        """Return when `conn` is gone, saying how. asyncpg reports a closed socket to a
        termination listener; one that closed before the listener was added is seen by
        `is_closed`, and one that stopped answering by the probe."""
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _conn: lost.set())
        while not (lost.is_set() or conn.is_closed()):
            try:
                async with asyncio.timeout(self._probe_every):
                    await lost.wait()
            except TimeoutError:
                try:
                    await conn.execute("SELECT 1", timeout=self._probe_timeout)
                except Exception as exc:  # timed out, or the connection failed under it
                    return f"no answer to a probe: {exc!r}"
        return "closed"

    async def _connect(self) -> Any:
        """A connection listening on our channels, or None (logged) if there is none now."""
        import asyncpg  # Postgres only: a SQLite process never loads the driver

        conn = None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                conn = await asyncpg.connect(self._dsn, server_settings=self._server_settings)
                for channel in self._channels:
                    await conn.add_listener(channel, self._on_notify)
        except Exception as exc:  # whatever it is (a restart also raises InterfaceError and
            # timeouts): the keeper must go on, a keeper that died would never listen again
            log.warning("LISTEN unavailable, polling until it is back: %r", exc)
            if conn is not None:
                conn.terminate()
            return None
        except asyncio.CancelledError:  # closing: leave no connection behind
            if conn is not None:
                conn.terminate()
            raise
        return conn

    def _on_notify(self, _conn: Any, _pid: int, channel: str, payload: str) -> None:
        if channel == JOBS_CHANNEL:
            self.jobs_changed()
        else:
            self.events_appended(payload)

    @property
    def listening(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close(timeout=2.0)
            self._conn = None
