"""Alembic environment: one tree for SQLite and Postgres, driven by Trainyard's settings.

`app.migrate` hands in an open connection (under the Postgres advisory lock); the plain
`alembic` command line gets an engine built from TRAINYARD_DATABASE_URL.
"""

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

import app.models  # noqa: F401  (registers the tables on the metadata)
from app.db import Base, create_engine
from app.settings import get_settings

target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode copies the table.
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_with_engine() -> None:
    engine = create_engine(get_settings().database_url)
    async with engine.connect() as connection:
        await connection.run_sync(_configure)
        await connection.commit()
    await engine.dispose()


connection = context.config.attributes.get("connection")
if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported")
elif connection is not None:
    _configure(connection)
else:
    asyncio.run(_run_with_engine())
