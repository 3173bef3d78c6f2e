"""SQLite's statements through `app.db.create_engine`: one trip each to aiosqlite's thread
(SQLAlchemy's own adapter makes three or four), or none where a `write_connection` holds
the write lock and the statement is small, with the results, row counts, ids and errors
that SQLAlchemy's adapter gives for the same statements."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import aiosqlite
import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from app.db import (
    INLINE_MAX_BYTES,
    INLINE_MAX_PARAMETERS,
    WRITE,
    create_engine,
    is_locked,
    write_connection,
)

metadata = MetaData()
things = Table(
    "things",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String, unique=True, nullable=False),
    Column("n", Integer, nullable=False),
)


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of every function sent to an aiosqlite connection's thread."""
    sent: list[str] = []
    original = aiosqlite.Connection._execute

    async def counting(self: aiosqlite.Connection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(getattr(fn, "__name__", repr(fn)))
        return await original(self, fn, *args, **kwargs)

    monkeypatch.setattr(aiosqlite.Connection, "_execute", counting)
    return sent


@asynccontextmanager
async def threaded_write(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A writing transaction whose statements all make the trip (as the ORM's do)."""
    async with engine.connect() as conn:
        conn = await conn.execution_options(**WRITE)
        async with conn.begin():
            yield conn


Writing = Callable[[AsyncEngine], AbstractAsyncContextManager[AsyncConnection]]


async def _with_table(engine: AsyncEngine) -> AsyncEngine:
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    return engine


async def test_a_statement_is_one_trip_to_the_thread(tmp_path: Path, trips: list[str]) -> None:
    engine = await _with_table(create_engine(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"))
    try:
        async with threaded_write(engine) as conn:
            trips.clear()
            await conn.execute(insert(things).values(name="a", n=1))
            await conn.execute(update(things).values(n=2).returning(things.c.n))
            (await conn.execute(select(things.c.name))).all()
            assert len(trips) == 3, trips
        assert len(trips) == 4, trips  # and the commit
    finally:
        await engine.dispose()


async def test_a_transaction_holding_the_write_lock_runs_small_statements_on_the_loop(
    tmp_path: Path, trips: list[str]
) -> None:
    """Only BEGIN IMMEDIATE (which may wait for another writer), COMMIT (which may
    checkpoint) and statements with a large value or many parameters make the trip."""
    engine = await _with_table(create_engine(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"))
    try:
        async with engine.connect():  # the pool's connection, set up
            trips.clear()
        async with write_connection(engine) as conn:
            assert trips == ["_one_trip"]  # BEGIN IMMEDIATE
            trips.clear()
            await conn.execute(insert(things).values(name="a", n=1))
            await conn.execute(update(things).values(n=2).returning(things.c.n))
            assert (await conn.execute(select(things.c.name))).all() == [("a",)]
            await conn.execute(insert(things), [{"name": f"m{i}", "n": i} for i in range(50)])
            assert trips == []
            await conn.execute(insert(things).values(name="x" * (INLINE_MAX_BYTES + 1), n=3))
            blob = memoryview(b"x" * (INLINE_MAX_BYTES + 1))  # as a job's payload is bound
            assert await conn.scalar(text("SELECT length(:blob)"), {"blob": blob}) == len(blob)
            many = [{"name": f"b{i}", "n": i} for i in range(INLINE_MAX_PARAMETERS // 2 + 1)]
            await conn.execute(insert(things), many)
            assert trips == ["_one_trip"] * 3
        assert trips[-1] == "commit"
        trips.clear()
        async with engine.connect() as conn:  # a read transaction: BEGIN, and the read
            assert await conn.scalar(select(func.count()).select_from(things)) == 52 + len(many)
        assert trips == ["_one_trip", "_one_trip", "rollback"], trips  # and the pool's
    finally:
        await engine.dispose()


async def _scenario(engine: AsyncEngine, writing: Writing) -> dict[str, Any]:
    """What a caller sees of each kind of statement."""
    seen: dict[str, Any] = {}
    async with writing(engine) as conn:
        one = await conn.execute(insert(things).values(name="a", n=1))
        seen["inserted_key"] = one.inserted_primary_key
        many = await conn.execute(insert(things), [{"name": f"m{i}", "n": i} for i in range(5)])
        seen["many_rowcount"] = many.rowcount
        changed = await conn.execute(
            update(things).where(things.c.n >= 3).values(n=things.c.n * 10)
        )
        seen["update_rowcount"] = changed.rowcount
        returned = await conn.execute(
            update(things)
            .where(things.c.name == "a")
            .values(n=7)
            .returning(things.c.id, things.c.n)
        )
        seen["returning"] = [tuple(row) for row in returned]
        seen["rows"] = [
            tuple(row) for row in await conn.execute(select(things).order_by(things.c.id))
        ]
        seen["none"] = (await conn.execute(select(things).where(things.c.n < 0))).first()
        seen["scalar"] = await conn.scalar(text("SELECT count(*) FROM things"))
        streamed = await conn.stream(select(things.c.name).order_by(things.c.name))
        seen["streamed"] = [row.name async for row in streamed]
    with pytest.raises(IntegrityError) as duplicate:
        async with writing(engine) as conn:
            await conn.execute(insert(things).values(name="a", n=0))
    seen["duplicate"] = type(duplicate.value.orig).__name__
    async with engine.connect() as conn:  # the failed transaction wrote nothing
        seen["after"] = await conn.scalar(select(things.c.n).where(things.c.name == "a"))
    return seen


@pytest.mark.parametrize("writing", [write_connection, threaded_write], ids=["loop", "thread"])
async def test_results_and_errors_are_those_of_sqlalchemys_own_adapter(
    tmp_path: Path, writing: Writing
) -> None:
    ours = await _with_table(create_engine(f"sqlite+aiosqlite:///{tmp_path / 'ours.db'}"))
    stock = await _with_table(create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'stock.db'}"))
    try:
        expected = await _scenario(stock, threaded_write)
        assert expected["many_rowcount"] == 5 and expected["returning"] == [(1, 7)]
        assert await _scenario(ours, writing) == expected
    finally:
        await ours.dispose()
        await stock.dispose()


async def test_a_writer_that_meets_anothers_lock_fails_as_locked(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    engine = await _with_table(create_engine(f"sqlite+aiosqlite:///{path}", sqlite_busy_timeout=0))
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(OperationalError) as refused:
            async with write_connection(engine) as conn:
                await conn.execute(insert(things).values(name="x", n=1))
        assert is_locked(refused.value)
        other.execute("ROLLBACK")
        async with write_connection(engine) as conn:  # the pool's connection still works
            await conn.execute(insert(things).values(name="x", n=1))
    finally:
        other.close()
        await engine.dispose()


async def test_statements_of_concurrent_transactions_do_not_mix(tmp_path: Path) -> None:
    """Each connection's statements and results stay its own while several run at once
    (each has its own thread; the rows come back with the statement)."""
    engine = await _with_table(create_engine(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}"))

    async def reads(name: str) -> list[str]:
        got = []
        for _ in range(20):
            async with engine.connect() as conn:
                got.append(await conn.scalar(select(text(f"'{name}'"))))
        return got

    try:
        results = await asyncio.gather(*(reads(f"c{i}") for i in range(4)))
        assert results == [[f"c{i}"] * 20 for i in range(4)]
    finally:
        await engine.dispose()


async def test_an_engine_given_its_own_connection_maker_uses_it(
    tmp_path: Path, trips: list[str]
) -> None:
    path = tmp_path / "made.db"
    made: list[str] = []

    def connect() -> Any:
        made.append(str(path))
        return aiosqlite.connect(path)

    engine = await _with_table(create_engine("sqlite+aiosqlite://", async_creator=connect))
    try:
        async with threaded_write(engine) as conn:
            trips.clear()
            await conn.execute(insert(things).values(name="a", n=1))
            assert trips == ["_one_trip"]
        reader = sqlite3.connect(path)
        try:
            assert made and reader.execute("SELECT name FROM things").fetchall() == [("a",)]
        finally:
            reader.close()
    finally:
        await engine.dispose()
