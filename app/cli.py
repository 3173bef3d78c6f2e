"""`trainyard`: serve the API, run workers, migrate, export the OpenAPI document."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from typing import Annotated

import typer

from app.settings import get_settings

app = typer.Typer(
    help="Trainyard: training orchestration for agent RL on OpenPipe ART.",
    no_args_is_help=True,
    add_completion=False,
)


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (TRAINYARD_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (TRAINYARD_PORT).")] = None,
) -> None:
    """Serve the API, with an in-process worker unless TRAINYARD_WORKER_ENABLED=false."""
    import uvicorn

    from app.main import create_app

    settings = get_settings()
    _logging(settings.log_level)
    uvicorn.run(
        create_app(settings),
        # Open event streams would hold shutdown (and the worker's lease hand-back) forever.
        timeout_graceful_shutdown=10,
        host=host or settings.host,
        port=port or settings.port,
        log_level=settings.log_level,
    )


@app.command()
def worker() -> None:
    """Run a worker only (any number of them against Postgres)."""
    settings = get_settings()
    _logging(settings.log_level)
    asyncio.run(_run_worker())


async def _run_worker() -> None:
    from app.backends import Backends
    from app.db import POOL_SPARE, create_engine
    from app.migrate import migrate
    from app.notify import Notifier
    from app.worker.runner import Worker

    settings = get_settings()
    engine = create_engine(
        settings.database_url,
        sqlite_busy_timeout=settings.sqlite_busy_timeout_seconds,
        pool_size=settings.worker_concurrency + POOL_SPARE,
    )
    if settings.migrate_on_start:
        await migrate(engine)
    notifier = Notifier()
    await notifier.listen(settings.database_url, events=False)  # it streams no events
    backends = Backends(settings)
    runner = Worker(
        settings=settings,
        engine=engine,
        backends=backends,
        notifier=notifier,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await runner.start()
    logging.getLogger(__name__).info("worker %s started", runner.id)
    await stop.wait()
    await runner.stop()
    await notifier.close()
    await backends.close()
    await engine.dispose()


@app.command()
def migrate(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Upgrade the database schema (default: to head)."""
    from app.db import create_engine
    from app.migrate import migrate as run_migrate

    async def _go() -> None:
        engine = create_engine(get_settings().database_url)
        try:
            await run_migrate(engine, revision)
        finally:
            await engine.dispose()

    asyncio.run(_go())
    typer.echo(f"database at {revision}")


@app.command("make-tiny-model")
def make_tiny_model(
    path: Annotated[str, typer.Argument(help="Directory to write the model to.")],
) -> None:
    """Write a tiny random-weight chat model (tokenizer built here; nothing downloaded)."""
    from app.backends.tiny_model import make_tiny_model as make

    typer.echo(f"tiny model written to {make(path)}")


@app.command()
def openapi() -> None:
    """Print the OpenAPI document (what `openapi.json` at the repo root holds)."""
    from app.main import create_app

    json.dump(create_app(get_settings()).openapi(), sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def main() -> None:
    app()
