"""Worker pools: what a worker can run, which live workers there are, and why a queued job
waits.

A worker serves one pool (`default` unless told) with the backends it can load and the
labels an operator gave it. A model's jobs go to a worker of its pool (NULL: `default`)
that runs its backend and has every label the model asks for; the claim itself checks this
(`app.jobs.statements.claim_query`), so a job never lands on a worker that cannot run it.
A worker is live while it heartbeats within the lease time and has not stopped; a draining
one claims nothing more.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select, update

from app.db import utcnow
from app.errors import not_found
from app.jobs.events import Executor
from app.jobs.lifecycle import JobKind, JobStatus
from app.jobs.statements import jobs, models, workers
from app.schemas.workers import Worker
from app.settings import DEFAULT_POOL


@dataclass(frozen=True)
class Capabilities:
    """What a worker can run: its pool, its backends and its labels."""

    pool: str = DEFAULT_POOL
    backends: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)

    def fits(self, pool: str | None, backend: str, labels: Mapping[str, str] | None) -> bool:
        """Whether a job of a model with this pool, backend and labels may run here."""
        return (
            (pool or DEFAULT_POOL) == self.pool
            and backend in self.backends
            and all(self.labels.get(key) == value for key, value in (labels or {}).items())
        )

    def label_pairs(self) -> list[str]:
        """The labels as `key=value` texts (SQLite's claim compares those)."""
        return [f"{key}={value}" for key, value in sorted(self.labels.items())]

    def labels_json(self) -> str:
        return json.dumps(dict(sorted(self.labels.items())), separators=(",", ":"))


def describe_labels(labels: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


@dataclass(frozen=True)
class LiveWorker:
    id: str
    capabilities: Capabilities
    backends_known: bool  # False: a worker from before pools, which claims any backend

    def fits(self, pool: str | None, backend: str, labels: Mapping[str, str] | None) -> bool:
        caps = self.capabilities
        if not self.backends_known:
            caps = Capabilities(caps.pool, (backend,), caps.labels)
        return caps.fits(pool, backend, labels)


def _live(lease_seconds: float) -> Any:
    return (workers.c.stopped_at.is_(None)) & (
        workers.c.heartbeat_at > utcnow() - timedelta(seconds=lease_seconds)
    )


async def live_workers(
    executor: Executor, *, lease_seconds: float, claiming: bool = True
) -> list[LiveWorker]:
    """Workers that heartbeat within the lease time and have not stopped; `claiming`: only
    those that still claim (not draining)."""
    query = select(
        workers.c.id, workers.c.pool, workers.c.backends, workers.c.labels, workers.c.draining
    ).where(_live(lease_seconds))
    if claiming:
        query = query.where(workers.c.draining.is_(False), workers.c.drain_requested.is_(None))
    rows = (await executor.execute(query)).all()
    return [
        LiveWorker(
            row.id,
            Capabilities(row.pool or DEFAULT_POOL, tuple(row.backends or ()), row.labels or {}),
            row.backends is not None,
        )
        for row in rows
    ]


def waiting_reason(
    live: Sequence[LiveWorker], pool: str | None, backend: str, labels: Mapping[str, str] | None
) -> str | None:
    """Why no live worker can run a job of a model with this pool, backend and labels;
    None when one can."""
    pool = pool or DEFAULT_POOL
    in_pool = [w for w in live if w.capabilities.pool == pool]
    if not in_pool:
        return f"no live worker in pool `{pool}`"
    running = [w for w in in_pool if w.fits(pool, backend, None)]
    if not running:
        return f"no live worker in pool `{pool}` runs backend `{backend}`"
    if not any(w.fits(pool, backend, labels) for w in running):
        return (
            f"no live worker in pool `{pool}` that runs backend `{backend}` has the labels "
            f"`{describe_labels(labels or {})}`"
        )
    return None


async def model_needs(
    executor: Executor, names: Iterable[str]
) -> dict[str, tuple[str | None, str, dict[str, str] | None]]:
    """Each model's pool, backend and labels: what a worker needs to run its jobs."""
    rows = await executor.execute(
        select(models.c.name, models.c.pool, models.c.backend, models.c.labels).where(
            models.c.name.in_(list(names))
        )
    )
    return {row.name: (row.pool, row.backend, row.labels) for row in rows}


async def waiting_for(
    executor: Executor, queued: Iterable[tuple[str, str]], *, lease_seconds: float
) -> dict[str, str]:
    """For queued jobs, given as (job id, model name): why each waits for a worker, for
    those no live worker can run."""
    queued = list(queued)
    if not queued:
        return {}
    names = {model for _, model in queued}
    rows = await executor.execute(
        select(models.c.name, models.c.pool, models.c.backend, models.c.labels).where(
            models.c.name.in_(names)
        )
    )
    live = await live_workers(executor, lease_seconds=lease_seconds)
    reasons: dict[str, str] = {}
    for row in rows:
        reason = waiting_reason(live, row.pool, row.backend, row.labels)
        if reason is not None:
            reasons[row.name] = reason
    return {job_id: reasons[model] for job_id, model in queued if model in reasons}


async def list_workers(
    executor: Executor, *, lease_seconds: float, project_id: str | None = None
) -> list[Worker]:
    """Live workers (draining ones included), oldest first, with the jobs each runs (with
    `project_id`: only that project's; workers are shared, another project's jobs are not
    shown)."""
    rows = (
        await executor.execute(
            select(workers).where(_live(lease_seconds)).order_by(workers.c.started_at, workers.c.id)
        )
    ).all()
    running: dict[str, list[str]] = {row.id: [] for row in rows}
    if running:
        query = (
            select(jobs.c.id, jobs.c.lease_owner)
            .where(
                jobs.c.status == JobStatus.running.value,
                jobs.c.kind != JobKind.run.value,
                jobs.c.lease_owner.in_(list(running)),
            )
            .order_by(jobs.c.id)
        )
        if project_id is not None:
            query = query.where(jobs.c.project_id == project_id)
        held = await executor.execute(query)
        for job_id, owner in held:
            running[owner].append(job_id)
    return [_wire(row, running[row.id]) for row in rows]


def _wire(row: Any, jobs_held: list[str]) -> Worker:
    return Worker(
        id=row.id,
        host=row.hostname,
        pid=row.pid,
        pool=row.pool or DEFAULT_POOL,
        backends=list(row.backends or []),
        labels=dict(row.labels or {}),
        version=row.version,
        started_at=row.started_at,
        heartbeat_at=row.heartbeat_at,
        jobs=jobs_held,
        draining=bool(row.draining or row.drain_requested is not None),
        drain_requested_at=row.drain_requested,
    )


async def request_drain(executor: Executor, worker_id: str, *, lease_seconds: float) -> Worker:
    """Ask a live worker to drain: it reads this with its next heartbeat, stops claiming,
    finishes or hands back what it runs, and exits. Asking again changes nothing. In the
    caller's write transaction; 404 for a worker that is not live."""
    live = _live(lease_seconds) & (workers.c.id == worker_id)
    await executor.execute(
        update(workers)
        .where(live, workers.c.drain_requested.is_(None))
        .values(drain_requested=utcnow())
    )
    for worker in await list_workers(executor, lease_seconds=lease_seconds):
        if worker.id == worker_id:
            return worker
    raise not_found("live worker", worker_id, param="worker_id")


async def queue_by_pool(executor: Executor) -> dict[tuple[str, str], int]:
    """Queued jobs due now (runs aside: their children are the jobs), by (pool, backend)."""
    pool = func.coalesce(models.c.pool, DEFAULT_POOL)
    rows = await executor.execute(
        select(pool, models.c.backend, func.count())
        .select_from(jobs.join(models, models.c.name == jobs.c.model_name))
        .where(
            jobs.c.status == JobStatus.queued.value,
            jobs.c.kind != JobKind.run.value,
            jobs.c.not_before <= utcnow(),
        )
        .group_by(pool, models.c.backend)
    )
    return {(row[0], row[1]): row[2] for row in rows}


def workers_by_pool(live: Iterable[LiveWorker]) -> dict[tuple[str, str], int]:
    """Live workers per (pool, backend) they run (a worker counts once per backend)."""
    counts: dict[tuple[str, str], int] = {}
    for worker in live:
        for backend in worker.capabilities.backends or ("*",):
            key = (worker.capabilities.pool, backend)
            counts[key] = counts.get(key, 0) + 1
    return counts


def registration(capabilities: Capabilities, version: str) -> dict[str, Any]:
    """The columns a worker writes about itself when it registers."""
    return {
        "pool": capabilities.pool,
        "backends": list(capabilities.backends),
        "labels": dict(capabilities.labels),
        "version": version,
    }
