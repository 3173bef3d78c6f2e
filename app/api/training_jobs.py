"""Training jobs: submit trajectories, watch progress and events, cancel."""

from __future__ import annotations

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
from app.jobs import service as jobs
from app.jobs.lifecycle import JobKind, JobStatus
from app.schemas.common import Page, problem_responses
from app.schemas.jobs import (
    TRAINING_PIECES,
    TrainingJob,
    TrainingJobCreate,
    TrainingTrajectories,
    TrajectoryShape,
)
from app.schemas.supervised import DpoJobCreate, SftJobCreate
from app.schemas.trajectories import TrajectoryCollection
from app.training import service

router = APIRouter(
    prefix="/v1/training-jobs", tags=["training_jobs"], responses=problem_responses(401)
)


TRAINING = JobKind.training
READING = Reading(
    TrainingJobCreate,
    service.prepare,
    TRAINING_PIECES,
    service.limits,
    service.StreamedGroups,
    variants={
        "sft": Reading(SftJobCreate, service.prepare_sft),
        "dpo": Reading(DpoJobCreate, service.prepare_dpo),
    },
    default="rl",
)


@router.post(
    "",
    response_model=TrainingJob,
    status_code=202,
    summary="Submit one training step: RL trajectories, SFT examples or DPO pairs",
    description="The body's `method` picks its shape: `rl` (the default: trajectory groups "
    "or a NAT collection, `TrainingJobCreate`), `sft` (chat examples, inline or from a "
    "dataset split, `SftJobCreate`) or `dpo` (preference pairs, plain or NAT's DPO items, "
    "`DpoJobCreate`). Each is one model step, watched and ended like any other.",
    responses=problem_responses(404, 409, 413, 422, 429),
    openapi_extra=json_body(TrainingJobCreate, SftJobCreate, DpoJobCreate),
)
async def create(
    request: Request,
    response: Response,
    session: Session,
    caller: Caller,
    idempotency_key: IdempotencyKey = None,
) -> TrainingJob:
    job, replayed = await service.create_training_job(
        session,
        job=await read_json(request, READING),
        idempotency_key=scoped_key(caller, idempotency_key),
        max_attempts=request.app.state.settings.max_attempts,
        project_id=caller.sees,
        key_id=caller.key_id,
    )
    await session.commit()
    if not replayed:
        request.app.state.notifier.jobs_changed()
        request.app.state.notifier.events_appended(job.id)
    else:
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = f"/v1/training-jobs/{job.id}"
    return (
        await with_waits(
            request, [service.to_wire(await jobs.view_of(session, job), pricing(request))]
        )
    )[0]


@router.get(
    "",
    response_model=Page[TrainingJob],
    name="list",
    summary="List training jobs, newest first",
    description=jobs.METADATA_FILTER_DOC,
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
) -> Page[TrainingJob]:
    rows, has_more = await jobs.list_jobs(
        reader,
        kind=TRAINING,
        status=status,
        model=model,
        after=after,
        limit=limit,
        metadata=jobs.metadata_filters(request.query_params.multi_items()),
        project_id=caller.sees,
    )
    page = jobs.page_of(rows, has_more, service.to_wire, pricing(request))
    page.data = await with_waits(request, page.data)
    return page


@router.get(
    "/{job_id}",
    response_model=TrainingJob,
    summary="Get a training job",
    responses=problem_responses(404),
)
async def get(job_id: JobId, request: Request, reader: Reads, caller: Caller) -> TrainingJob:
    view = await jobs.read_job(reader, job_id, kind=TRAINING, project_id=caller.sees)
    job = service.to_wire(view, pricing(request))
    return (await with_waits(request, [job]))[0]


@router.post(
    "/{job_id}/cancel",
    response_model=TrainingJob,
    summary="Cancel a job (queued: at once; running: its worker interrupts it)",
    responses=problem_responses(404, 409),
)
async def cancel(job_id: JobId, request: Request, session: Session, caller: Caller) -> TrainingJob:
    job = await jobs.cancel_job(session, job_id, kind=TRAINING, project_id=caller.sees)
    await session.commit()
    request.app.state.notifier.events_appended(job.id)
    return service.to_wire(await jobs.view_of(session, job), pricing(request))


@router.get(
    "/{job_id}/trajectories",
    response_model=TrainingTrajectories | TrajectoryCollection,
    summary="The trajectories a training job was given",
    description="As stored: ART-style groups (a NAT collection was converted on arrival). "
    "`shape=nat` returns them as a NeMo Agent Toolkit `TrajectoryCollection` whose "
    "`run_id` is the job's id.",
    responses=problem_responses(404, 409, 422),
)
async def trajectories(
    job_id: JobId,
    session: Session,
    caller: Caller,
    shape: Annotated[TrajectoryShape, Query(description="`art` or `nat`.")] = "art",
) -> TrainingTrajectories | TrajectoryCollection:
    await jobs.get_job(session, job_id, kind=TRAINING, project_id=caller.sees)
    return await service.trajectories(session, job_id, shape=shape)


add_event_routes(router, TRAINING)
