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
from pathlib import Path
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
def worker(
    pool: Annotated[
        str | None, typer.Option(help="Pool it serves (TRAINYARD_WORKER_POOL; default `default`).")
    ] = None,
    backends: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated backends it runs, e.g. `cpu,dry-run` "
            "(TRAINYARD_WORKER_BACKENDS; default: every backend this process can load)."
        ),
    ] = None,
    labels: Annotated[
        str | None,
        typer.Option(help="Its labels, `k=v,k=v`, e.g. `gpu=h200` (TRAINYARD_WORKER_LABELS)."),
    ] = None,
    drain: Annotated[
        str | None,
        typer.Option(
            help="Ask the running worker with this id to drain (stop claiming, finish or "
            "hand back what it runs, exit), through the database, and return.",
            metavar="WORKER_ID",
        ),
    ] = None,
) -> None:
    """Run a worker only (any number of them against Postgres), claiming only the jobs it
    can run: of models in its pool, on its backends, asking for labels it has."""
    settings = _settings()
    _logging(settings.log_level)
    if drain is not None:
        asyncio.run(_drain(settings, drain))
        return
    overrides = {
        key: value
        for key, value in (
            ("worker_pool", pool),
            ("worker_backends", backends),
            ("worker_labels", labels),
        )
        if value is not None
    }
    if overrides:
        try:
            settings = Settings.model_validate(
                settings.model_dump() | overrides  # the options win over the variables
            )
        except ValidationError as exc:
            for error in exc.errors():
                option = "--" + str(error["loc"][0]).removeprefix("worker_") if error["loc"] else ""
                message = str(error["msg"]).removeprefix("Value error, ")
                typer.echo(f"trainyard worker: invalid {option}: {message}", err=True)
            raise typer.Exit(2) from None
    from app.backends import SPECS
    from app.worker import capabilities_of

    try:
        capabilities = capabilities_of(settings)
    except ValueError as exc:
        typer.echo(f"trainyard worker: invalid --backends: {exc}", err=True)
        raise typer.Exit(2) from None
    if settings.worker_backends:  # told to run them: each must run here
        for name in capabilities.backends:
            refusal = SPECS[name].unavailable()
            if refusal is not None:
                typer.echo(f"trainyard worker: backend {name} cannot run here: {refusal}", err=True)
                raise typer.Exit(2)
    if not capabilities.backends:
        typer.echo("trainyard worker: no backend can run here", err=True)
        raise typer.Exit(2)
    asyncio.run(_run_worker(settings))


async def _drain(settings: Settings, worker_id: str) -> None:
    from app.db import create_engine, write_connection
    from app.errors import NotFoundError
    from app.jobs.pools import request_drain

    engine = create_engine(settings.database_url)
    try:
        async with write_connection(engine) as conn:
            worker = await request_drain(conn, worker_id, lease_seconds=settings.lease_seconds)
    except NotFoundError as exc:
        typer.echo(f"trainyard worker: {exc.detail}", err=True)
        raise typer.Exit(1) from None
    finally:
        await engine.dispose()
    typer.echo(f"worker {worker.id}: drain asked; it stops claiming at its next heartbeat")


async def _run_worker(settings: Settings) -> None:
    from app.process import Process

    process = await Process.start(settings, worker=True, api=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    assert process.worker is not None
    caps = process.worker.capabilities
    logging.getLogger(__name__).info(
        "worker %s started: pool %s, backends %s, labels %s",
        process.worker.id,
        caps.pool,
        ",".join(caps.backends),
        ",".join(f"{k}={v}" for k, v in caps.labels.items()) or "none",
    )
    drained = asyncio.create_task(process.worker.drain_asked.wait())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([drained, stopped], return_when=asyncio.FIRST_COMPLETED)
    drained.cancel()
    stopped.cancel()
    await process.close()


@app.command("serve-pool")
def serve_pool(
    base_model: Annotated[
        str,
        typer.Option(
            help="The base model's local directory (under TRAINYARD_MODEL_ROOTS or the data "
            "directory); the pool serves it by this name, as models name it in `base_model`."
        ),
    ],
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: a free one, printed at start).")] = 8000,
) -> None:
    """Serve one base model and the LoRA adapters loaded into it by vLLM's runtime protocol
    (`/v1/load_lora_adapter`), apart from any worker: a serving pool for the gateway
    (TRAINYARD_SERVING_POOLS). Adapters load from the checkpoint storage only
    (TRAINYARD_CHECKPOINT_URL)."""
    import uvicorn

    from app.backends.admission import Admission
    from app.backends.cpu import base_model_refusal
    from app.backends.cpu_server import create_pool_app
    from app.backends.lora_pool import AdapterPool
    from app.backends.storage import Storage

    settings = _settings()
    _logging(settings.log_level)
    refusal = base_model_refusal(base_model, settings.allowed_model_roots())
    if refusal is None and not Path(base_model).is_dir():
        refusal = "must be a model directory (make one with `trainyard make-tiny-model DIR`)"
    if refusal is not None:
        typer.echo(f"trainyard serve-pool: invalid --base-model: it {refusal}", err=True)
        raise typer.Exit(2)
    pool = AdapterPool(
        base_model,
        Storage(settings),
        Admission(settings.serving_max_tokens, settings.serving_retry_after_seconds),
        threads=settings.cpu_threads,
    )
    pool.policy(None)  # the base model loads before the pool listens
    config = uvicorn.Config(
        create_pool_app(pool), host=host, port=port, log_level=settings.log_level
    )
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        sys.exit(3)


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
