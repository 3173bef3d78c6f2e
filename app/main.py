"""The FastAPI application factory and its lifespan."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic.json_schema import models_json_schema

from app import __version__, dashboard, errors
from app.api import (
    checkpoints,
    datasets,
    docs,
    evaluation_jobs,
    gateway,
    health,
    models,
    projects,
    rollout_jobs,
    runs,
    tinker,
    training_jobs,
    usage,
    webhooks,
    workers,
)
from app.api.body import BODY_MODELS
from app.ingest import edge
from app.metrics import Metrics
from app.process import Process
from app.schemas.common import FieldError, Problem, problem_responses
from app.settings import Settings, get_settings
from app.tenants import Tenants

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
        process = await Process.start(
            settings, worker=settings.worker_enabled, backend_overrides=backend_overrides
        )
        app.state.process = process
        app.state.engine = process.engine
        app.state.sessions = process.sessions
        app.state.reader = process.reader
        app.state.notifier = process.notifier
        app.state.backends = process.backends
        app.state.gateway = process.gateway
        app.state.worker = process.worker
        app.state.tinker = None  # the Tinker surface's state, made on its first request
        tenants = Tenants(process.engine, settings)  # the edge's keys, the audit log
        tenants.start()
        app.state.tenants = tenants
        try:
            yield
        finally:
            await tenants.close()
            if app.state.tinker is not None:
                await app.state.tinker.close()
            await process.close()

    app = FastAPI(
        title="Trainyard",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        generate_unique_id_function=_operation_id,
        # Served by `docs.router`, with their assets: never from a CDN.
        docs_url=None,
        redoc_url=None,
        # A path with a stray slash is a 404, not a redirect whose Location would be built
        # from the request's Host header (before any key was checked).
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    errors.install(app)
    # Added innermost first. A request passes the metrics, then the API key (checked from
    # the headers alone), then the body (read whole within its size limit and deadline),
    # then HEAD as GET, then the routes.
    app.add_middleware(edge.HeadAsGet)
    app.add_middleware(
        edge.RequestBody,
        max_body_bytes=settings.max_body_bytes,
        timeout_seconds=settings.body_timeout_seconds,
    )
    # /metrics names every project and model: open only where the operator says so.
    open_paths = {
        *(
            route.path
            for route in health.router.routes
            if hasattr(route, "path") and (route.path != "/metrics" or settings.metrics_public)
        ),
        *docs.PATHS,
        *dashboard.PATHS,
        app.openapi_url or "/openapi.json",
    }
    app.add_middleware(
        edge.ApiKeys,
        keys=settings.api_keys,
        open_paths=open_paths,
        metrics_keys=settings.metrics_keys,
    )
    app.middleware("http")(app.state.metrics.middleware)
    # A request is matched against the routers in this order, each route passed costing a
    # path match (~4 µs here; a request to the last router passed ~110 routes, 0.4 ms):
    # what is called most comes first (probes; the model endpoint, once per sampled
    # answer; the Tinker SDK, twice per operation; jobs and runs, which agent services
    # poll), pages for a browser last.
    for router in [
        health.router,
        gateway.router,
        tinker.router,
        training_jobs.router,
        rollout_jobs.router,
        evaluation_jobs.router,
        runs.router,
        runs.estimates_router,
        datasets.router,
        models.router,
        models.backends_router,
        checkpoints.router,
        webhooks.router,
        workers.router,
        projects.router,
        projects.audit_router,
        usage.router,
        docs.router(app),
        dashboard.router(),
    ]:
        app.include_router(router)
    # The document lists them as a reader meets them: a model, then what trains it.
    reading_order = [
        health.router,
        models.router,
        models.backends_router,
        checkpoints.router,
        training_jobs.router,
        rollout_jobs.router,
        evaluation_jobs.router,
        runs.router,
        runs.estimates_router,
        datasets.router,
        webhooks.router,
        workers.router,
        projects.router,
        projects.audit_router,
        usage.router,
        gateway.router,
    ]
    _document_problems(app, reading_order, open_paths)
    return app


_NO_IO = {"/healthz", "/v1/backends"}  # answered from memory: never a 503


def _document_problems(app: FastAPI, reading_order: list[APIRouter], open_paths: set[str]) -> None:
    """Document every error as problem+json: FastAPI's default 422 schema is not what we send.
    Paths are listed in the order of `reading_order`'s routes. Every operation outside
    `open_paths` needs the bearer key: the edge (`edge.ApiKeys`) checks it, before any route
    runs, on exactly those paths."""
    build = app.openapi
    rank: dict[str, int] = {}
    for router in reading_order:
        for route in router.routes:
            rank.setdefault(getattr(route, "path", ""), len(rank))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            paths = schema.get("paths", {})
            schema["paths"] = dict(sorted(paths.items(), key=lambda kv: rank.get(kv[0], len(rank))))
            for name, path in schema["paths"].items():
                if name not in open_paths:
                    for method, operation in path.items():
                        path[method] = _with_bearer(operation)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            _document_bodies(schema, components)
            _, defs = models_json_schema(
                [(FieldError, "validation"), (Problem, "validation")],
                ref_template="#/components/schemas/{model}",
            )
            components.update(defs["$defs"])
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            if schema["paths"].keys() - open_paths:
                schema["components"]["securitySchemes"] = {"HTTPBearer": BEARER_SCHEME}
            validation = problem_responses(422)[422]
            # Statuses the app-wide handlers send from any route: 413 from the body limit
            # (for operations that take a body), 415 for a body sent as another type than
            # JSON (bodies `read_json` reads), 503 with Retry-After when the database or a
            # dependency is down (routes that do I/O). Listed, so that generated clients
            # parse them as problems rather than leave them unparsed.
            too_large, not_json, unavailable = problem_responses(413, 415, 503).values()
            for name, path in schema.get("paths", {}).items():
                for operation in path.values():
                    responses = operation.setdefault("responses", {})
                    if "422" in responses:
                        responses["422"] = validation
                    if "requestBody" in operation:
                        responses.setdefault("413", too_large)
                    if _read_by_read_json(operation):
                        responses.setdefault("415", not_json)
                    if name not in _NO_IO:
                        responses.setdefault("503", unavailable)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _read_by_read_json(operation: dict[str, Any]) -> bool:
    """Whether the operation's body is one `app.api.body.read_json` reads (a model of
    `BODY_MODELS`, or one of several): those refuse another type than JSON with a 415."""
    content = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
    schema = content.get("schema", {})
    refs = [schema.get("$ref", "")] + [s.get("$ref", "") for s in schema.get("oneOf", [])]
    names = {f"#/components/schemas/{model.__name__}" for model in BODY_MODELS}
    return any(ref in names for ref in refs)


BEARER_SCHEME = {
    "type": "http",
    "description": "A key from TRAINYARD_API_KEYS (admin), or a project's key (`ty_…`) "
    "with its scopes.",
    "scheme": "bearer",
}


_METADATA = {"tags", "summary", "description", "operationId", "deprecated"}


def _with_bearer(operation: dict[str, Any]) -> dict[str, Any]:
    """`operation` with the bearer key as its security requirement, after the operation's
    metadata (where FastAPI puts a route's own security dependency)."""
    items = list(operation.items())
    at = next((i for i, (key, _) in enumerate(items) if key not in _METADATA), len(items))
    return dict([*items[:at], ("security", [{"HTTPBearer": []}]), *items[at:]])


def _document_bodies(schema: dict[str, Any], components: dict[str, Any]) -> None:
    """The schemas of the request bodies that routes read themselves (`app.api.body`),
    written by FastAPI as it writes those of the bodies it reads, in order among them; and
    each body where FastAPI puts one: before the responses."""
    stand_ins = APIRouter()
    for model in BODY_MODELS:

        async def endpoint() -> None: ...

        body = inspect.Parameter("body", inspect.Parameter.KEYWORD_ONLY, annotation=model)
        endpoint.__signature__ = inspect.Signature([body])  # type: ignore[attr-defined]
        stand_ins.add_api_route(f"/{model.__name__}", endpoint, methods=["POST"])
    written = get_openapi(title="", version="", routes=stand_ins.routes)
    merged = {**components, **written.get("components", {}).get("schemas", {})}
    for name in ("HTTPValidationError", "ValidationError"):
        merged.pop(name, None)
    components.clear()
    components.update(sorted(merged.items()))
    for path in schema.get("paths", {}).values():
        for method, operation in path.items():
            if "requestBody" in operation and "responses" in operation:
                items = [(k, v) for k, v in operation.items() if k != "requestBody"]
                items.insert(
                    [k for k, _ in items].index("responses"),
                    ("requestBody", operation["requestBody"]),
                )
                path[method] = dict(items)
