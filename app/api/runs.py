"""Training runs: the whole loop (sample, grade, train, validate, keep the best) as one
durable resource (the datasets they read: `app.api.datasets`)."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Literal

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
from app.jobs import service as jobs_service
from app.jobs.lifecycle import JobKind, JobStatus
from app.models import JobRow, RunRow
from app.runs import estimate as estimating
from app.runs import service
from app.schemas.common import Page, problem_responses
from app.schemas.rollouts import raw_duplicate_ids
from app.schemas.runs import RUN_PIECES, Run, RunCreate, RunEstimate, RunMetric, RunSettings

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=problem_responses(401))
# A path of its own: under /v1/runs it would be a run id's too (`GET /v1/runs/{run_id}`).
estimates_router = APIRouter(
    prefix="/v1/run-estimates", tags=["runs"], responses=problem_responses(401)
)
RUN = JobKind.run
READING = Reading(
    RunCreate,
    service.prepare,
    RUN_PIECES,
    also=partial(raw_duplicate_ids, what="a run's examples"),
)


@router.post(
    "",
    response_model=Run,
    status_code=202,
    summary="Start a training run",
    responses=problem_responses(409, 413, 422, 429),
    openapi_extra=json_body(RunCreate),
)
async def create(
    request: Request,
    response: Response,
    session: Session,
    caller: Caller,
    idempotency_key: IdempotencyKey = None,
) -> Run:
    job, replayed = await service.create_run(
        session,
        job=await read_json(request, READING),
        idempotency_key=scoped_key(caller, idempotency_key),
        settings=request.app.state.settings,
        project_id=caller.sees,
        key_id=caller.key_id,
    )
    await session.commit()
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    else:
        request.app.state.notifier.jobs_changed()
    response.headers["Location"] = f"/v1/runs/{job.id}"
    return await _one(session, await service.get_run(session, job.id), request)


@estimates_router.post(
    "",
    name="estimate",
    response_model=RunEstimate,
    summary="Price a run before it starts: a dry run of `POST /v1/runs`, storing nothing",
    description="The body of `POST /v1/runs`, checked exactly as it would be there (every "
    "problem a 4xx naming its field, a full queue a 429); nothing is stored, and the "
    "answer is the run's estimated usage and cost.",
    responses=problem_responses(409, 413, 422, 429),
    openapi_extra=json_body(RunCreate),
)
async def estimate(request: Request, session: Session, caller: Caller) -> RunEstimate:
    try:
        return await estimating.dry_run(
            session,
            job=await read_json(request, READING),
            settings=request.app.state.settings,
            pricing=pricing(request),
            project_id=caller.sees,
        )
    finally:
        await session.rollback()


@router.get(
    "",
    name="list",
    response_model=Page[Run],
    summary="List runs, newest first",
    responses=problem_responses(422),
)
async def list_all(
    request: Request,
    reader: Reads,
    caller: Caller,
    status: Annotated[JobStatus | None, Query(description="Only runs in this status.")] = None,
    model: ModelFilter = None,
    after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Page[Run]:
    rows, has_more = await service.list_runs(
        reader, status=status, model=model, after=after, limit=limit, project_id=caller.sees
    )
    return Page(
        data=await service.wired(reader.all, rows, pricing(request)),
        has_more=has_more,
        next_cursor=rows[-1][0].id if has_more and rows else None,
    )


@router.get("/{run_id}", response_model=Run, summary="Get a run", responses=problem_responses(404))
async def get(run_id: JobId, request: Request, reader: Reads, caller: Caller) -> Run:
    found = await service.read_run(reader, run_id, caller.sees)
    return (await service.wired(reader.all, [found], pricing(request)))[0]


async def _one(session: Session, found: tuple[JobRow, RunRow], request: Request) -> Run:
    read = service.session_read(session)
    return (await service.wired(read, [found], pricing(request)))[0]


async def _set_paused(
    request: Request, session: Session, caller: Caller, run_id: str, paused: bool
) -> Run:
    job, run = await service.set_paused(session, run_id, paused=paused, project_id=caller.sees)
    await session.commit()
    request.app.state.notifier.events_appended(run_id)
    request.app.state.notifier.jobs_changed()
    return await _one(session, (job, run), request)


@router.post(
    "/{run_id}/pause",
    response_model=Run,
    summary="Pause a run: the child job under way finishes, no new one starts",
    responses=problem_responses(404, 409),
)
async def pause(run_id: JobId, request: Request, session: Session, caller: Caller) -> Run:
    return await _set_paused(request, session, caller, run_id, True)


@router.post(
    "/{run_id}/resume",
    response_model=Run,
    summary="Resume a paused run",
    responses=problem_responses(404, 409),
)
async def resume(run_id: JobId, request: Request, session: Session, caller: Caller) -> Run:
    return await _set_paused(request, session, caller, run_id, False)


@router.post(
    "/{run_id}/cancel",
    response_model=Run,
    summary="Cancel a run and the child job under way (a step that lands still counts)",
    responses=problem_responses(404, 409),
)
async def cancel(run_id: JobId, request: Request, session: Session, caller: Caller) -> Run:
    await jobs_service.cancel_job(session, run_id, kind=RUN, project_id=caller.sees)
    await session.commit()
    request.app.state.notifier.events_appended(run_id)
    request.app.state.notifier.jobs_changed()
    return await _one(session, await service.get_run(session, run_id), request)


@router.get(
    "/{run_id}/metrics",
    response_model=Page[RunMetric],
    summary="A run's curves: one row per training step and per validation",
    responses=problem_responses(404, 422),
)
async def metrics(
    run_id: JobId,
    session: Session,
    caller: Caller,
    kind: Annotated[
        Literal["step", "validation"] | None, Query(description="Only rows of this kind.")
    ] = None,
    after: Annotated[int, Query(ge=0, le=2**31 - 1, description="Rows with seq > after.")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Page[RunMetric]:
    if caller.sees is not None:  # another project's run: 404
        await jobs_service.get_job(session, run_id, kind=RUN, project_id=caller.sees)
    items, has_more = await service.metrics(session, run_id, after=after, limit=limit, kind=kind)
    return Page(
        data=items,
        has_more=has_more,
        next_cursor=str(items[-1].seq) if has_more and items else None,
    )


@router.get(
    "/{run_id}/settings",
    response_model=RunSettings,
    summary="A run's settings: recipe, schedule, hyper-parameters, validation (no examples)",
    responses=problem_responses(404),
)
async def settings(run_id: JobId, session: Session, caller: Caller) -> RunSettings:
    if caller.sees is not None:  # another project's run: 404
        await jobs_service.get_job(session, run_id, kind=RUN, project_id=caller.sees)
    return await service.run_settings(session, run_id)


add_event_routes(router, RUN)
