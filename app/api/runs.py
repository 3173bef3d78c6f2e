"""Training runs: the whole loop (sample, grade, train, validate, keep the best) as one
durable resource, and the datasets runs read."""

from __future__ import annotations

import email.message
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response

from app import datasets as dataset_service
from app.api.body import Reading, json_body, off_the_loop, read_json
from app.api.deps import Cursor, IdempotencyKey, JobId, ModelFilter, Reads, Session
from app.api.job_events import add_event_routes
from app.edge import body_of
from app.errors import InvalidInputError, ProblemError
from app.jobs import service as jobs_service
from app.jobs.lifecycle import JobKind, JobStatus
from app.runs import service
from app.schemas.common import FieldError, Page, problem_responses
from app.schemas.runs import RUN_PIECES, Dataset, Run, RunCreate, RunMetric

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=problem_responses(401))
datasets_router = APIRouter(
    prefix="/v1/datasets", tags=["datasets"], responses=problem_responses(401)
)
RUN = JobKind.run
READING = Reading(RunCreate, service.prepare, RUN_PIECES)


@router.post(
    "",
    response_model=Run,
    status_code=202,
    summary="Start a training run",
    responses=problem_responses(409, 413, 422),
    openapi_extra=json_body(RunCreate),
)
async def create(
    request: Request,
    response: Response,
    session: Session,
    idempotency_key: IdempotencyKey = None,
) -> Run:
    job, replayed = await service.create_run(
        session,
        job=await read_json(request, READING),
        idempotency_key=idempotency_key,
        settings=request.app.state.settings,
    )
    await session.commit()
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    else:
        request.app.state.notifier.jobs_changed()
    response.headers["Location"] = f"/v1/runs/{job.id}"
    return service.to_wire(*await service.get_run(session, job.id))


@router.get(
    "",
    name="list",
    response_model=Page[Run],
    summary="List runs, newest first",
    responses=problem_responses(422),
)
async def list_all(
    reader: Reads,
    status: Annotated[JobStatus | None, Query(description="Only runs in this status.")] = None,
    model: ModelFilter = None,
    after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Page[Run]:
    rows, has_more = await service.list_runs(
        reader, status=status, model=model, after=after, limit=limit
    )
    return Page(
        data=[service.to_wire(job, run) for job, run in rows],
        has_more=has_more,
        next_cursor=rows[-1][0].id if has_more and rows else None,
    )


@router.get("/{run_id}", response_model=Run, summary="Get a run", responses=problem_responses(404))
async def get(run_id: JobId, reader: Reads) -> Run:
    return service.to_wire(*await service.read_run(reader, run_id))


async def _set_paused(request: Request, session: Session, run_id: str, paused: bool) -> Run:
    job, run = await service.set_paused(session, run_id, paused=paused)
    await session.commit()
    request.app.state.notifier.events_appended(run_id)
    request.app.state.notifier.jobs_changed()
    return service.to_wire(job, run)


@router.post(
    "/{run_id}/pause",
    response_model=Run,
    summary="Pause a run: the child job under way finishes, no new one starts",
    responses=problem_responses(404, 409),
)
async def pause(run_id: JobId, request: Request, session: Session) -> Run:
    return await _set_paused(request, session, run_id, True)


@router.post(
    "/{run_id}/resume",
    response_model=Run,
    summary="Resume a paused run",
    responses=problem_responses(404, 409),
)
async def resume(run_id: JobId, request: Request, session: Session) -> Run:
    return await _set_paused(request, session, run_id, False)


@router.post(
    "/{run_id}/cancel",
    response_model=Run,
    summary="Cancel a run and the child job under way (a step that lands still counts)",
    responses=problem_responses(404, 409),
)
async def cancel(run_id: JobId, request: Request, session: Session) -> Run:
    await jobs_service.cancel_job(session, run_id, kind=RUN)
    await session.commit()
    request.app.state.notifier.events_appended(run_id)
    request.app.state.notifier.jobs_changed()
    return service.to_wire(*await service.get_run(session, run_id))


@router.get(
    "/{run_id}/metrics",
    response_model=Page[RunMetric],
    summary="A run's curves: one row per training step and per validation",
    responses=problem_responses(404, 422),
)
async def metrics(
    run_id: JobId,
    session: Session,
    kind: Annotated[
        Literal["step", "validation"] | None, Query(description="Only rows of this kind.")
    ] = None,
    after: Annotated[int, Query(ge=0, le=2**31 - 1, description="Rows with seq > after.")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Page[RunMetric]:
    items, has_more = await service.metrics(session, run_id, after=after, limit=limit, kind=kind)
    return Page(
        data=items,
        has_more=has_more,
        next_cursor=str(items[-1].seq) if has_more and items else None,
    )


add_event_routes(router, RUN)


# -- datasets ---------------------------------------------------------------------------------

JSONL_TYPES = (
    "application/jsonl",
    "application/x-ndjson",
    "application/x-jsonlines",
    "text/plain",
    "application/octet-stream",
)
EXAMPLE_LINES = (
    '{"id": "q1", "messages": [{"role": "user", "content": "What is 2+2?"}], "expected": "4"}\n'
    '{"id": "v1", "messages": [{"role": "user", "content": "What is 3+3?"}], "expected": "6", '
    '"split": "validation"}\n'
)
DatasetName = Annotated[
    str,
    Query(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$", description="A name for the dataset."),
]


@datasets_router.post(
    "",
    response_model=Dataset,
    status_code=201,
    summary="Upload examples as JSON Lines (one example per line, with its `split`)",
    description="The body is JSON Lines, sent as `application/jsonl`, "
    "`application/x-ndjson`, `text/plain` or `application/octet-stream`: "
    "one rollout example per line (`id`, `messages`, `expected`, `metadata`) with the "
    "`split` it belongs to (default `train`). Every error names its line: "
    "`line[3].messages[0].role`. The same bytes uploaded again under the same name answer "
    "200 with the dataset stored the first time.",
    responses={
        200: {"model": Dataset, "description": "Already stored."},
        **problem_responses(413, 422),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                media: {
                    "schema": {"type": "string", "description": "JSON Lines"},
                    "example": EXAMPLE_LINES,
                }
                # The one media type OpenAPI generators take for raw bytes; the route also
                # takes the JSON Lines types (`JSONL_TYPES`), as its description says.
                for media in ("application/octet-stream",)
            },
        }
    },
)
async def upload(
    request: Request, response: Response, session: Session, name: DatasetName
) -> Dataset:
    problem = _jsonl_type_problem(request.headers.get("content-type"))
    if problem is not None:
        raise InvalidInputError("a dataset is uploaded as JSON Lines in UTF-8", errors=[problem])
    raw = await body_of(request)
    depth = request.app.state.settings.max_json_depth

    def read() -> dataset_service.Prepared | ProblemError:
        return dataset_service.read_jsonl(raw, max_depth=depth)

    # The path of large JSON bodies (`read_json`): in a thread, the collector paused.
    outcome = (
        read() if len(raw) <= dataset_service.INLINE_BYTES else await off_the_loop(request, read)
    )
    if isinstance(outcome, ProblemError):
        raise outcome
    dataset, created = await dataset_service.create_dataset(session, name=name, prepared=outcome)
    await session.commit()
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"/v1/datasets/{dataset.id}"
    return dataset


def _jsonl_type_problem(content_type: str | None) -> FieldError | None:
    """A JSON Lines media type (`JSONL_TYPES`), in UTF-8: a `charset` other than UTF-8 (or
    its subset US-ASCII) is refused, as for JSON bodies."""
    if (content_type or "").split(";")[0].strip().lower() not in JSONL_TYPES:
        return FieldError(
            location="header",
            path="content-type",
            message=f"send one of {', '.join(JSONL_TYPES)}",
            type="content_type",
        )
    message = email.message.Message()
    message["content-type"] = content_type or ""
    charset = message.get_param("charset")
    if charset is not None and (
        not isinstance(charset, str) or charset.lower().replace("-", "") not in ("utf8", "usascii")
    ):
        return FieldError(
            location="header",
            path="content-type",
            message=f"JSON Lines are UTF-8; this body says charset={charset}",
            type="charset",
        )
    return None


@datasets_router.get(
    "", name="list", response_model=Page[Dataset], summary="List datasets, newest first"
)
async def list_datasets(
    session: Session,
    name: Annotated[str | None, Query(max_length=128, pattern=r"^[^\x00]*$")] = None,
    after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Page[Dataset]:
    items, has_more = await dataset_service.list_datasets(
        session, name=name, after=after, limit=limit
    )
    return Page(data=items, has_more=has_more, next_cursor=items[-1].id if has_more else None)


@datasets_router.get(
    "/{dataset_id}",
    response_model=Dataset,
    summary="Get a dataset",
    responses=problem_responses(404),
)
async def get_dataset(dataset_id: JobId, session: Session) -> Dataset:
    return dataset_service.to_wire(await dataset_service.get_dataset(session, dataset_id))


@datasets_router.delete(
    "/{dataset_id}",
    status_code=204,
    summary="Delete a dataset no active run reads",
    responses=problem_responses(404, 409),
)
async def delete_dataset(dataset_id: JobId, session: Session) -> Response:
    await dataset_service.delete_dataset(session, dataset_id)
    await session.commit()
    return Response(status_code=204)
