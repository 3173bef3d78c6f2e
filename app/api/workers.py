"""Workers: the live ones, what each runs and can run, and asking one to drain."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Annotated, Protocol, TypeVar

from fastapi import APIRouter, Path, Request
from sqlalchemy.ext.asyncio import AsyncEngine

from app.api.deps import Caller, Session
from app.db import begin_write
from app.jobs import pools, quotas
from app.jobs.lifecycle import JobStatus
from app.schemas.common import NO_NUL, problem_responses
from app.schemas.workers import Worker

router = APIRouter(prefix="/v1/workers", tags=["workers"], responses=problem_responses(401))


@router.get(
    "",
    response_model=list[Worker],
    name="list",
    summary="List live workers: pool, backends, labels, the jobs each runs (a key that is "
    "not admin: its project's only), draining",
    description="A worker is live while it heartbeats within the lease time "
    "(`TRAINYARD_LEASE_SECONDS`) and has not stopped; one that stopped heartbeating is gone "
    "after that time. Oldest first.",
)
async def list_all(request: Request, session: Session, caller: Caller) -> list[Worker]:
    return await pools.list_workers(
        session, lease_seconds=request.app.state.settings.lease_seconds, project_id=caller.sees
    )


@router.post(
    "/{worker_id}/drain",
    response_model=Worker,
    status_code=202,
    summary="Ask a worker to drain: stop claiming, finish or hand back what it runs, exit",
    description="The worker reads the request with its next heartbeat "
    "(`TRAINYARD_HEARTBEAT_SECONDS`); meanwhile and after, it shows `draining: true`. "
    "Asking again changes nothing. Same as `trainyard worker --drain WORKER_ID`.",
    responses=problem_responses(404),
)
async def drain(
    worker_id: Annotated[str, Path(max_length=255, pattern=NO_NUL)],
    request: Request,
    session: Session,
) -> Worker:
    await begin_write(session)
    worker = await pools.request_drain(
        session, worker_id, lease_seconds=request.app.state.settings.lease_seconds
    )
    await session.commit()
    return worker


class _Job(Protocol):
    id: str
    model: str
    status: JobStatus
    waiting_for: str | None

    def model_copy(self, *, update: dict[str, str]) -> _Job: ...


J = TypeVar("J", bound=_Job)
LIVE_WORKERS_TTL = 1.0
"""Seconds a process reuses its read of the live workers and of the projects at their
running quota for `waiting_for`: a GET of a queued job stays one statement (the reads
benchmark), and a worker that registers or leaves, or a project's slot that frees, shows
within a second."""


class Waits:
    """Why queued jobs wait, per process: the live workers read at most once a
    `LIVE_WORKERS_TTL`, and each model's pool, backend and labels, which never change
    once registered, read once."""

    def __init__(self, engine: AsyncEngine, lease_seconds: float) -> None:
        self.engine = engine
        self.lease_seconds = lease_seconds
        self.models: dict[str, tuple[str | None, str, dict[str, str] | None]] = {}
        self.projects: dict[str, str] = {}  # model -> its project (never changes)
        self.full: dict[str, tuple[int, int]] = {}  # projects at their running quota
        self.live: list[pools.LiveWorker] = []
        self.read_at = -LIVE_WORKERS_TTL
        self._reading = asyncio.Lock()
        self._tries = 0  # reads begun, ended or failed: waiting behind one, take its result

    def _stale(self, models: set[str]) -> bool:
        return not models <= self.models.keys() or (
            time.monotonic() - self.read_at >= LIVE_WORKERS_TTL
        )

    async def reasons(self, models: set[str]) -> dict[str, str]:
        if self._stale(models):
            # One read at a time: the requests that found it stale meanwhile take what it
            # read (16 at once under the reads benchmark's load made one each), even if it
            # took a second or failed; they read again only for a model it did not read.
            tries = self._tries
            async with self._reading:
                if not models <= self.models.keys() or (
                    self._tries == tries and self._stale(models)
                ):
                    try:
                        await self._read(models)
                    finally:
                        self._tries += 1
        return self._reasons(models)

    async def _read(self, models: set[str]) -> None:
        now = time.monotonic()
        missing = models - set(self.models)
        if missing or now - self.read_at >= LIVE_WORKERS_TTL:
            async with self.engine.connect() as conn:
                if missing:  # a model's project before it counts as read (`_reasons`)
                    needs = await pools.model_needs(conn, missing)
                    self.projects |= await quotas.projects_of(conn, missing)
                    self.models |= needs
                if now - self.read_at >= LIVE_WORKERS_TTL:
                    self.live = await pools.live_workers(conn, lease_seconds=self.lease_seconds)
                    self.full = await quotas.at_running_quota(conn)
                    self.read_at = now

    def _reasons(self, models: set[str]) -> dict[str, str]:
        reasons = {}
        for name in models & set(self.models):
            # The quota first: with a worker free, the job would still wait for it.
            full = self.full.get(self.projects.get(name, ""))
            reason = (
                f"its project's running_jobs quota: {full[0]} of {full[1]} running"
                if full is not None
                else pools.waiting_reason(self.live, *self.models[name])
            )
            if reason is not None:
                reasons[name] = reason
        return reasons


async def with_waits(request: Request, jobs: Sequence[J]) -> list[J]:
    """The jobs, each queued one that no live worker can run saying why (`waiting_for`)."""
    queued = {job.model for job in jobs if job.status is JobStatus.queued}
    if not queued:
        return list(jobs)
    state = request.app.state
    waits: Waits | None = getattr(state, "waits", None)
    if waits is None:
        waits = state.waits = Waits(state.engine, state.settings.lease_seconds)
    reasons = await waits.reasons(queued)
    return [
        job.model_copy(update={"waiting_for": reasons[job.model]})  # type: ignore[misc]
        if job.status is JobStatus.queued and job.model in reasons
        else job
        for job in jobs
    ]
