"""What every job route does the same way, whatever the kind: read, list, cancel, and the
fields every kind of job shows."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import Lookup, Reader, begin_write
from app.errors import ConflictError, InvalidInputError, NotFoundError, field_errors, not_found
from app.jobs import quotas
from app.jobs.lifecycle import JobKind, JobStatus, NewJob
from app.jobs.store import enqueue, request_cancel
from app.jobs.usage import Pricing, job_usage
from app.models import JobRow, ModelRow
from app.schemas.common import Page
from app.schemas.jobs import JobError, JobProgress
from app.schemas.usage import JobUsage

T = TypeVar("T")


def job_noun(kind: JobKind) -> str:
    """How messages name a job of `kind`: `run`, `training job`, `rollout job`."""
    return "run" if kind is JobKind.run else f"{kind.value} job"


def missing_job(kind: JobKind, job_id: str, param: str | None = None) -> NotFoundError:
    """`no run 'run_x'`, at the path parameter that named it (`run_id` or `job_id`)."""
    default = "run_id" if kind is JobKind.run else "job_id"
    return not_found(job_noun(kind), job_id, param=param or default)


async def get_job(
    session: AsyncSession,
    job_id: str,
    *,
    kind: JobKind,
    for_update: bool = False,
    param: str | None = None,
    project_id: str | None = None,
) -> JobRow:
    """The job; with `project_id`, only if it is that project's (another's: 404)."""
    query = select(JobRow).where(JobRow.id == job_id, JobRow.kind == kind.value)
    if project_id is not None:
        query = query.where(JobRow.project_id == project_id)
    if for_update:
        query = query.with_for_update()
    job = await session.scalar(query)
    if job is None:
        raise missing_job(kind, job_id, param)
    return job


@dataclass(frozen=True, slots=True)
class JobView:
    """A job as the API shows it: the columns the wire models read, nothing else. GETs and
    lists read it with a plain SQL statement (`read_job`, `list_jobs`: no ORM object is
    built, a third of the cost of the read); a route holding a `JobRow` takes its view
    with `JobView.of`."""

    id: str
    kind: str
    model_name: str
    status: str
    meta: dict[str, Any]
    summary: dict[str, Any]
    hyperparameters: dict[str, Any]
    progress_step: int
    progress_total: int | None
    error: dict[str, Any] | None
    metrics: dict[str, Any] | None
    attempts: int
    max_attempts: int
    cancel_requested: bool
    policy_step: int | None
    max_steps_off_policy: int | None
    start_step: int | None
    final_step: int | None
    checkpoint_path: str | None
    recovered: bool
    trained: bool | None
    next_job_id: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    prompt_tokens: int | None
    completion_tokens: int | None
    trained_tokens: int | None
    earlier_seconds: float | None
    returned_at_attempt: int | None  # whether the last attempt is in `earlier_seconds`
    # The model's, which its prices follow (`app.jobs.usage.Pricing`): not the job's columns.
    backend: str | None = None
    base_model: str | None = None

    @classmethod
    def of(cls, job: JobRow, model: ModelRow | None = None) -> JobView:
        view = cls(*(getattr(job, name) for name in _VIEW_FIELDS))
        if model is None:
            return view
        return replace(view, backend=model.backend, base_model=model.base_model)

    @property
    def usage(self) -> JobUsage:
        return job_usage(self)


async def view_of(session: AsyncSession, job: JobRow) -> JobView:
    """A job the route holds as a row, with its model's backend and base model (the
    service has the model in the session already: no query)."""
    return JobView.of(job, await session.get(ModelRow, job.model_name))


_VIEW_FIELDS = tuple(f.name for f in fields(JobView) if f.name not in ("backend", "base_model"))
_COLUMNS = JobRow.__mapper__.columns  # by attribute name: table columns, not ORM attributes
_MODEL = ModelRow.__table__.c
_OF_MODEL = _MODEL.name == _COLUMNS["model_name"]
_VIEW = select(
    *(_COLUMNS[name] for name in _VIEW_FIELDS),
    select(_MODEL.backend).where(_OF_MODEL).scalar_subquery(),
    select(_MODEL.base_model).where(_OF_MODEL).scalar_subquery(),
)
_BY_ID = _VIEW.where(_COLUMNS["id"] == bindparam("id"), _COLUMNS["kind"] == bindparam("kind"))
_READ_JOB = Lookup(_BY_ID)
"""Built once: building a statement costs more than SQLite takes to run it."""
_READ_PROJECT_JOB = Lookup(_BY_ID.where(_COLUMNS["project_id"] == bindparam("project_id")))


async def read_job(
    reader: Reader,
    job_id: str,
    *,
    kind: JobKind,
    project_id: str | None = None,
    param: str | None = None,
    location: str = "path",
) -> JobView:
    """A job as a request reads it alone (`Reader.row`: one statement; on SQLite, on the
    event loop, never waiting for a lock). With `project_id`: only that project's. A 404
    names `param` (at `location`) when given."""
    if project_id is None:
        row = await reader.row(_READ_JOB, {"id": job_id, "kind": kind.value})
    else:
        values = {"id": job_id, "kind": kind.value, "project_id": project_id}
        row = await reader.row(_READ_PROJECT_JOB, values)
    if row is None:
        if location != "path" and param is not None:
            raise not_found(job_noun(kind), job_id, param=param, location=location)
        raise missing_job(kind, job_id, param)
    return JobView(*row)


async def list_jobs(
    reader: Reader,
    *,
    kind: JobKind,
    status: JobStatus | None,
    model: str | None,
    after: str | None,
    limit: int,
    metadata: dict[str, str] | None = None,
    project_id: str | None = None,
) -> tuple[list[JobView], bool]:
    """Newest first. `metadata`: only jobs whose metadata has each key with that value
    (a string; a number matches its JSON text, on both dialects)."""
    query = (
        _VIEW.where(_COLUMNS["kind"] == kind.value).order_by(_COLUMNS["id"].desc()).limit(limit + 1)
    )
    for key, value in (metadata or {}).items():
        query = query.where(_COLUMNS["meta"][key].as_string() == value)
    if project_id is not None:
        query = query.where(_COLUMNS["project_id"] == project_id)
    if status is not None:
        query = query.where(_COLUMNS["status"] == status.value)
    if model is not None:
        query = query.where(_COLUMNS["model_name"] == model)
    if after:
        query = query.where(_COLUMNS["id"] < after)
    rows = await reader.rows(query)
    return [JobView(*row) for row in rows[:limit]], len(rows) > limit


async def replay(session: AsyncSession, key: str, request_hash: str) -> JobRow | None:
    """The job an earlier request with this Idempotency-Key created, if any; 422 if that
    request had another body."""
    job = await session.scalar(select(JobRow).where(JobRow.idempotency_key == key))
    if job is None:
        return None
    if job.request_hash != request_hash:
        raise InvalidInputError(
            "this Idempotency-Key was used with a different request body",
            errors=field_errors(
                [
                    {
                        "loc": ("header", "idempotency-key"),
                        "msg": "key reused with another body",
                        "type": "idempotency_key_reused",
                    }
                ]
            ),
        )
    return job


async def enqueue_once(
    session: AsyncSession, new: NewJob, idempotency_key: str | None, key_id: str | None = None
) -> tuple[JobRow, bool]:
    """Enqueue `new`, a submission (in the caller's write transaction), if its project's
    quotas allow it (429 if not: `app.tenants.quotas.admit`); (job, replayed). A concurrent
    request with the same Idempotency-Key that committed first is answered as its replay;
    one still in progress is a 409. `key_id`: the key that submitted it."""
    await quotas.admit(session, new.model_name)
    try:
        return await enqueue(session, replace(new, submitted=True, key_id=key_id)), False
    except IntegrityError as exc:
        await session.rollback()
        await begin_write(session)
        if idempotency_key is not None:
            earlier = await replay(session, idempotency_key, new.request_hash)
            if earlier is not None:
                return earlier, True
        raise ConflictError("a request with this Idempotency-Key is in progress") from exc


async def cancel_job(
    session: AsyncSession, job_id: str, *, kind: JobKind, project_id: str | None = None
) -> JobRow:
    """Queued: cancelled now. Running: flagged; its worker interrupts it. Finished: 409."""
    await begin_write(session)
    job = await get_job(session, job_id, kind=kind, for_update=True, project_id=project_id)
    status = JobStatus(job.status)
    if status.is_final:
        raise ConflictError(
            f"{'run' if kind is JobKind.run else 'job'} {job_id} already {status.value}; "
            "it cannot be cancelled"
        )
    await request_cancel(session, job)
    return job


MAX_METADATA_FILTERS = 8
METADATA_PREFIX = "metadata."
METADATA_FILTER_DOC = (
    f"Filter by labels: `metadata.KEY=value` (repeatable, up to {MAX_METADATA_FILTERS}) keeps "
    "jobs whose `metadata` has KEY with that value (a string, or a number written as in "
    "JSON), e.g. `?metadata.experiment=baseline`."
)


def metadata_filters(params: Iterable[tuple[str, str]]) -> dict[str, str]:
    """`metadata.KEY=value` query parameters as {KEY: value}; 422 for a bad one."""
    filters: dict[str, str] = {}
    errors: list[dict[str, Any]] = []
    for name, value in params:
        if not name.startswith(METADATA_PREFIX):
            continue
        key = name[len(METADATA_PREFIX) :]
        loc = ("query", name)
        if not key or len(key) > 128 or "\x00" in key or "\x00" in value or len(value) > 1024:
            msg = "a metadata key of 1 to 128 characters and a value of at most 1024, no NUL"
            errors.append({"loc": loc, "msg": msg, "type": "value_error"})
        elif key in filters:
            errors.append({"loc": loc, "msg": "given twice", "type": "value_error"})
        filters[key] = value
    if len(filters) > MAX_METADATA_FILTERS:
        errors.append(
            {
                "loc": ("query",),
                "msg": f"at most {MAX_METADATA_FILTERS} metadata filters",
                "type": "value_error",
            }
        )
    if errors:
        raise InvalidInputError("bad metadata filter", errors=field_errors(errors))
    return filters


def progress_of(job: JobView) -> JobProgress:
    total = job.progress_total
    percent = None
    if total:
        percent = round(100.0 * job.progress_step / total, 2)
    elif total == 0:
        percent = 100.0
    return JobProgress(step=job.progress_step, total=total, percent=percent)


def job_fields(job: JobView, pricing: Pricing) -> dict[str, Any]:
    """What every kind of job shows the same way."""
    usage = job.usage
    return {
        "usage": usage,
        "cost": pricing.cost(usage, backend=job.backend, base_model=job.base_model),
        "id": job.id,
        "model": job.model_name,
        "status": JobStatus(job.status),
        "metadata": job.meta,
        "progress": progress_of(job),
        "error": JobError.model_validate(job.error) if job.error else None,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "cancel_requested": job.cancel_requested,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
    }


def page_of(
    jobs: list[JobView], has_more: bool, wire: Callable[[JobView, Pricing], T], pricing: Pricing
) -> Page[T]:
    return Page(
        data=[wire(j, pricing) for j in jobs],
        has_more=has_more,
        next_cursor=jobs[-1].id if has_more and jobs else None,
    )
