"""The process graph, built in one place for `trainyard serve` and `trainyard worker`:
engine, sessions, queue store, notifier, backends, and the worker when this process runs
one."""

from __future__ import annotations

import asyncio
import gc
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from app.backends import Backends
from app.backends.admission import Admission
from app.db import POOL_SPARE, Reader, create_engine, create_sessionmaker
from app.gateway import Gateway
from app.jobs.store import QueueStore, store_for
from app.migrate import migrate
from app.notify import Notifier
from app.registry.demo import ensure_demo_model
from app.settings import Settings

if TYPE_CHECKING:
    from app.worker import Worker

SWITCH_INTERVAL = 0.0005
"""Seconds a thread holding the GIL runs before it hands the GIL to a thread that asks.

Large bodies are parsed, checked and encoded in threads, a piece at a time, while the event
loop keeps serving. The loop gives the GIL up at every socket call and must ask for it
back; at Python's default (5 ms) each call waited up to 5 ms behind the busy thread, and a
request made of a few such calls queued behind the next: /healthz answered in 0.4-1.8 s
(median) while a 35 MB body was read. At 0.5 ms: 8-12 ms."""


@dataclass
class Process:
    settings: Settings
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    reader: Reader
    store: QueueStore
    notifier: Notifier
    backends: Backends
    gateway: Gateway
    worker: Worker | None

    @classmethod
    async def start(
        cls,
        settings: Settings,
        *,
        worker: bool,
        api: bool = True,
        backend_overrides: dict[str, Any] | None = None,
    ) -> Process:
        """Connect, migrate if asked, listen for wake-ups, and start the worker if `worker`.
        `api`: this process serves the API: it streams events (so it listens for new ones
        too) and registers the demo model when the settings ask for it."""
        sys.setswitchinterval(SWITCH_INTERVAL)
        engine = create_engine(
            settings.database_url,
            sqlite_busy_timeout=settings.sqlite_busy_timeout_seconds,
            pool_size=settings.worker_concurrency + POOL_SPARE,
        )
        store = store_for(engine)
        notifier = Notifier()
        backends = Backends(settings, backend_overrides)
        admission = Admission(settings.serving_max_tokens, settings.serving_retry_after_seconds)
        gateway = Gateway(backends, serves_here=worker, admission=admission)
        sessions = create_sessionmaker(engine)
        reader = Reader(engine, sqlite_busy_timeout=settings.sqlite_busy_timeout_seconds)
        process = cls(settings, engine, sessions, reader, store, notifier, backends, gateway, None)
        if settings.migrate_on_start:
            await migrate(engine)
        await notifier.listen(settings.database_url, events=api)
        if api and settings.demo_model:
            await ensure_demo_model(process.sessions, settings.data_dir)
        if worker:
            # Only a process that runs jobs loads the runners and the training stack, before
            # it serves or claims anything (in a thread: the start waits, nothing else does).
            from app.backends import load_training_stack
            from app.worker import Worker

            await asyncio.to_thread(load_training_stack)
            # The training stack is some 510,000 objects that live as long as the process:
            # left to the collector, every full collection walks them all again, a pause
            # of the whole process (the event loop included): 0.27 s each, on a quiet machine.
            gc.freeze()

            process.worker = Worker(
                settings=settings, store=store, backends=backends, notifier=notifier
            )
            await process.worker.start()
        return process

    async def close(self) -> None:
        """Stop the worker (it hands back what it runs), then the rest, in reverse."""
        if self.worker is not None:
            await self.worker.stop()
        await self.notifier.close()
        await self.gateway.close()
        await self.backends.close()
        await self.reader.aclose()
        await self.engine.dispose()
