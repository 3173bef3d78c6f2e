"""Project keys at the edge: secrets, their hashes, what a key may do, and the cache that
keeps the check cheap (a dict lookup per request; the database read again only once the
entry is older than TRAINYARD_KEY_CACHE_SECONDS)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from dataclasses import dataclass
from datetime import datetime
from typing import cast

from sqlalchemy import Table, exists, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import utcnow, write_connection
from app.models import DEFAULT_PROJECT_ID, ApiKeyRow

log = logging.getLogger(__name__)

SCOPES = ("admin", "write", "read", "sample")
"""`admin`: everything, every project, keys. `write`: submit, cancel, register, delete in
its project (and read). `read`: GET and HEAD only. `sample`: the gateway only."""
SECRET_PREFIX = "ty_"
TINKER_KEY_PREFIX = "tml-"
"""The Tinker SDK refuses a key that does not start with `tml-`: a secret `ty_…` is also
taken as `tml-ty_…` (the key's `tinker_api_key`), on every path."""
PREFIX_SHOWN = 10  # `ty_` and 7 characters of the secret: enough to tell keys apart
MAX_PENDING_TOUCHES = 10_000

keys = cast(Table, ApiKeyRow.__table__)


def new_secret() -> str:
    """`ty_` and 43 URL-safe characters: 32 random bytes (256 bits)."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def secret_hash(secret: str) -> str:
    """The hex SHA-256 of a secret: all that is stored of it."""
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is: the key's id (None for a key from TRAINYARD_API_KEYS, or no key
    on an open service), its project (None: every project) and its scopes."""

    key_id: str | None
    project_id: str | None
    scopes: frozenset[str]

    @property
    def admin(self) -> bool:
        return "admin" in self.scopes

    @property
    def owner(self) -> str:
        """The project what this key makes belongs to (the default one for a key from
        TRAINYARD_API_KEYS, or no key on an open service)."""
        return self.project_id or DEFAULT_PROJECT_ID

    @property
    def sees(self) -> str | None:
        """The one project whose resources this key may see; None: every project."""
        return None if self.admin else self.owner


ADMIN = Principal(key_id=None, project_id=None, scopes=frozenset({"admin"}))


@dataclass(frozen=True, slots=True)
class _Entry:
    principal: Principal | None  # None: no usable key with this hash
    expires_at: datetime | None
    read_at: float


class KeyBook:
    """What this process knows of the project keys, read from the database and kept for
    `ttl` seconds: per secret hash, the key (or that there is none), and whether any key
    exists at all (without one, and without TRAINYARD_API_KEYS, the service stays open).
    One read per hash at a time: concurrent requests with the same key wait on it."""

    def __init__(self, engine: AsyncEngine, *, ttl: float, touch_every: float) -> None:
        self.engine = engine
        self.ttl = ttl
        self.touch_every = touch_every
        self._entries: dict[str, _Entry] = {}
        self._reading: dict[str, asyncio.Future[_Entry]] = {}
        self._any: tuple[bool, float] | None = None
        self._any_reading: asyncio.Future[bool] | None = None
        self._touched: dict[str, float] = {}  # key id -> monotonic time last written
        self._pending: set[str] = set()
        self._touch_task: asyncio.Task[None] | None = None

    def forget(self) -> None:
        """Drop what is cached (this process just changed keys: it sees its own change)."""
        self._entries.clear()
        self._any = None

    async def any_keys(self) -> bool:
        now = time.monotonic()
        if self._any is not None and now - self._any[1] < self.ttl:
            return self._any[0]
        if self._any_reading is None:
            self._any_reading = asyncio.ensure_future(self._read_any())
        reading = self._any_reading
        try:
            return await asyncio.shield(reading)
        finally:
            if reading.done() and self._any_reading is reading:
                self._any_reading = None

    async def _read_any(self) -> bool:
        async with self.engine.connect() as conn:
            found = bool(await conn.scalar(select(exists().where(keys.c.revoked_at.is_(None)))))
        self._any = (found, time.monotonic())
        return found

    async def principal(self, secret: str) -> Principal | None:
        """The key with this secret, if it is neither revoked nor expired; None otherwise."""
        digest = secret_hash(secret)
        now = time.monotonic()
        entry = self._entries.get(digest)
        if entry is None or now - entry.read_at >= self.ttl:
            reading = self._reading.get(digest)
            if reading is None:
                reading = asyncio.ensure_future(self._read(digest))
                self._reading[digest] = reading
                reading.add_done_callback(lambda _: self._reading.pop(digest, None))
            entry = await asyncio.shield(reading)
        if entry.principal is None:
            return None
        if entry.expires_at is not None and entry.expires_at <= utcnow():
            return None
        self._touch(entry.principal.key_id, now)
        return entry.principal

    async def _read(self, digest: str) -> _Entry:
        query = select(
            keys.c.id, keys.c.project_id, keys.c.scopes, keys.c.expires_at, keys.c.revoked_at
        ).where(keys.c.secret_sha256 == digest)
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        principal = None
        expires_at = None
        if row is not None and row.revoked_at is None:
            principal = Principal(
                key_id=row.id, project_id=row.project_id, scopes=frozenset(row.scopes)
            )
            expires_at = row.expires_at
        if len(self._entries) > 100_000:  # a flood of unknown keys: start over
            self._entries.clear()
        entry = _Entry(principal=principal, expires_at=expires_at, read_at=time.monotonic())
        self._entries[digest] = entry
        return entry

    # -- last_used_at, written off the request path ---------------------------------------

    def _touch(self, key_id: str | None, now: float) -> None:
        if key_id is None:
            return
        last = self._touched.get(key_id)
        if last is not None and now - last < self.touch_every:
            return
        self._touched[key_id] = now
        if len(self._pending) < MAX_PENDING_TOUCHES:
            self._pending.add(key_id)
        if self._touch_task is None or self._touch_task.done():
            self._touch_task = asyncio.ensure_future(self._write_touches())

    async def _write_touches(self) -> None:
        while self._pending:
            ids = sorted(self._pending)
            self._pending.clear()
            try:
                async with write_connection(self.engine) as conn:
                    await conn.execute(
                        update(keys).where(keys.c.id.in_(ids)).values(last_used_at=utcnow())
                    )
            except Exception as exc:  # a hint, not a record: the next use writes it again
                log.warning("keys: last_used_at not written (%s)", exc)
                for key_id in ids:
                    self._touched.pop(key_id, None)
                return

    async def close(self) -> None:
        task = self._touch_task
        if task is not None and not task.done():
            with contextlib.suppress(Exception):
                await task
