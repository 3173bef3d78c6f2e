"""The `demo` model of the quick start: a tiny local model on the cpu backend, ready to use."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.registry.models import create_model
from app.schemas.models import ModelCreate

log = logging.getLogger(__name__)
DEMO = "demo"


async def ensure_demo_model(sessions: async_sessionmaker[AsyncSession], data_dir: Path) -> None:
    """Make the tiny model on first run and register `demo` (a no-op when both exist)."""
    path = data_dir / "tiny-model"
    if not (path / "config.json").exists():
        from app.backends.tiny_model import make_tiny_model

        await asyncio.to_thread(make_tiny_model, path)
        log.info("made a tiny model in %s", path)
    async with sessions() as session:
        base = path.resolve()
        body = ModelCreate(name=DEMO, project="demo", base_model=str(base), backend="cpu")
        await create_model(session, body=body, model_roots=[base.parent])  # the data dir
        await session.commit()
