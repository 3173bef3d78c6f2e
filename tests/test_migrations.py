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


async def test_0010_fills_each_endpoints_host_from_its_url(empty_database_url: str) -> None:
    """Endpoints registered before fair delivery get the host their in-flight cap counts
    by, and start with a closed breaker and secret version 1."""
    from sqlalchemy import text

    engine = create_engine(empty_database_url)
    try:
        await migrate(engine, "0009")
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO webhook_endpoints (id, url, description, secret, event_types,"
                    " enabled, created_at, updated_at) VALUES (:id, :url, '', 's', '[]', true,"
                    " CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                ),
                [
                    {"id": "wh_a", "url": "https://Hooks.Example.com:8443/a"},
                    {"id": "wh_b", "url": "http://10.0.0.7/b"},
                ],
            )
        await migrate(engine)
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT id, host, secret_version, consecutive_timeouts,"
                        " breaker_open_until FROM webhook_endpoints ORDER BY id"
                    )
                )
            ).all()
        assert [tuple(row) for row in rows] == [
            ("wh_a", "hooks.example.com", 1, 0, None),
            ("wh_b", "10.0.0.7", 1, 0, None),
        ]
    finally:
        await engine.dispose()


async def test_0014_puts_every_row_from_before_in_the_default_project(
    empty_database_url: str,
) -> None:
    """Models, datasets, jobs, runs and webhook endpoints written before projects belong to
    `default` (`proj_default`), which 0014 creates; new rows with no project get it too."""
    from sqlalchemy import text

    engine = create_engine(empty_database_url)
    try:
        await migrate(engine, "0013")
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO models (name, project, base_model, backend, config,"
                    " current_step, step_known, created_at, updated_at) VALUES ('m', 'p',"
                    " 'b', 'dry-run', '{}', 0, false, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            await conn.execute(
                text(
                    "INSERT INTO webhook_endpoints (id, url, description, secret, event_types,"
                    " enabled, created_at, updated_at) VALUES ('wh_a', 'http://h/a', '', 's',"
                    " '[]', true, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
        await migrate(engine)
        async with engine.connect() as conn:
            projects = (await conn.execute(text("SELECT id, name FROM projects"))).all()
            owners = [
                (await conn.execute(text(f"SELECT project_id FROM {table}"))).scalars().all()
                for table in ("models", "webhook_endpoints")
            ]
        assert [tuple(row) for row in projects] == [("proj_default", "default")]
        assert owners == [["proj_default"], ["proj_default"]]
        await migrate(engine, "0013", downgrade=True)  # and back: the columns and tables go
        async with engine.connect() as conn:
            tables = await conn.run_sync(_tables)
            columns = await conn.run_sync(
                lambda sync: {c["name"] for c in inspect(sync).get_columns("models")}
            )
        assert not tables & {"projects", "api_keys", "audit_events"}
        assert "project_id" not in columns
    finally:
        await engine.dispose()
