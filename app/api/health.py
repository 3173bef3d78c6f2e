"""Liveness and readiness, open even when API keys are set; Prometheus metrics, open only
with TRAINYARD_METRICS_PUBLIC (else an admin key or a TRAINYARD_METRICS_KEYS key)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy import select

from app.backends import SPECS
from app.backends.admission import Admission
from app.errors import PROBLEM_JSON
from app.migrate import current_revision, head_revision
from app.models import ModelRow
from app.schemas.common import problem_responses

router = APIRouter(tags=["health"])

CHECK_TIMEOUT = 3.0


class Check(BaseModel):
    ok: bool
    detail: str


class Readiness(BaseModel):
    status: str = Field(description="`ready`, or `unavailable` (HTTP 503).")
    checks: dict[str, Check] = Field(description="Each check by name.")


class Liveness(BaseModel):
    status: str = "ok"


@router.get("/healthz", response_model=Liveness, summary="Liveness (no I/O)")
async def healthz() -> Liveness:
    return Liveness()


async def _database(request: Request) -> Check:
    async with request.app.state.engine.connect() as conn:
        current = await current_revision(conn)  # one query: reachable, and at which revision
    head = head_revision()  # read once per process
    if current != head:
        return Check(ok=False, detail=f"schema at {current}, code expects {head}")
    return Check(ok=True, detail=f"reachable, schema at head {head}")


async def _worker(request: Request) -> Check:
    worker = request.app.state.worker
    if worker is None:
        return Check(ok=True, detail="no worker in this process (TRAINYARD_WORKER_ENABLED=false)")
    settings = request.app.state.settings
    if worker.drain_asked.is_set():  # asked on purpose: the API itself is still fine
        return Check(ok=True, detail="drained: this process's worker claims nothing more")
    if worker.last_heartbeat is None:
        return Check(ok=False, detail="worker has not started yet")
    age = asyncio.get_running_loop().time() - worker.last_heartbeat
    if age > 3 * settings.heartbeat_seconds + 1:
        return Check(ok=False, detail=f"last worker heartbeat {age:.0f}s ago")
    return Check(ok=True, detail=f"heartbeat {age:.1f}s ago, {len(worker.tasks)} job(s) running")


async def _backends(request: Request) -> Check:
    failing = []
    for name, adapter in request.app.state.backends.active.items():
        try:
            await adapter.health()
        except Exception as exc:
            failing.append(f"{name}: {exc}")
    if failing:
        return Check(ok=False, detail="; ".join(failing))
    return Check(ok=True, detail="all backends in use are reachable")


def admissions(request: Request) -> dict[str, Admission]:
    """Where this process admits chat work: the gateway, and each active backend whose
    endpoint has its own admission (the cpu backend's)."""
    found = {"gateway": request.app.state.gateway.admission}
    for name, adapter in request.app.state.backends.active.items():
        admission = getattr(adapter.backend, "admission", None)
        if isinstance(admission, Admission):
            found[name] = admission
    return found


def _saturation(request: Request) -> tuple[list[str], str]:
    """(models at their bound, a line on the serving queues)."""
    saturated, queued, oldest = [], 0, 0.0
    for where, admission in admissions(request).items():
        saturated += [f"{model} ({where})" for model in admission.saturated()]
        for load in admission.load().values():
            queued += load.queued_requests
            oldest = max(oldest, load.oldest_wait_s)
    return saturated, f"{queued} request(s) queued, the oldest for {oldest:.1f}s"


async def _models(request: Request) -> Check:
    """Every model this process is meant to serve has been served (a restarted process is
    not ready before its endpoints are up), every endpoint answers, and no model is
    saturated (its admitted work at `serving_max_tokens`: new requests would get 429). A
    model that cannot be served (its backend or base model is broken) is named but does not
    hold readiness: one bad registration must not take the whole service out of rotation."""
    saturated, queues = _saturation(request)
    if saturated:
        return Check(ok=False, detail=f"saturated: {', '.join(saturated[:10])}; {queues}")
    worker = request.app.state.worker
    if worker is None:
        return Check(ok=True, detail=f"no worker here: worker processes serve the models; {queues}")
    if worker.drain_asked.is_set():
        return Check(ok=True, detail=f"drained: this process's worker serves nothing new; {queues}")
    serving = [name for name, spec in SPECS.items() if spec.serves]
    async with request.app.state.sessions() as session:
        rows = await session.execute(
            select(ModelRow.name, ModelRow.pool, ModelRow.backend, ModelRow.labels).where(
                ModelRow.backend.in_(serving)
            )
        )
        # Only the models its pool, backends and labels let it run: those it serves.
        fits = worker.capabilities.fits
        expected = {row.name for row in rows if fits(row.pool, row.backend, row.labels)}
    missing = sorted(expected - set(worker.serving) - set(worker.not_served))
    if missing:
        return Check(ok=False, detail="not served yet: " + ", ".join(missing[:10]))
    client = request.app.state.gateway.client
    served = expected & set(worker.serving)
    for url in {worker.serving[name] for name in served}:
        if url:  # any answer will do: the endpoint is up
            await client.get(f"{url.rstrip('/')}/models", timeout=2.0)
    detail = f"{len(served)} model(s) served and answering; {queues}"
    broken = sorted(expected & set(worker.not_served))
    if broken:
        detail += "; cannot serve: " + ", ".join(broken[:10])
    return Check(ok=True, detail=detail)


async def _run(check: Any, request: Request) -> Check:
    try:
        return await asyncio.wait_for(check(request), CHECK_TIMEOUT)
    except TimeoutError:
        return Check(ok=False, detail=f"timed out after {CHECK_TIMEOUT:.0f}s")
    except Exception as exc:
        return Check(ok=False, detail=f"{type(exc).__name__}: {exc}")


@router.get(
    "/readyz",
    response_model=Readiness,
    summary="Readiness: database, migrations, worker, trainer backends, served models",
    responses=problem_responses(503),
)
async def readyz(request: Request) -> Any:
    names = ("database", "worker", "backends", "models")
    checks_run = (_database, _worker, _backends, _models)
    results = await asyncio.gather(*(_run(c, request) for c in checks_run))
    checks = dict(zip(names, results, strict=True))
    if all(c.ok for c in checks.values()):
        return Readiness(status="ready", checks=checks)
    failing = [name for name, c in checks.items() if not c.ok]
    body = {
        "type": "urn:trainyard:problem:not-ready",
        "title": "Service Unavailable",
        "status": 503,
        "detail": "failing: " + ", ".join(failing),
        "instance": request.url.path,
        "checks": {name: c.model_dump() for name, c in checks.items()},
    }
    return JSONResponse(
        body, status_code=503, media_type=PROBLEM_JSON, headers={"Retry-After": "5"}
    )


@router.get(
    "/metrics",
    summary="Prometheus metrics (an admin key or a TRAINYARD_METRICS_KEYS key, unless "
    "TRAINYARD_METRICS_PUBLIC)",
    response_class=Response,
    responses={
        200: {
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "Prometheus text exposition format",
        },
        **problem_responses(401, 403),
    },
)
async def metrics(request: Request) -> Response:
    metrics, settings = request.app.state.metrics, request.app.state.settings
    body, content_type = await metrics.render(
        request.app.state.sessions, admissions(request), lease_seconds=settings.lease_seconds
    )
    return Response(body, media_type=content_type)
