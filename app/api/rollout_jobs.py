"""Rollout jobs: Trainyard samples the model, grades, groups per example, may train."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from app.api.deps import Cursor, JobId, ModelFilter, Session
from app.api.job_events import add_event_routes
from app.models import JobKind, JobStatus
from app.schemas.common import Page, problem_responses
from app.schemas.rollouts import RolloutJob, RolloutJobCreate
from app.schemas.trajectories import TrajectoryCollection
from app.services import jobs as jobs_service
from app.services import rollouts as service

router = APIRouter(
    prefix="/v1/rollout-jobs", tags=["rollout_jobs"], responses=problem_responses(401)
)
ROLLOUT = JobKind.rollout


@router.post(
    "",
    response_model=RolloutJob,
    status_code=202,
    summary="Sample, grade and group answers for examples (and optionally train on them)",
    responses=problem_responses(413, 422),
)
async def create(
    body: RolloutJobCreate, request: Request, response: Response, session: Session
) -> RolloutJob:
    job = await service.create_rollout_job(
        session,
        body=body,
        raw=await request.body(),
        max_attempts=request.app.state.settings.max_attempts,
    )
    await session.commit()
    request.app.state.notifier.jobs_changed()
    response.headers["Location"] = f"/v1/rollout-jobs/{job.id}"
    return service.to_wire(job)


@router.get(
    "",
    name="list",
    response_model=Page[RolloutJob],
    summary="List rollout jobs, newest first",
    responses=problem_responses(422),
)
async def list_all(
    session: Session,
    status: Annotated[JobStatus | None, Query(description="Only jobs in this status.")] = None,
    model: ModelFilter = None,
    after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Page[RolloutJob]:
    jobs, has_more = await jobs_service.list_jobs(
        session, status=status, model=model, after=after, limit=limit, kind=ROLLOUT
    )
    return jobs_service.page_of(jobs, has_more, service.to_wire)


@router.get(
    "/{job_id}",
    response_model=RolloutJob,
    summary="Get a rollout job",
    responses=problem_responses(404),
)
async def get(job_id: JobId, session: Session) -> RolloutJob:
    return service.to_wire(await jobs_service.get_job(session, job_id, kind=ROLLOUT))


@router.post(
    "/{job_id}/cancel",
    response_model=RolloutJob,
    summary="Cancel a rollout job",
    responses=problem_responses(404, 409),
)
async def cancel(job_id: JobId, request: Request, session: Session) -> RolloutJob:
    job = await jobs_service.cancel_job(session, job_id, kind=ROLLOUT)
    await session.commit()
    request.app.state.notifier.events_appended(job.id)
    return service.to_wire(job)


@router.get(
    "/{job_id}/trajectories",
    response_model=TrajectoryCollection,
    summary="The built groups as a NeMo Agent Toolkit TrajectoryCollection",
    responses=problem_responses(404, 409),
)
async def trajectories(job_id: JobId, session: Session) -> TrajectoryCollection:
    job = await jobs_service.get_job(session, job_id, kind=ROLLOUT)
    await session.refresh(job, ["output"])
    return service.to_collection(job)


add_event_routes(router, ROLLOUT)
