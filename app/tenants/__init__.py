"""Projects, the keys stored hashed that belong to them, and the audit log (issue 28)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from app.settings import Settings
from app.tenants.audit import AuditLog
from app.tenants.keys import KeyBook
from app.tenants.metering import GatewayMeter


class Tenants:
    """A serving process's view of the keys (`KeyBook`), its audit log writer and its
    gateway usage writer."""

    def __init__(self, engine: AsyncEngine, settings: Settings) -> None:
        self.keys = KeyBook(
            engine, ttl=settings.key_cache_seconds, touch_every=settings.key_last_used_seconds
        )
        self.audit = AuditLog(engine)
        self.meter = GatewayMeter(engine)

    def start(self) -> None:
        self.audit.start()
        self.meter.start()

    async def close(self) -> None:
        await self.audit.close()
        await self.meter.close()
        await self.keys.close()
