"""The FastAPI application factory and its lifespan."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.routing import APIRoute
from pydantic.json_schema import models_json_schema

from app import __version__, errors
from app.api import health, models, rollout_jobs, training_jobs
from app.api.deps import require_api_key
from app.backends import Backends
from app.db import POOL_SPARE, create_engine, create_sessionmaker
from app.metrics import Metrics
from app.migrate import migrate
from app.notify import Notifier
from app.schemas.common import FieldError, Problem, problem_responses
from app.services.demo import ensure_demo_model
from app.settings import Settings, get_settings
from app.worker.runner import Worker

log = logging.getLogger(__name__)

DESCRIPTION = """\
Trainyard turns reinforcement-learning experience from agent services into training steps
on OpenPipe ART. Submit trajectories (NeMo Agent Toolkit `TrajectoryCollection` JSON or
ART-style groups), get a durable job back, and watch it through its events.

Every error is `application/problem+json` (RFC 9457).
"""


def _operation_id(route: APIRoute) -> str:
    # Stable, readable ids for generated clients: "training_jobs-create".
    return f"{route.tags[0]}-{route.name}" if route.tags else route.name


def create_app(
    settings: Settings | None = None, *, backend_overrides: dict[str, Any] | None = None
) -> FastAPI:
    """Build the service. `backend_overrides` maps backend names to `art.Backend` objects."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_engine(
            settings.database_url,
            sqlite_busy_timeout=settings.sqlite_busy_timeout_seconds,
            pool_size=settings.worker_concurrency + POOL_SPARE,
        )
        app.state.engine = engine
        app.state.sessions = create_sessionmaker(engine)
        app.state.notifier = Notifier()
        app.state.backends = Backends(settings, backend_overrides)
        app.state.worker = None
        if settings.migrate_on_start:
            await migrate(engine)
        await app.state.notifier.listen(settings.database_url)
        if settings.demo_model:
            await ensure_demo_model(app.state.sessions, settings.data_dir)
        if settings.worker_enabled:
            app.state.worker = Worker(
                settings=settings,
                engine=engine,
                backends=app.state.backends,
                notifier=app.state.notifier,
            )
            await app.state.worker.start()
        try:
            yield
        finally:
            if app.state.worker is not None:
                await app.state.worker.stop()
            await app.state.notifier.close()
            await app.state.backends.close()
            await engine.dispose()

    app = FastAPI(
        title="Trainyard",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        generate_unique_id_function=_operation_id,
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    errors.install(app)
    app.add_middleware(errors.BodyLimit, max_body_bytes=settings.max_body_bytes)
    app.middleware("http")(app.state.metrics.middleware)
    app.include_router(health.router)
    protected = [Depends(require_api_key)]
    app.include_router(models.router, dependencies=protected)
    app.include_router(models.backends_router, dependencies=protected)
    app.include_router(training_jobs.router, dependencies=protected)
    app.include_router(rollout_jobs.router, dependencies=protected)
    _document_problems(app)
    return app


_NO_IO = {"/healthz", "/v1/backends"}  # answered from memory: never a 503


def _document_problems(app: FastAPI) -> None:
    """Document every error as problem+json: FastAPI's default 422 schema is not what we send."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            _, defs = models_json_schema(
                [(FieldError, "validation"), (Problem, "validation")],
                ref_template="#/components/schemas/{model}",
            )
            components.update(defs["$defs"])
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            validation = problem_responses(422)[422]
            # Statuses the app-wide handlers send from any route: 413 from the body limit
            # (for operations that take a body), 503 with Retry-After when the database or
            # a dependency is down (routes that do I/O). Listed, so that generated clients
            # parse them as problems rather than leave them unparsed.
            too_large, unavailable = problem_responses(413, 503).values()
            for name, path in schema.get("paths", {}).items():
                for operation in path.values():
                    responses = operation.setdefault("responses", {})
                    if "422" in responses:
                        responses["422"] = validation
                    if "requestBody" in operation:
                        responses.setdefault("413", too_large)
                    if name not in _NO_IO:
                        responses.setdefault("503", unavailable)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
