"""Shared fixtures: a real database per test (SQLite file, or Postgres when
TRAINYARD_TEST_DATABASE_URL is set) and the real app served over loopback HTTP."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import text

from app.db import create_engine
from app.main import create_app
from app.settings import Settings

POSTGRES_URL = os.environ.get("TRAINYARD_TEST_DATABASE_URL")
DIALECTS = ["sqlite"] + (["postgres"] if POSTGRES_URL else [])


async def reset_postgres(url: str) -> None:
    engine = create_engine(url)
    async with engine.begin() as conn:
        await conn.execute(text("DROP SCHEMA public CASCADE"))
        await conn.execute(text("CREATE SCHEMA public"))
    await engine.dispose()


@pytest.fixture(params=DIALECTS)
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database on each dialect under test."""
    if request.param == "postgres":
        assert POSTGRES_URL
        await reset_postgres(POSTGRES_URL)
        return POSTGRES_URL
    return f"sqlite+aiosqlite:///{tmp_path / 'trainyard.db'}"


@pytest.fixture
def make_settings(database_url: str, tmp_path: Path) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": database_url,
            "data_dir": tmp_path / "data",
            "worker_enabled": False,
            "heartbeat_seconds": 0.2,
            "lease_seconds": 2.0,
            "poll_seconds": 0.2,
            "retry_base_seconds": 0.05,
        }
        values.update(overrides)
        return Settings(**values)

    return make


class LiveServer:
    """The app under uvicorn on 127.0.0.1, in this event loop; a real HTTP client to it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        )
        self._task: asyncio.Task[None] | None = None
        self.url = ""
        self.client: httpx.AsyncClient

    async def __aenter__(self) -> LiveServer:
        self._task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.AsyncClient(base_url=self.url, timeout=30)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()
        self.server.should_exit = True
        assert self._task is not None
        await self._task


@pytest.fixture
def serve(make_settings: Callable[..., Settings]) -> Callable[..., Any]:
    """`async with serve(**settings) as live:` runs the app over loopback HTTP."""

    def start(backend_overrides: dict[str, Any] | None = None, **overrides: Any) -> LiveServer:
        return LiveServer(
            create_app(make_settings(**overrides), backend_overrides=backend_overrides)
        )

    return start


@pytest.fixture
async def live(serve: Callable[..., LiveServer]) -> AsyncIterator[LiveServer]:
    async with serve() as server:
        yield server
