"""Rollout jobs: Trainyard samples the model, grades, groups per example, may train."""

from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from app.api.body import Reading, json_body, read_json
from app.api.deps import (
    Caller,
    Cursor,
    IdempotencyKey,
    JobId,
    ModelFilter,
    Reads,
    Session,
    pricing,
    scoped_key,
)
from app.api.job_events import add_event_routes
from app.api.workers import with_waits
from app.egress import EgressPolicy
from app.jobs import service as jobs_service
from app.jobs.lifecycle import JobKind, JobStatus
from app.rollouts import service
from app.schemas.common import Page, problem_responses
from app.schemas.rollouts import (
    ROLLOUT_PIECES,
    RolloutJob,
    RolloutJobCreate,
    raw_duplicate_ids,
)
from app.schemas.trajectories import TrajectoryCollection

router = APIRouter(
    prefix="/v1/rollout-jobs", tags=["rollout_jobs"], responses=problem_responses(401)
)
ROLLOUT = JobKind.rollout
READING = Reading(
    RolloutJobCreate,
    service.prepare,
    ROLLOUT_PIECES,
    service.limits,
    also=partial(raw_duplicate_ids, what="a job's examples"),
)


@router.post(
    "",
    response_model=RolloutJob,
    status_code=202,
    summary="Sample, grade and group answers for examples (and optionally train on them)",
    responses=problem_responses(409, 413, 422, 429),
    openapi_extra=json_body(RolloutJobCreate),
)
async def create(
    request: Request,
    response: Response,
    session: Session,
    caller: Caller,
    idempotency_key: IdempotencyKey = None,
) -> RolloutJob:
    settings = request.app.state.settings
    job, replayed = await service.create_rollout_job(
        session,
        job=await read_json(request, READING),
        max_attempts=settings.max_attempts,
        idempotency_key=scoped_key(caller, idempotency_key),
        egress=EgressPolicy.from_settings(settings),
        project_id=caller.sees,
        key_id=caller.key_id,
    )
    await session.commit()
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    else:
        request.app.state.notifier.jobs_changed()
    response.headers["Location"] = f"/v1/rollout-jobs/{job.id}"
    return (
        await with_waits(
            request, [service.to_wire(await jobs_service.view_of(session, job), pricing(request))]
        )
    )[0]


@router.get(
    "",
    name="list",
    response_model=Page[RolloutJob],
    summary="List rollout jobs, newest first",
    description=jobs_service.METADATA_FILTER_DOC,
    responses=problem_responses(422),
)
async def list_all(
    request: Request,
    reader: Reads,
    caller: Caller,
    status: Annotated[JobStatus | None, Query(description="Only jobs in this status.")] = None,
    model: ModelFilter = None,
    after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Page[RolloutJob]:
    jobs, has_more = await jobs_service.list_jobs(
        reader,
        kind=ROLLOUT,
        status=status,
        model=model,
        after=after,
        limit=limit,
        metadata=jobs_service.metadata_filters(request.query_params.multi_items()),
        project_id=caller.sees,
    )
    page = jobs_service.page_of(jobs, has_more, service.to_wire, pricing(request))
    page.data = await with_waits(request, page.data)
    return page


@router.get(
    "/{job_id}",
    response_model=RolloutJob,
    summary="Get a rollout job",
    responses=problem_responses(404),
)
async def get(job_id: JobId, request: Request, reader: Reads, caller: Caller) -> RolloutJob:
    view = await jobs_service.read_job(reader, job_id, kind=ROLLOUT, project_id=caller.sees)
    job = service.to_wire(view, pricing(request))
    return (await with_waits(request, [job]))[0]


@router.post(
    "/{job_id}/cancel",
    response_model=RolloutJob,
    summary="Cancel a rollout job",
    responses=problem_responses(404, 409),
)
async def cancel(job_id: JobId, request: Request, session: Session, caller: Caller) -> RolloutJob:
    job = await jobs_service.cancel_job(session, job_id, kind=ROLLOUT, project_id=caller.sees)
    await session.commit()
    request.app.state.notifier.events_appended(job.id)
    return service.to_wire(await jobs_service.view_of(session, job), pricing(request))


@router.get(
    "/{job_id}/trajectories",
    response_model=TrajectoryCollection,
    summary="The built groups as a NeMo Agent Toolkit TrajectoryCollection",
    responses=problem_responses(404, 409),
)
async def trajectories(job_id: JobId, session: Session, caller: Caller) -> TrajectoryCollection:
    job = await jobs_service.get_job(session, job_id, kind=ROLLOUT, project_id=caller.sees)
    await session.refresh(job, ["output"])
    return service.to_collection(job)


add_event_routes(router, ROLLOUT)
