"""What every job route does the same way, whatever the kind: read, list, cancel, and the
fields every kind of job shows."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import Reader, begin_write
from app.errors import ConflictError, InvalidInputError, NotFoundError, field_errors
from app.jobs.lifecycle import JobKind, JobStatus, NewJob
from app.jobs.store import enqueue, request_cancel
from app.models import JobRow
from app.schemas.common import Page
from app.schemas.jobs import JobError, JobProgress

T = TypeVar("T")


async def get_job(
    session: AsyncSession, job_id: str, *, kind: JobKind, for_update: bool = False
) -> JobRow:
    query = select(JobRow).where(JobRow.id == job_id, JobRow.kind == kind.value)
    if for_update:
        query = query.with_for_update()
    job = await session.scalar(query)
    if job is None:
        raise NotFoundError(f"no {kind.value} job {job_id!r}")
    return job


_READ_JOB = select(JobRow).where(JobRow.id == bindparam("id"), JobRow.kind == bindparam("kind"))
"""Built once: building a statement costs more than SQLite takes to run it."""


async def read_job(reader: Reader, job_id: str, *, kind: JobKind) -> JobRow:
    """A job as a request reads it alone (`Reader`: one trip off the event loop)."""
    job = await reader.scalar(_READ_JOB, {"id": job_id, "kind": kind.value})
    if job is None:
        raise NotFoundError(f"no {kind.value} job {job_id!r}")
    return job  # type: ignore[no-any-return]


async def list_jobs(
    reader: Reader,
    *,
    kind: JobKind,
    status: JobStatus | None,
    model: str | None,
    after: str | None,
    limit: int,
    metadata: dict[str, str] | None = None,
) -> tuple[list[JobRow], bool]:
    """Newest first. `metadata`: only jobs whose metadata has each key with that value
    (a string; a number matches its JSON text, on both dialects)."""
    query = (
        select(JobRow).where(JobRow.kind == kind.value).order_by(JobRow.id.desc()).limit(limit + 1)
    )
    for key, value in (metadata or {}).items():
        query = query.where(JobRow.meta[key].as_string() == value)
    if status is not None:
        query = query.where(JobRow.status == status.value)
    if model is not None:
        query = query.where(JobRow.model_name == model)
    if after:
        query = query.where(JobRow.id < after)
    rows = await reader.scalars(query)
    return list(rows[:limit]), len(rows) > limit


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
    session: AsyncSession, new: NewJob, idempotency_key: str | None
) -> tuple[JobRow, bool]:
    """Enqueue `new` (in the caller's write transaction); (job, replayed). A concurrent
    request with the same Idempotency-Key that committed first is answered as its replay;
    one still in progress is a 409."""
    try:
        return await enqueue(session, new), False
    except IntegrityError as exc:
        await session.rollback()
        await begin_write(session)
        if idempotency_key is not None:
            earlier = await replay(session, idempotency_key, new.request_hash)
            if earlier is not None:
                return earlier, True
        raise ConflictError("a request with this Idempotency-Key is in progress") from exc


async def cancel_job(session: AsyncSession, job_id: str, *, kind: JobKind) -> JobRow:
    """Queued: cancelled now. Running: flagged; its worker interrupts it. Finished: 409."""
    await begin_write(session)
    job = await get_job(session, job_id, kind=kind, for_update=True)
    status = JobStatus(job.status)
    if status.is_final:
        raise ConflictError(f"job {job_id} already {status.value}; it cannot be cancelled")
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


def progress_of(job: JobRow) -> JobProgress:
    total = job.progress_total
    percent = None
    if total:
        percent = round(100.0 * job.progress_step / total, 2)
    elif total == 0:
        percent = 100.0
    return JobProgress(step=job.progress_step, total=total, percent=percent)


def job_fields(job: JobRow) -> dict[str, Any]:
    """What every kind of job shows the same way."""
    return {
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


def page_of(jobs: list[JobRow], has_more: bool, wire: Callable[[JobRow], T]) -> Page[T]:
    return Page(
        data=[wire(j) for j in jobs],
        has_more=has_more,
        next_cursor=jobs[-1].id if has_more and jobs else None,
    )
