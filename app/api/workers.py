"""Workers: the live ones, what each runs and can run, and asking one to drain."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Protocol, TypeVar

from fastapi import APIRouter, Path, Request
from sqlalchemy.ext.asyncio import AsyncEngine

from app.api.deps import Session
from app.db import begin_write
from app.jobs import pools
from app.jobs.lifecycle import JobStatus
from app.schemas.common import NO_NUL, problem_responses
from app.schemas.workers import Worker

router = APIRouter(prefix="/v1/workers", tags=["workers"], responses=problem_responses(401))


@router.get(
    "",
    response_model=list[Worker],
    name="list",
    summary="List live workers: pool, backends, labels, the jobs each runs, draining",
    description="A worker is live while it heartbeats within the lease time "
    "(`TRAINYARD_LEASE_SECONDS`) and has not stopped; one that stopped heartbeating is gone "
    "after that time. Oldest first.",
)
async def list_all(request: Request, session: Session) -> list[Worker]:
    return await pools.list_workers(session, lease_seconds=request.app.state.settings.lease_seconds)


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


async def with_waits(request: Request, jobs: Sequence[J]) -> list[J]:
    """The jobs, each queued one that no live worker can run saying why (`waiting_for`)."""
    queued = [(job.id, job.model) for job in jobs if job.status is JobStatus.queued]
    if not queued:
        return list(jobs)
    engine: AsyncEngine = request.app.state.engine
    async with engine.connect() as conn:
        reasons = await pools.waiting_for(
            conn, queued, lease_seconds=request.app.state.settings.lease_seconds
        )
    return [
        job.model_copy(update={"waiting_for": reasons[job.id]}) if job.id in reasons else job  # type: ignore[misc]
        for job in jobs
    ]
