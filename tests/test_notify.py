"""`app.notify.Notifier` on the real Postgres server: one LISTEN connection per process,
kept open through whatever takes it away (a terminated backend, a connection that closed
before it was watched, a network that stopped answering), and none left after close."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import create_engine
from app.notify import APPLICATION_NAME, JOBS_CHANNEL, Notifier
from tests.conftest import POSTGRES_URL
from tests.processes import until


@pytest.fixture(params=["postgres"])
async def engine() -> AsyncIterator[AsyncEngine]:
    """An engine on the test server, for looking at sessions and sending NOTIFY."""
    if not POSTGRES_URL:
        pytest.skip("LISTEN/NOTIFY is Postgres'")
    engine = create_engine(POSTGRES_URL)
    try:
        yield engine
    finally:
        await engine.dispose()


async def listen_pids(engine: AsyncEngine) -> set[int]:
    """The server pids of the notifier sessions on this database."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT pid FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = :name"
            ),
            {"name": APPLICATION_NAME},
        )
        return {pid for (pid,) in rows}


async def terminate(engine: AsyncEngine, pid: int) -> None:
    """What a database restart does to a connection."""
    async with engine.begin() as conn:
        await conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})


async def woken_by_notify(notifier: Notifier, engine: AsyncEngine) -> bool:
    await notifier.wait_for_jobs(0)  # drop the wake-up that a new connection gives
    async with engine.begin() as conn:
        await conn.execute(text("SELECT pg_notify(:c, 'x')"), {"c": JOBS_CHANNEL})
    return await notifier.wait_for_jobs(5.0)


@contextlib.asynccontextmanager
async def listening(url: str, **options: Any) -> AsyncIterator[Notifier]:
    notifier = Notifier(**options)
    await notifier.listen(url, events=False)
    try:
        yield notifier
    finally:
        await notifier.close()


async def test_listen_comes_back_after_the_database_drops_it(engine: AsyncEngine) -> None:
    assert POSTGRES_URL
    before = await listen_pids(engine)
    async with listening(POSTGRES_URL) as notifier:
        [pid] = await listen_pids(engine) - before
        await terminate(engine, pid)

        async def replaced() -> bool:
            return notifier.listening and len(await listen_pids(engine) - before - {pid}) == 1

        await until(replaced, timeout=10, what="a new LISTEN session")
        assert pid not in await listen_pids(engine)
        assert await woken_by_notify(notifier, engine)


async def test_a_connection_lost_before_it_is_watched_is_replaced(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncpg tells a termination listener of a loss only if it was added before: the
    keeper also looks at the connection itself."""
    assert POSTGRES_URL
    connect = Notifier._connect
    lost: list[int] = []

    async def connect_then_lose(self: Notifier) -> Any:
        conn = await connect(self)
        if conn is not None and not lost:  # the first one dies before it is handed over
            lost.append(conn.get_server_pid())
            await terminate(engine, lost[0])
            await until(lambda: asyncio.sleep(0, conn.is_closed()), timeout=10)
        return conn

    monkeypatch.setattr(Notifier, "_connect", connect_then_lose)
    before = await listen_pids(engine)
    async with listening(POSTGRES_URL) as notifier:

        async def replaced() -> bool:
            return notifier.listening and len(await listen_pids(engine) - before) == 1

        await until(replaced, timeout=10, what="a new LISTEN session")
        assert lost and lost[0] not in await listen_pids(engine)
        assert await woken_by_notify(notifier, engine)


class SilentPipe:
    """A loopback TCP relay to the server whose connections can go silent: `silence()`
    stops relaying what is open now, both ways, and closes nothing, as a network that lost
    its route does (no FIN, no reset). Connections opened later relay as usual."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.port = 0
        self.flowing: list[asyncio.Event] = []  # one for each connection
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> SilentPipe:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def silence(self) -> None:
        for flowing in self.flowing:
            flowing.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        flowing = asyncio.Event()
        flowing.set()
        self.flowing.append(flowing)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._relay(source, sink, flowing))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _relay(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, flowing: asyncio.Event
    ) -> None:
        try:
            while chunk := await source.read(65536):
                await flowing.wait()
                sink.write(chunk)
                await sink.drain()
        except ConnectionError:
            pass
        finally:
            sink.close()


async def test_a_listen_connection_that_stops_answering_is_replaced(engine: AsyncEngine) -> None:
    """No FIN ever comes: only the probe finds the connection dead."""
    assert POSTGRES_URL
    url = make_url(POSTGRES_URL)
    async with SilentPipe(url.host or "127.0.0.1", url.port or 5432) as pipe:
        through = url.set(host="127.0.0.1", port=pipe.port).render_as_string(False)
        before = await listen_pids(engine)
        async with listening(through, probe_every=0.2, probe_timeout=0.5) as notifier:
            [first] = await listen_pids(engine) - before
            pipe.silence()

            async def replaced() -> bool:
                new = await listen_pids(engine) - before - {first}
                return notifier.listening and len(new) == 1

            await until(replaced, timeout=10, what="a new LISTEN session")
            assert await woken_by_notify(notifier, engine)
            # The silenced session is still open on the server: its socket never closed.
            await terminate(engine, first)


async def test_close_leaves_no_listen_session(engine: AsyncEngine) -> None:
    assert POSTGRES_URL
    before = await listen_pids(engine)
    async with listening(POSTGRES_URL) as notifier:
        [pid] = await listen_pids(engine) - before
        assert notifier.listening
    assert not notifier.listening

    async def gone() -> bool:
        return pid not in await listen_pids(engine)

    await until(gone, timeout=10, what="the LISTEN session to end")
