"""Engine, sessions and the column types that behave the same on SQLite and Postgres."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import aiosqlite
from sqlalchemy import JSON, Connection, DateTime, Engine, Executable, MetaData, Select, event
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.connectors.asyncio import AsyncAdapt_dbapi_connection
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.sqlite.aiosqlite import (
    AsyncAdapt_aiosqlite_connection,
    AsyncAdapt_aiosqlite_cursor,
    AsyncAdapt_aiosqlite_dbapi,
)
from sqlalchemy.engine import URL, Dialect, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.types import TypeDecorator
from sqlalchemy.util import EMPTY_DICT
from sqlalchemy.util.concurrency import await_

# Named constraints from the first migration on, so later migrations can drop them by name
# on both dialects (SQLite batch mode needs names).
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


JSONType = JSON().with_variant(JSONB(), "postgresql")


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on both dialects (SQLite stores naive text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


def json_dumps(value: Any) -> str:
    """The serializer of every JSON column. NaN and Infinity (a diverged loss, say) are
    stored as null: Postgres refuses them in JSON, and so do strict JSON readers. Numeric
    scalars of numpy or torch (what trainers report metrics in) are stored as numbers."""
    try:
        return json.dumps(value, allow_nan=False, default=_number)
    except ValueError:
        return json.dumps(_finite(value), allow_nan=False, default=_number)


def _number(value: Any) -> float | int:
    item = getattr(value, "item", None)  # numpy and torch scalars
    number = item() if callable(item) else value
    if isinstance(number, int | float) and not isinstance(number, bool):
        return number
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _finite(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    if not isinstance(value, str | int | bool | type(None)):
        with contextlib.suppress(TypeError):
            value = _number(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value


def _sqlite_on_connect(busy_timeout: float) -> Callable[[Any, Any], None]:
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" hook emit BEGIN itself (see _sqlite_on_begin).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # WAL: readers never block the writer and the writer never blocks readers.
        cursor.execute("PRAGMA journal_mode=WAL")
        # Rows that point at missing parents are bugs; SQLite ignores FKs unless asked.
        cursor.execute("PRAGMA foreign_keys=ON")
        # NORMAL is durable in WAL mode across application crashes (only power loss can
        # lose the last commits), and much faster than FULL.
        cursor.execute("PRAGMA synchronous=NORMAL")
        # Wait for a competing writer instead of failing at once with SQLITE_BUSY; past
        # the timeout the request answers 503 with Retry-After (app/errors.py).
        cursor.execute(f"PRAGMA busy_timeout={round(busy_timeout * 1000)}")
        cursor.close()

    return on_connect


POOL_SPARE = 8
"""Connections a process keeps beyond its worker's jobs: for API requests and the loop."""

WRITE = {"trainyard_write": True}
"""Execution options of a transaction that will write (see `_sqlite_on_begin`)."""


INLINE_WRITE = {**WRITE, "trainyard_inline": True}
"""A writing transaction whose statements are small by design (`write_connection`: a
job's final write, a run's move, a claim): on SQLite, once it holds the write lock, each of
its statements runs on the event loop's thread, not in aiosqlite's (see `_small`).

Holding the lock (`BEGIN IMMEDIATE`, WAL), a statement waits on no other connection: it
reads pages from the file's cache and writes into its own, ~5 to 20 µs for a row. The trip to
aiosqlite's thread and back costs ~90 µs of hand-offs and wake-ups, and a statement
~300 to 400 µs from Python with SQLAlchemy's awaiting around it, against 120 to 150 µs on
the loop's thread, idle (`bench/README.md`, "A hand-over on the loop's thread").
`BEGIN IMMEDIATE` (which waits up to the busy timeout for another writer) and `COMMIT`
(which may checkpoint the WAL: disk writes and an fsync) still make the trip."""

INLINE_MAX_BYTES = 64 * 1024
INLINE_MAX_PARAMETERS = 512


def _small(parameters: Any, many: bool) -> bool:
    """Whether a statement's parameters are few and short enough to run it on the loop's
    thread: a large value (a job's payload) or a long list of ids (a batch deleted) makes
    the trip, so no statement holds the loop for long."""
    rows = parameters if many else (parameters,)
    count = size = 0
    for row in rows:
        if row is None:
            continue
        values = row.values() if isinstance(row, dict) else row
        count += len(values)
        for value in values:
            if isinstance(value, str | bytes | bytearray):
                size += len(value)
            elif isinstance(value, memoryview):  # a job's payload, compressed
                size += value.nbytes
        if count > INLINE_MAX_PARAMETERS or size > INLINE_MAX_BYTES:
            return False
    return True


def _sqlite_on_begin(conn: Any) -> None:
    # A transaction that reads and then writes takes the write lock up front: started
    # DEFERRED, it could fail mid-way with SQLITE_BUSY when upgrading its lock. Read-only
    # transactions stay DEFERRED so they never wait for a writer (WAL).
    options = conn.get_execution_options()
    write = options.get("trainyard_write", False)
    adapted = conn.connection.dbapi_connection
    if isinstance(adapted, _OneTripConnection):
        adapted.inline = False  # until this BEGIN has the lock (it makes the trip)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
    if isinstance(adapted, _OneTripConnection):
        adapted.inline = write and options.get("trainyard_inline", False)


def _one_trip(
    connection: sqlite3.Connection, operation: str, parameters: Any, many: bool
) -> tuple[Any, int, int | None, list[Any] | None]:
    """A statement whole, in aiosqlite's thread: execute, fetch, close."""
    cursor = connection.cursor()
    try:
        if many:
            cursor.executemany(operation, parameters)
        elif parameters is None:
            cursor.execute(operation)
        else:
            cursor.execute(operation, parameters)
        description = cursor.description
        rows = cursor.fetchall() if description else None
        return description, cursor.rowcount, cursor.lastrowid, rows
    finally:
        cursor.close()


class _OneTripCursor(AsyncAdapt_aiosqlite_cursor):
    """A SQLite statement in one trip to aiosqlite's thread, where SQLAlchemy's adapter
    makes three or four (open a cursor, execute, fetch, close), each a hand-off to the
    thread and a wake-up of the event loop: ~320 µs a statement against ~170 µs here, idle.
    A run's hand-over writes ~19 statements in one transaction (`bench/runs.py`). The
    statement runs on the same connection, in the same thread, under the same lock."""

    __slots__ = ("_arraysize", "_description", "_lastrowid", "_rowcount")

    def __init__(self, adapt_connection: AsyncAdapt_dbapi_connection) -> None:
        self._adapt_connection = adapt_connection
        self._connection = adapt_connection._connection
        self._cursor = None  # type: ignore[assignment]  # none is opened in the thread
        self._soft_closed_memoized = EMPTY_DICT
        self._rows = collections.deque()
        self._description: Any = None
        self._rowcount = -1
        self._lastrowid: int | None = None
        self._arraysize = 1

    @property
    def description(self) -> Any:
        return self._description

    @property
    def rowcount(self) -> int:
        return self._rowcount

    @property
    def lastrowid(self) -> Any:
        return self._lastrowid

    @property
    def arraysize(self) -> int:
        return self._arraysize

    @arraysize.setter
    def arraysize(self, value: int) -> None:
        self._arraysize = value

    async def _async_soft_close(self) -> None:
        pass  # nothing is open in the thread: the rows are here

    def close(self) -> None:
        self._rows.clear()

    def setinputsizes(self, *inputsizes: Any) -> None:
        pass  # sqlite3's does nothing

    async def _execute_async(self, operation: Any, parameters: Any) -> None:
        await self._trip(operation, parameters, many=False)

    async def _executemany_async(self, operation: Any, seq_of_parameters: Any) -> None:
        await self._trip(operation, seq_of_parameters, many=True)

    async def _trip(self, operation: Any, parameters: Any, *, many: bool) -> None:
        connection, adapted = self._connection, self._adapt_connection
        mutex = adapted._execute_mutex
        if (
            cast(_OneTripConnection, adapted).inline
            and connection._conn.in_transaction
            and not mutex.locked()
            and _small(parameters, many)
        ):
            description, rowcount, lastrowid, rows = _one_trip(
                connection._conn, operation, parameters, many
            )
        else:
            async with mutex:
                description, rowcount, lastrowid, rows = await connection._execute(
                    _one_trip, connection._conn, operation, parameters, many
                )
        self._description, self._rowcount, self._lastrowid = description, rowcount, lastrowid
        self._rows = collections.deque(rows or ())


class _OneTripConnection(AsyncAdapt_aiosqlite_connection):
    __slots__ = ("inline",)
    _cursor_cls = _OneTripCursor

    def __init__(self, dbapi: Any, connection: Any) -> None:
        super().__init__(dbapi, connection)
        self.inline = False  # set as a transaction begins: see `_sqlite_on_begin`

    def rollback(self) -> None:
        # The pool rolls back every connection given back to it, after a commit too: no
        # trip where no transaction is open (the connection is idle, its flag settled).
        connection = self._connection
        if connection._connection is not None and not connection._connection.in_transaction:
            return
        super().rollback()


class _OneTripDriver(AsyncAdapt_aiosqlite_dbapi):
    """aiosqlite, as SQLAlchemy adapts it, with `_OneTripCursor` (given to the dialect
    as its `module`)."""

    def connect(self, *args: Any, **kwargs: Any) -> AsyncAdapt_aiosqlite_connection:
        creator = kwargs.pop("async_creator_fn", None)  # `create_engine(async_creator=)`
        if creator is not None:
            return _OneTripConnection(self, await_(creator(*args, **kwargs)))
        connection = self.aiosqlite.connect(*args, **kwargs)
        connection._thread.daemon = True  # as SQLAlchemy's: a forgotten one ends with us
        return _OneTripConnection(self, await_(connection))


def create_engine(
    database_url: str, *, sqlite_busy_timeout: float = 5.0, pool_size: int = 8, **kwargs: Any
) -> AsyncEngine:
    """`sqlite_busy_timeout`: seconds a SQLite statement waits for another writer's lock.
    `pool_size`: connections kept open; at least what runs at once (a worker's jobs and
    the API's requests), or every burst opens and closes connections beyond it."""
    url = make_url(database_url)
    if url.database not in (None, "", ":memory:"):
        kwargs.setdefault("pool_size", pool_size)
    if url.get_backend_name() == "sqlite":
        if url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        if url.get_driver_name() == "aiosqlite":
            kwargs.setdefault("module", _OneTripDriver(aiosqlite, sqlite3))
        engine = create_async_engine(url, json_serializer=json_dumps, **kwargs)
        event.listen(engine.sync_engine, "connect", _sqlite_on_connect(sqlite_busy_timeout))
        event.listen(engine.sync_engine, "begin", _sqlite_on_begin)
        return engine
    engine = create_async_engine(url, json_serializer=json_dumps, **kwargs)
    _ping_when_idle(engine)
    return engine


PING_AFTER_IDLE_SECONDS = 1.0


def _ping_when_idle(engine: AsyncEngine) -> None:
    """Check a pooled connection before use if it sat idle (a database restart may have
    closed it meanwhile): busy connections skip the round trip that `pool_pre_ping` would
    add to every transaction. One the server dropped is replaced before anyone uses it."""
    dialect = engine.dialect

    def mark_idle(_dbapi_connection: Any, record: Any, *_: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    def check(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.get("idle_since", 0.0)
        if time.monotonic() - idle_since < PING_AFTER_IDLE_SECONDS:
            return
        try:
            dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise DisconnectionError(f"pooled connection is gone: {exc}") from exc

    event.listen(engine.sync_engine, "connect", mark_idle)
    event.listen(engine.sync_engine, "checkin", mark_idle)
    event.listen(engine.sync_engine, "checkout", check)


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False, autoflush=False)


class Lookup:
    """A one-row read by key that requests make often (the GET of a job), for
    `Reader.row`. On SQLite it is compiled once and run on the event loop's connection
    straight through the driver, each column converted by its type's own result processor
    (the JSON and time types as SQLAlchemy would): SQLAlchemy's execution of the same read
    cost ~80 µs here, the driver's ~12 µs, of a request of ~1 ms (`bench/reads.py`).
    Elsewhere it is its statement. Its parameters must need no conversion (strings,
    numbers): checked when it is compiled."""

    __slots__ = ("_plan", "statement")

    def __init__(self, statement: Select[Any]) -> None:
        self.statement = statement
        self._plan: tuple[SQLCompiler, str, list[Callable[[Any], Any] | None]] | None = None

    def first(self, connection: Connection, params: dict[str, Any]) -> tuple[Any, ...] | None:
        if connection.dialect.name != "sqlite" or connection.dialect.paramstyle != "qmark":
            raise TypeError(f"Lookup runs on SQLite's driver, not {connection.dialect.name}")
        compiled, sql, processors = self._plan or self._compile(connection.dialect)
        values = compiled.construct_params(params)
        driver = connection.connection.driver_connection
        assert driver is not None
        cursor = driver.execute(sql, tuple(values[name] for name in compiled.positiontup or ()))
        try:
            row = cursor.fetchone()
        finally:
            cursor.close()
        if row is None:
            return None
        return tuple(
            value if convert is None else convert(value)
            for value, convert in zip(row, processors, strict=True)
        )

    def _compile(
        self, dialect: Dialect
    ) -> tuple[SQLCompiler, str, list[Callable[[Any], Any] | None]]:
        compiled = self.statement.compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler)
        for bind in compiled.binds.values():
            if bind.expanding or bind.literal_execute:
                raise TypeError(f"Lookup: parameter {bind.key!r} is rendered at execution")
            if bind.type.dialect_impl(dialect).bind_processor(dialect) is not None:
                raise TypeError(f"Lookup: parameter {bind.key!r} would need converting")
        processors: list[Callable[[Any], Any] | None] = [
            column.type.dialect_impl(dialect).result_processor(dialect, None)
            for column in self.statement.selected_columns
        ]
        plan = self._plan = (compiled, str(compiled), processors)
        return plan


READ_THREADS = 4
"""Threads that run SQLite reads: reads wait for none of the writer's locks (WAL), so these
are enough for any number of requests to share."""


class Reader:
    """Reads that an API request makes alone (one job, say), each in one trip, returning
    detached rows.

    SQLite: aiosqlite sends every cursor call to its connection's thread and waits for the
    answer: BEGIN, execute, fetch, close and the rollback are each a trip, and the GET of
    one job made 18 of them (`bench/reads.py`). Here a read runs on a synchronous
    connection, read-only (`PRAGMA query_only`), without BEGIN (a statement is its own
    snapshot), in one of two places:
    - `row` (one row by its key: a GET) runs on the event loop. It takes ~50 µs, where the
      hop to a thread and back cost ~350 µs in a request here (two thread wake-ups). It
      never waits: its connection has no busy timeout, so a lock that would hold it (WAL
      readers wait for none of the writer's, only for a recovery or an exclusive-mode
      writer) fails it at once, and it is read again in a reading thread that may wait.
    - every other read (pages, ORM rows) runs in a small pool of reading threads.
    Postgres: asyncpg speaks to the server from the event loop; reads use a connection or
    a session. An in-memory SQLite database is one per connection, so its reads do too."""

    def __init__(self, engine: AsyncEngine, *, sqlite_busy_timeout: float = 5.0) -> None:
        self._engine = engine
        self._sync: Engine | None = None
        self._on_loop: Connection | None = None
        self._closed = False
        self._threads: ThreadPoolExecutor | None = None
        url = engine.url
        if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
            self._sync = _sqlite_reading_engine(url.set(drivername="sqlite"), sqlite_busy_timeout)
            self._threads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="trainyard-read")

    async def scalar(self, statement: Executable, params: dict[str, Any] | None = None) -> Any:
        """The first column of the first row (an ORM row for `select(Row)`), or None.
        `params`: the values of the statement's `bindparam`s."""
        return await self._run(lambda session: session.scalar(statement, params))

    async def scalars(self, statement: Executable) -> Sequence[Any]:
        """The first column of every row."""
        return await self._run(lambda session: session.scalars(statement).all())

    async def first(self, statement: Executable) -> Any:
        """The first row, whole (`select(A, B)`: a row of an A and a B), or None."""
        return await self._run(lambda session: session.execute(statement).first())

    async def all(self, statement: Executable) -> Sequence[Any]:
        return await self._run(lambda session: session.execute(statement).all())

    async def row(
        self, statement: Executable | Lookup, params: dict[str, Any] | None = None
    ) -> Any:
        """The first row of a Core statement (table columns, no ORM entity), or None. For
        a lookup of one row by its key: on SQLite it runs on the event loop (see above),
        and a `Lookup` there goes straight to the driver."""
        lookup, core = (
            (statement, statement.statement) if isinstance(statement, Lookup) else (None, statement)
        )

        def read(connection: Connection) -> Any:
            return connection.execute(core, params).first()

        if self._sync is not None:
            connection = self._on_loop
            if connection is None or connection.invalidated or connection.closed:
                connection = await self._open_loop_connection()
            try:
                if lookup is not None:
                    return lookup.first(connection, params or {})
                return read(connection)
            except OperationalError as exc:
                if not is_locked(exc):
                    raise
            except sqlite3.Error as exc:  # the driver's own, from a `Lookup`
                if not _locked_message(str(exc)):
                    # Not a lock: the connection may be broken. A new one next time; this
                    # read goes through SQLAlchemy, which says what it is (a 503, say).
                    self._on_loop = None
                    with contextlib.suppress(Exception):
                        connection.invalidate()
        return await self._run_core(read)

    async def _open_loop_connection(self) -> Connection:
        """The connection `row` uses on the event loop, opened in a reading thread (opening
        one runs the connection's pragmas, which may wait for a lock): busy timeout 0."""
        engine = self._sync
        if self._closed or engine is None:
            raise RuntimeError("the reader is closed")

        def open_() -> Connection:
            connection = engine.connect()
            try:
                connection.exec_driver_sql("PRAGMA busy_timeout=0")
            except BaseException:
                connection.close()
                raise
            return connection

        connection: Connection = await asyncio.get_running_loop().run_in_executor(
            self._threads, open_
        )
        if self._on_loop is not None:  # another request opened one meanwhile
            connection.close()
            return self._on_loop
        self._on_loop = connection
        return connection

    async def rows(self, statement: Executable) -> Sequence[Any]:
        """Every row of a Core statement."""
        return await self._run_core(lambda connection: connection.execute(statement).all())

    async def _run_core(self, read: Callable[[Connection], Any]) -> Any:
        """`read` with a connection: in a reading thread (SQLite), else through an async
        connection's `run_sync` on the event loop."""
        engine = self._sync
        if engine is None:
            async with self._engine.connect() as connection:
                return await connection.run_sync(read)

        def run() -> Any:
            with engine.connect() as connection:
                return read(connection)

        return await asyncio.get_running_loop().run_in_executor(self._threads, run)

    async def _run(self, read: Callable[[Session], Any]) -> Any:
        """`read` with a session on a connection of `_run_core`."""

        def with_session(connection: Connection) -> Any:
            with Session(connection, expire_on_commit=False, autoflush=False) as session:
                return read(session)

        return await self._run_core(with_session)

    async def aclose(self) -> None:
        """Close the loop's connection here, on the loop (no read can be using it); then,
        in a thread, wait for the reads in flight and close the rest."""
        self._closed = True
        if self._on_loop is not None:
            self._on_loop.close()
            self._on_loop = None
        await asyncio.to_thread(self._close_threads)

    def _close_threads(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)
        if self._sync is not None:
            self._sync.dispose()


def _sqlite_reading_engine(url: URL, busy_timeout: float) -> Engine:
    """A synchronous engine on the same SQLite file, with the same connection settings,
    that cannot write."""
    reading = create_sync_engine(
        url,
        json_serializer=json_dumps,
        pool_size=READ_THREADS,
        connect_args={"check_same_thread": False},
    )
    on_connect = _sqlite_on_connect(busy_timeout)

    def read_only(dbapi_connection: Any, record: Any) -> None:
        on_connect(dbapi_connection, record)
        dbapi_connection.execute("PRAGMA query_only=ON")

    # No BEGIN: a read is one statement, and a statement is its own snapshot (autocommit).
    event.listen(reading, "connect", read_only)
    return reading


async def begin_write(session: AsyncSession) -> None:
    """Start the session's transaction as a writing one (SQLite: BEGIN IMMEDIATE). Call it
    before the transaction's first statement; in one it began as a writer it does nothing
    (a helper may call it again)."""
    transaction = session.sync_session.get_transaction()
    if transaction is not None and session.info.get(_BEGUN_WRITING) is transaction:
        return
    await session.connection(execution_options=WRITE)
    session.info[_BEGUN_WRITING] = session.sync_session.get_transaction()


_BEGUN_WRITING = "trainyard_begun_writing"
"""`Session.info` key: the transaction `begin_write` began (a later one is another object)."""


@asynccontextmanager
async def write_connection(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A writing transaction on a bare connection (no ORM): the workers' hot path. Its
    statements must be small by design (a row or a bounded batch each): on SQLite they run
    on the event loop's thread once the transaction holds the write lock (`INLINE_WRITE`)."""
    async with engine.connect() as conn:
        conn = await conn.execution_options(**INLINE_WRITE)
        async with conn.begin():
            yield conn


@asynccontextmanager
async def transaction(sessions: async_sessionmaker[AsyncSession]) -> AsyncIterator[AsyncSession]:
    """A writing transaction: committed on success, rolled back on error."""
    async with sessions() as session:
        await begin_write(session)
        try:
            yield session
        except BaseException:
            await session.rollback()
            raise
        await session.commit()


# SQLSTATE classes that say "the server cannot serve you right now", not "your request is
# wrong": 08 connection exception, 53 insufficient resources (too many connections), 57P
# operator intervention (shutting down, starting up: "the database system is starting up").
_UNAVAILABLE_SQLSTATES = ("08", "53", "57P")


def is_locked(exc: DBAPIError) -> bool:
    """SQLite's answer when a lock was not granted within the busy timeout."""
    return _locked_message(str(exc.orig))


def _locked_message(message: str) -> bool:
    return "database is locked" in message or "database is busy" in message


def is_unavailable(exc: BaseException) -> bool:
    """A database that is down, restarting, overloaded or (SQLite) locked: worth a retry.
    asyncpg's server-side errors reach SQLAlchemy as a plain DBAPIError, so the SQLSTATE
    decides, not the class."""
    if isinstance(exc, OSError):
        return True
    if not isinstance(exc, DBAPIError):
        return False
    if isinstance(exc, OperationalError | InterfaceError) or exc.connection_invalidated:
        return True
    return str(getattr(exc.orig, "sqlstate", "") or "").startswith(_UNAVAILABLE_SQLSTATES)
