"""Evaluation jobs: a step of a model sampled on examples and scored, nothing trained."""

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
from app.evaluations import results, service
from app.jobs import service as jobs_service
from app.jobs.lifecycle import JobKind, JobStatus
from app.rollouts.service import limits
from app.schemas.common import NO_NUL, Page, problem_responses
from app.schemas.evaluations import (
    EVALUATION_PIECES,
    EvaluationComparison,
    EvaluationJob,
    EvaluationJobCreate,
    EvaluationReport,
    EvaluationResult,
)
from app.schemas.rollouts import raw_duplicate_ids

router = APIRouter(
    prefix="/v1/evaluation-jobs", tags=["evaluation_jobs"], responses=problem_responses(401)
)
EVALUATION = JobKind.evaluation
READING = Reading(
    EvaluationJobCreate,
    service.prepare,
    EVALUATION_PIECES,
    limits,
    also=partial(raw_duplicate_ids, what="a job's examples"),
)
ResultCursor = Annotated[
    str | None,
    Query(
        pattern=r"^[0-9]{1,9}\.[0-9]{1,9}$",  # within a 32-bit integer each
        description="`next_cursor` of the previous page (`<example>.<sample>`)",
    ),
]
JobRef = Annotated[str, Query(pattern=NO_NUL, max_length=64, description="An evaluation job.")]


@router.post(
    "",
    response_model=EvaluationJob,
    status_code=202,
    summary="Sample a step of a model on examples and score each answer (nothing trained)",
    responses=problem_responses(404, 409, 413, 422, 429),
    openapi_extra=json_body(EvaluationJobCreate),
)
async def create(
    request: Request,
    response: Response,
    session: Session,
    caller: Caller,
    idempotency_key: IdempotencyKey = None,
) -> EvaluationJob:
    settings = request.app.state.settings
    job, replayed = await service.create_evaluation_job(
        session,
        request.app.state.backends,
        job=await read_json(request, READING),
        max_attempts=settings.max_attempts,
        idempotency_key=scoped_key(caller, idempotency_key),
        project_id=caller.sees,
        key_id=caller.key_id,
        egress=EgressPolicy.from_settings(settings),
    )
    await session.commit()
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    else:
        request.app.state.notifier.jobs_changed()
    response.headers["Location"] = f"/v1/evaluation-jobs/{job.id}"
    return (
        await with_waits(
            request, [service.to_wire(await jobs_service.view_of(session, job), pricing(request))]
        )
    )[0]


@router.get(
    "",
    name="list",
    response_model=Page[EvaluationJob],
    summary="List evaluation jobs, newest first",
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
) -> Page[EvaluationJob]:
    jobs, has_more = await jobs_service.list_jobs(
        reader,
        kind=EVALUATION,
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


# Before `/{job_id}`: FastAPI tries routes in order.
@router.get(
    "/compare",
    response_model=EvaluationComparison,
    summary="Compare two evaluations of the same examples: per-example score deltas (b - a)",
    responses=problem_responses(404, 409, 422),
)
async def compare(a: JobRef, b: JobRef, reader: Reads, caller: Caller) -> EvaluationComparison:
    return await results.compare(reader, a, b, caller.sees)


@router.get(
    "/{job_id}",
    response_model=EvaluationJob,
    summary="Get an evaluation job",
    responses=problem_responses(404),
)
async def get(job_id: JobId, request: Request, reader: Reads, caller: Caller) -> EvaluationJob:
    view = await jobs_service.read_job(reader, job_id, kind=EVALUATION, project_id=caller.sees)
    job = service.to_wire(view, pricing(request))
    return (await with_waits(request, [job]))[0]


@router.get(
    "/{job_id}/results",
    response_model=Page[EvaluationResult],
    summary="An evaluation's answers with their scores or errors, by example and sample",
    responses=problem_responses(404, 422),
)
async def list_results(
    job_id: JobId,
    reader: Reads,
    caller: Caller,
    after: ResultCursor = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> Page[EvaluationResult]:
    # 404 for an unknown job, or another project's
    await jobs_service.read_job(reader, job_id, kind=EVALUATION, project_id=caller.sees)
    data, has_more = await results.page(reader, job_id, after=after, limit=limit)
    last = data[-1] if data else None
    cursor = results.cursor_of(last.example, last.sample) if has_more and last else None
    return Page(data=data, has_more=has_more, next_cursor=cursor)


@router.get(
    "/{job_id}/summary",
    response_model=EvaluationReport,
    summary="An evaluation's scores summed up, overall and per example, from its answers",
    responses=problem_responses(404),
)
async def summary(job_id: JobId, reader: Reads, caller: Caller) -> EvaluationReport:
    return await results.report(reader, job_id, caller.sees)


@router.post(
    "/{job_id}/cancel",
    response_model=EvaluationJob,
    summary="Cancel an evaluation job",
    responses=problem_responses(404, 409),
)
async def cancel(
    job_id: JobId, request: Request, session: Session, caller: Caller
) -> EvaluationJob:
    job = await jobs_service.cancel_job(session, job_id, kind=EVALUATION, project_id=caller.sees)
    await session.commit()
    request.app.state.notifier.events_appended(job.id)
    return service.to_wire(await jobs_service.view_of(session, job), pricing(request))


add_event_routes(router, EVALUATION)
