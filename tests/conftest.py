"""Shared fixtures: a real database per test (SQLite file, or Postgres when
TRAINYARD_TEST_DATABASE_URL is set) and the real app served over loopback HTTP.

The schema is migrated once per session into a template (a SQLite file; a Postgres
database named after the test database) and each test gets a fresh copy of it, so tests
start at head without running Alembic. Tests of the migrations themselves take
`empty_database_url` instead."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import os
import shutil
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn
from sqlalchemy import event, text
from sqlalchemy.engine import Engine, make_url

from app.db import create_engine
from app.jobs.store import QueueStore, store_for
from app.main import create_app
from app.migrate import migrate
from app.server import config as server_config
from app.settings import Settings

POSTGRES_URL = os.environ.get("TRAINYARD_TEST_DATABASE_URL")
# Tests marked `torch` (the cpu backend, tiny models, transformers/peft) need the cpu
# extra; the Python 3.12 environment (.venv-art) has no torch, and skips them all here.
HAS_TORCH = importlib.util.find_spec("torch") is not None
NEEDS_TORCH = "needs torch (the cpu extra), which this environment does not have"
DIALECTS = ["sqlite"] + (["postgres"] if POSTGRES_URL else [])

T = TypeVar("T")


def run_apart(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` to completion on an event loop of its own, in another thread: sync
    fixtures may be set up while a test's loop runs, and must leave that loop alone."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


# -- SQLite: no transaction reads, then writes, without having begun as a writer -------------
# A SQLite transaction begun DEFERRED (`BEGIN`) holds a read snapshot once it reads; its first
# write must then upgrade the lock, and SQLite refuses that at once ("database is locked", no
# busy wait) whenever another connection has committed since the read. Every transaction that
# may write begins IMMEDIATE (`app.db.begin_write`, `write_connection`, `transaction`). This
# watches every SQLite connection of this process, and fails the test in which one upgraded.
_DEFERRED, _READ, _WRITER = "deferred", "read", "writer"
_WRITES = frozenset({"INSERT", "UPDATE", "DELETE", "REPLACE"})
_upgrades: list[str] = []
_transactions: dict[int, str] = {}


def _watch(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
    if conn.dialect.name != "sqlite":
        return
    key = id(conn.connection.driver_connection)
    words = statement.split(None, 2)
    verb = words[0].upper() if words else ""
    state = _transactions.get(key)
    if verb == "BEGIN":
        _transactions[key] = _DEFERRED if len(words) == 1 else _WRITER
    elif state is None or state == _WRITER:
        return
    elif verb in _WRITES or (verb == "WITH" and _WRITES & set(statement.upper().split())):
        if state == _READ:
            # Through the async driver the stack here stops at SQLAlchemy's greenlet: the
            # task's name says which work it was (a job, a request), the statement what.
            with contextlib.suppress(RuntimeError):
                task = asyncio.current_task()
                statement = f"{statement[:80]!r} in task {task.get_name() if task else None}"
            _upgrades.append(statement)
        _transactions[key] = _WRITER
    elif verb in ("SELECT", "WITH"):  # a WITH that writes was caught above
        _transactions[key] = _READ


def _ended(conn: Any) -> None:
    if conn.dialect.name == "sqlite":
        with contextlib.suppress(Exception):
            _transactions.pop(id(conn.connection.driver_connection), None)


event.listen(Engine, "before_cursor_execute", _watch)
event.listen(Engine, "commit", _ended)
event.listen(Engine, "rollback", _ended)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    _upgrades.clear()
    result = yield
    if _upgrades:
        pytest.fail(
            "a SQLite transaction read, then wrote, without beginning as a writer "
            "(`app.db.begin_write`): " + "; ".join(_upgrades[:3]),
            pytrace=False,
        )
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Collect what the last test left, and freeze what survives, before each test.

    Many tests measure how long the event loop stalls, and the clients and in-process
    services they measure run in this process. A full collection walks every object
    the process holds: a tenth of the way through the suite some 975,000 (the imports,
    torch among them, and what each test left), and a full collection then paused
    everything here for 0.46 s, more on a loaded machine, whichever test it fell in. Frozen
    objects are left out of every collection, so a collection during a test walks only
    what that test made; this collection walks only what the last one made."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A module marked `any_database` tests what lies before or beside the database (the
    HTTP edge, bodies on their way in, the event loop under attack, the client libraries):
    its tests need a database to stand on but do not depend on which, so they run on
    SQLite only. Everything that stores, claims, recovers or migrates runs on both.

    A test marked `torch` is skipped, each by name, where torch is not installed."""
    if not HAS_TORCH:
        for item in items:
            if item.get_closest_marker("torch"):
                item.add_marker(pytest.mark.skip(reason=NEEDS_TORCH))
    dropped = [
        item
        for item in items
        if item.get_closest_marker("any_database")
        and "postgres" in getattr(getattr(item, "callspec", None), "params", {}).values()
    ]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(dropped)
        items[:] = [item for item in items if item not in gone]


FIGURES = pytest.StashKey[list[str]]()


@pytest.fixture
def figure(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record what a test measured (a stall's p99, a peak RSS): the run's summary lists
    every figure, whether its test passed or not, so a CI log keeps them."""
    lines = request.config.stash.setdefault(FIGURES, [])

    def record(line: str) -> None:
        lines.append(f"{request.node.nodeid}: {line}")

    return record


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if lines := config.stash.get(FIGURES, []):
        terminalreporter.section("measured figures")
        for line in lines:
            terminalreporter.write_line(line)
    # Every skipped test (or module) by name, under its reason, so a log shows what did not
    # run and why: the torch-only tests where the cpu extra is not installed, among others.
    skipped: dict[str, list[str]] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        skipped.setdefault(reason.removeprefix("Skipped: "), []).append(report.nodeid)
    if skipped:
        terminalreporter.section(f"skipped: {sum(map(len, skipped.values()))}")
        for reason, nodeids in sorted(skipped.items(), key=lambda kv: -len(kv[1])):
            terminalreporter.write_line(f"{len(nodeids)} {reason}")
            for nodeid in nodeids:
                terminalreporter.write_line(f"    {nodeid}")


async def reset_postgres(url: str) -> None:
    engine = create_engine(url)
    async with engine.begin() as conn:
        await conn.execute(text("DROP SCHEMA public CASCADE"))
        await conn.execute(text("CREATE SCHEMA public"))
    await engine.dispose()


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def _on_server(url: str, *statements: str) -> None:
    """Run `statements` (CREATE/DROP DATABASE) from the `postgres` database of `url`'s server."""
    admin = create_engine(
        make_url(url).set(database="postgres").render_as_string(hide_password=False),
        isolation_level="AUTOCOMMIT",
    )
    try:
        async with admin.connect() as conn:
            for statement in statements:
                await conn.execute(text(statement))
    finally:
        await admin.dispose()


async def recreate_postgres(url: str, template: str | None = None) -> None:
    """Drop `url`'s database (whoever is connected) and create it again: empty, or a copy
    of the database `template`."""
    name = _quoted(make_url(url).database or "")
    source = f" TEMPLATE {_quoted(template)}" if template else ""
    await _on_server(
        url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)", f"CREATE DATABASE {name}{source}"
    )


async def drop_postgres(url: str) -> None:
    name = _quoted(make_url(url).database or "")
    await _on_server(url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def _migrate_to_head(url: str) -> None:
    engine = create_engine(url)
    try:
        await migrate(engine)
        if engine.dialect.name == "sqlite":
            # Everything into the main file, so copying that file alone copies the schema.
            async with engine.connect() as conn:
                await conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        await engine.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to head once per session; tests get copies of it."""
    path = tmp_path_factory.mktemp("template") / "trainyard.db"
    run_apart(_migrate_to_head(f"sqlite+aiosqlite:///{path}"))
    for suffix in ("-wal", "-shm", "-journal"):
        leftover = path.with_name(path.name + suffix)
        assert not leftover.exists() or leftover.stat().st_size == 0, leftover
    return path


@pytest.fixture(scope="session")
def postgres_template() -> Iterator[str]:
    """A Postgres database migrated to head once per session, named after the test
    database (two runs on different test databases don't share one); dropped at the end."""
    assert POSTGRES_URL
    url = make_url(POSTGRES_URL)
    name = f"trainyard_template_{url.database}"
    template_url = url.set(database=name).render_as_string(hide_password=False)
    run_apart(recreate_postgres(template_url))
    run_apart(_migrate_to_head(template_url))
    yield name
    run_apart(drop_postgres(template_url))


@pytest.fixture(params=DIALECTS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database at the schema's head on each dialect under test (a copy of the
    session's template; the app need not migrate it)."""
    if request.param == "postgres":
        assert POSTGRES_URL
        run_apart(recreate_postgres(POSTGRES_URL, request.getfixturevalue("postgres_template")))
        return POSTGRES_URL
    path = tmp_path / "trainyard.db"
    shutil.copy(request.getfixturevalue("sqlite_template"), path)
    return f"sqlite+aiosqlite:///{path}"


@pytest.fixture(params=DIALECTS)
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database (no schema at all) on each dialect under test."""
    if request.param == "postgres":
        assert POSTGRES_URL
        run_apart(recreate_postgres(POSTGRES_URL))
        return POSTGRES_URL
    return f"sqlite+aiosqlite:///{tmp_path / 'trainyard.db'}"


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[QueueStore]:
    """The queue store of `database_url`'s dialect, on an engine of its own."""
    engine = create_engine(database_url)
    try:
        yield store_for(engine)
    finally:
        await engine.dispose()


@pytest.fixture
def make_settings(database_url: str, tmp_path: Path) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": database_url,
            "data_dir": tmp_path / "data",
            "migrate_on_start": False,  # database_url is already at head
            "worker_enabled": False,
            "heartbeat_seconds": 0.2,
            # Long enough that no job's lease lapses because the machine is busy (a test
            # may not fail for that); a test of recovery sets a short one and waits for it.
            "lease_seconds": 30.0,
            "poll_seconds": 0.2,
            "retry_base_seconds": 0.05,
        }
        values.update(overrides)
        return Settings(**values)

    return make


class _Server(uvicorn.Server):
    """uvicorn's server, whose main loop also wakes when told to stop (`stop_now`): its own
    looks at `should_exit` every 0.1 s, which each test that serves would wait out."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.stop_now = asyncio.Event()

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_now.wait(), 0.1)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        # uvicorn's own, but for its pauses: it gives the connections 0.1 s after asking
        # them to close, then looks every 0.1 s; this looks every 5 ms (0.1 s a test).
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        state = self.server_state
        grace = self.config.timeout_graceful_shutdown
        deadline = None if grace is None else asyncio.get_running_loop().time() + grace
        while (state.connections or state.tasks) and not self.force_exit:
            if deadline is not None and asyncio.get_running_loop().time() > deadline:
                for task in state.tasks:
                    task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
                break
            await asyncio.sleep(0.005)
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()


class LiveServer:
    """The app under uvicorn on 127.0.0.1, in this event loop; a real HTTP client to it."""

    def __init__(self, app: Any, **config: Any) -> None:
        self.app = app
        options: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "log_level": "warning"}
        options.update(config)
        settings = getattr(app.state, "settings", None)
        config = (
            # The service as `trainyard serve` runs it: its protocol, deadlines and limits.
            server_config(app, settings, lifespan="on", **options)
            if isinstance(settings, Settings)
            else uvicorn.Config(app, lifespan="on", **options)  # a stand-in for another service
        )
        self.server = _Server(config)
        self._task: asyncio.Task[None] | None = None
        self.url = ""
        self.client: httpx.AsyncClient

    async def __aenter__(self) -> LiveServer:
        self._task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.AsyncClient(base_url=self.url, timeout=30)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()
        self.server.should_exit = True
        self.server.stop_now.set()
        assert self._task is not None
        await self._task


@pytest.fixture
def serve(make_settings: Callable[..., Settings]) -> Callable[..., Any]:
    """`async with serve(**settings) as live:` runs the app over loopback HTTP."""

    def start(
        backend_overrides: dict[str, Any] | None = None, port: int = 0, **overrides: Any
    ) -> LiveServer:
        app = create_app(make_settings(**overrides), backend_overrides=backend_overrides)
        return LiveServer(app, port=port)

    return start


@pytest.fixture
async def live(serve: Callable[..., LiveServer]) -> AsyncIterator[LiveServer]:
    async with serve() as server:
        yield server
