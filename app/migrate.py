"""Schema migrations at start-up and from `trainyard migrate`."""

from __future__ import annotations

import asyncio
import weakref
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db import WRITE

# Shipped inside the package, so an installed wheel can migrate without the source tree.
SCRIPT_LOCATION = Path(__file__).resolve().parent / "migrations"
# Any constant works; it only has to be the same for every replica of the service.
ADVISORY_LOCK_KEY = 0x7472_6169_6E79  # "trainy"


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    return config


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _run(connection: Connection, revision: str, downgrade: bool) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    if downgrade:
        command.downgrade(config, revision)
    else:
        command.upgrade(config, revision)


# Alembic keeps its migration context in module globals: one migration per process at once.
_process_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


async def migrate(engine: AsyncEngine, revision: str = "head", *, downgrade: bool = False) -> None:
    """Upgrade (or downgrade) the schema; two replicas never migrate at once."""
    lock = _process_locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
    async with lock:
        await _migrate(engine, revision, downgrade)


async def _migrate(engine: AsyncEngine, revision: str, downgrade: bool) -> None:
    async with engine.connect() as conn:
        # SQLite: take the write lock up front, so concurrent starts queue up on it.
        conn = await conn.execution_options(**WRITE)
        postgres = conn.dialect.name == "postgresql"
        if postgres:
            # Session-level lock: held across the migration's own transactions.
            await conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": ADVISORY_LOCK_KEY})
            await conn.commit()
        try:
            await conn.run_sync(_run, revision, downgrade)
            await conn.commit()
        finally:
            if postgres:
                await conn.execute(
                    text("SELECT pg_advisory_unlock(:key)"), {"key": ADVISORY_LOCK_KEY}
                )
                await conn.commit()


async def current_revision(conn: AsyncConnection) -> str | None:
    def _current(sync_conn: Connection) -> str | None:
        return MigrationContext.configure(sync_conn).get_current_revision()

    return await conn.run_sync(_current)
