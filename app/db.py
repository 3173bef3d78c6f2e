"""Engine, sessions and the column types that behave the same on SQLite and Postgres."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, DateTime, MetaData, event
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.types import TypeDecorator

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


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
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
    # Wait for a competing writer instead of failing at once with SQLITE_BUSY.
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


WRITE = {"trainyard_write": True}
"""Execution options of a transaction that will write (see `_sqlite_on_begin`)."""


def _sqlite_on_begin(conn: Any) -> None:
    # A transaction that reads and then writes takes the write lock up front: started
    # DEFERRED, it could fail mid-way with SQLITE_BUSY when upgrading its lock. Read-only
    # transactions stay DEFERRED so they never wait for a writer (WAL).
    write = conn.get_execution_options().get("trainyard_write", False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def create_engine(database_url: str, **kwargs: Any) -> AsyncEngine:
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        if url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, **kwargs)
        event.listen(engine.sync_engine, "connect", _sqlite_on_connect)
        event.listen(engine.sync_engine, "begin", _sqlite_on_begin)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(url, **kwargs)


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False, autoflush=False)


async def begin_write(session: AsyncSession) -> None:
    """Start the session's transaction as a writing one (SQLite: BEGIN IMMEDIATE)."""
    await session.connection(execution_options=WRITE)


@asynccontextmanager
async def write_connection(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A writing transaction on a bare connection (no ORM): the workers' hot path."""
    async with engine.connect() as conn:
        conn = await conn.execution_options(**WRITE)
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
