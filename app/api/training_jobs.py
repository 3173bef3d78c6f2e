"""Training jobs: submit trajectories, watch progress and events, cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from app.api.deps import Cursor, JobId, ModelFilter, Session
from app.api.job_events import add_event_routes
from app.models import JobKind, JobStatus
from app.schemas.common import Page, problem_responses
from app.schemas.jobs import TrainingJob, TrainingJobCreate
from app.services import jobs as service

router = APIRouter(
    prefix="/v1/training-jobs", tags=["training_jobs"], responses=problem_responses(401)
)


IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        max_length=255,
        description="Retrying with the same key and body returns the original job.",
    ),
]


@router.post(
    "",
    response_model=TrainingJob,
    status_code=202,
    summary="Submit trajectories for one training step",
    responses=problem_responses(404, 409, 413, 422),
)
async def create(
    body: TrainingJobCreate,
    request: Request,
    response: Response,
    session: Session,
    idempotency_key: IdempotencyKey = None,
) -> TrainingJob:
    job, replayed = await service.create_training_job(
        session,
        body=body,
        raw=await request.body(),
        idempotency_key=idempotency_key,
        max_attempts=request.app.state.settings.max_attempts,
    )
    await session.commit()
    if not replayed:
        request.app.state.notifier.jobs_changed()
        request.app.state.notifier.events_appended(job.id)
    else:
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = f"/v1/training-jobs/{job.id}"
    return service.to_wire(job)


@router.get(
    "",
    response_model=Page[TrainingJob],
    name="list",
    summary="List training jobs, newest first",
    responses=problem_responses(422),
)
async def list_all(
    session: Session,
    status: Annotated[JobStatus | None, Query(description="Only jobs in this status.")] = None,
    model: ModelFilter = None,
    after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Page[TrainingJob]:
    jobs, has_more = await service.list_jobs(
        session, status=status, model=model, after=after, limit=limit
    )
    return service.page_of(jobs, has_more, service.to_wire)


@router.get(
    "/{job_id}",
    response_model=TrainingJob,
    summary="Get a training job",
    responses=problem_responses(404),
)
async def get(job_id: JobId, session: Session) -> TrainingJob:
    return service.to_wire(await service.get_job(session, job_id))


@router.post(
    "/{job_id}/cancel",
    response_model=TrainingJob,
    summary="Cancel a job (queued: at once; running: its worker interrupts it)",
    responses=problem_responses(404, 409),
)
async def cancel(job_id: JobId, request: Request, session: Session) -> TrainingJob:
    job = await service.cancel_job(session, job_id)
    await session.commit()
    request.app.state.notifier.events_appended(job.id)
    return service.to_wire(job)


add_event_routes(router, JobKind.training)
