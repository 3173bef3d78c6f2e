"""One Alembic tree for both dialects: upgrade, no drift from the models, downgrade."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

import app.models  # noqa: F401
from app.db import Base, create_engine
from app.migrate import current_revision, head_revision, migrate


def _drift(sync_conn) -> list:
    context = MigrationContext.configure(sync_conn, opts={"compare_type": True})
    return compare_metadata(context, Base.metadata)


def _tables(sync_conn) -> set[str]:
    return set(inspect(sync_conn).get_table_names()) - {"alembic_version"}


async def test_upgrade_check_downgrade_round_trip(empty_database_url: str) -> None:
    engine = create_engine(empty_database_url)
    try:
        await migrate(engine)
        async with engine.connect() as conn:
            assert await current_revision(conn) == head_revision()
            assert await conn.run_sync(_drift) == []
            assert await conn.run_sync(_tables) == set(Base.metadata.tables)
        await migrate(engine, "base", downgrade=True)
        async with engine.connect() as conn:
            assert await current_revision(conn) is None
            assert await conn.run_sync(_tables) == set()
        await migrate(engine)  # and back up again, from an emptied database
        async with engine.connect() as conn:
            assert await current_revision(conn) == head_revision()
    finally:
        await engine.dispose()


async def test_migrating_twice_is_a_no_op(empty_database_url: str) -> None:
    engine = create_engine(empty_database_url)
    try:
        await migrate(engine)
        await migrate(engine)
        async with engine.connect() as conn:
            assert await current_revision(conn) == head_revision()
    finally:
        await engine.dispose()


async def test_replicas_starting_together_do_not_race(empty_database_url: str) -> None:
    """On Postgres the advisory lock serializes them; on SQLite the file lock does."""
    import asyncio

    engines = [create_engine(empty_database_url) for _ in range(3)]
    try:
        await asyncio.gather(*(migrate(e) for e in engines))
        async with engines[0].connect() as conn:
            assert await current_revision(conn) == head_revision()
    finally:
        for engine in engines:
            await engine.dispose()
