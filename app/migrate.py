"""Schema migrations at start-up and from `trainyard migrate`."""

from __future__ import annotations

import asyncio
import functools
import weakref
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db import WRITE


def _script_location() -> Path:
    """The Alembic tree: `app/migrations/` in an installed wheel (which ships it inside the
    package, so `trainyard migrate` needs no source tree), else the checkout's top-level
    `migrations/` next to `app/`."""
    package = Path(__file__).resolve().parent
    for tree in (package / "migrations", package.parent / "migrations"):
        if (tree / "env.py").is_file():
            return tree
    raise RuntimeError(f"no migrations found in {package} or next to it")


SCRIPT_LOCATION = _script_location()
# Any constant works; it only has to be the same for every replica of the service.
ADVISORY_LOCK_KEY = 0x7472_6169_6E79  # "trainy"


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    return config


@functools.cache
def head_revision() -> str | None:
    """The revision this code expects; read from the scripts once per process."""
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


_VERSION = text("SELECT version_num FROM alembic_version")


async def current_revision(conn: AsyncConnection) -> str | None:
    """The schema's revision (None: never migrated, or downgraded to base), in one query;
    what readiness asks on every probe, so it builds no Alembic context (and logs nothing)."""
    try:
        versions = list((await conn.execute(_VERSION)).scalars())
    except DBAPIError:
        await conn.rollback()
        if await conn.run_sync(lambda sync: inspect(sync).has_table("alembic_version")):
            raise
        return None
    if len(versions) > 1:
        raise RuntimeError(f"the schema has several heads: {', '.join(sorted(versions))}")
    return versions[0] if versions else None
