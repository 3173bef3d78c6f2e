"""`trainyard`: serve the API, run workers, migrate, export the OpenAPI document."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from pydantic import ValidationError

from app.settings import Settings, get_settings

app = typer.Typer(
    help="Trainyard: training orchestration for agent RL on OpenPipe ART.",
    no_args_is_help=True,
    add_completion=False,
)


def _settings() -> Settings:
    """The settings, or a clear refusal naming each bad variable (no traceback)."""
    try:
        return get_settings()
    except ValidationError as exc:
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            message = str(error["msg"]).removeprefix("Value error, ")
            typer.echo(f"trainyard: invalid TRAINYARD_{field.upper()}: {message}", err=True)
        raise typer.Exit(2) from None


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@contextmanager
def _start_up() -> Iterator[None]:
    """Import and build the service without the cyclic garbage collector, then freeze what
    that made. Start-up allocates some 200,000 objects that live as long as the process and
    frees few: collecting while it runs costs about a tenth of it, and every full collection
    afterwards would walk them all again."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (TRAINYARD_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (TRAINYARD_PORT).")] = None,
) -> None:
    """Serve the API, with an in-process worker unless TRAINYARD_WORKER_ENABLED=false."""
    with _start_up():
        import uvicorn

        from app.main import create_app
        from app.server import config

        settings = _settings()
        _logging(settings.log_level)
        api = create_app(settings)
        server = uvicorn.Server(
            config(api, settings, host=host or settings.host, port=port or settings.port)
        )
    server.run()
    if not server.started:
        sys.exit(3)  # as uvicorn.run: the server failed to start


@app.command()
def worker() -> None:
    """Run a worker only (any number of them against Postgres)."""
    settings = _settings()
    _logging(settings.log_level)
    asyncio.run(_run_worker())


async def _run_worker() -> None:
    from app.process import Process

    process = await Process.start(get_settings(), worker=True, api=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    assert process.worker is not None
    logging.getLogger(__name__).info("worker %s started", process.worker.id)
    await stop.wait()
    await process.close()


@app.command()
def migrate(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Upgrade the database schema (default: to head)."""
    from app.db import create_engine
    from app.migrate import migrate as run_migrate

    settings = _settings()

    async def _go() -> None:
        engine = create_engine(settings.database_url)
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

    json.dump(create_app(_settings()).openapi(), sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def main() -> None:
    app()
