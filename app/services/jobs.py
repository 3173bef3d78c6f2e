"""Training jobs: accept, read, list, cancel. Workers take it from there (app.worker)."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

import art
import zstandard
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from app.backends import SPECS
from app.db import begin_write, utcnow
from app.errors import ConflictError, InvalidInputError, NotFoundError, field_errors
from app.models import JobKind, JobRow, JobStatus, ModelRow
from app.schemas.common import Page
from app.schemas.jobs import JobError, JobProgress, JobResult, TrainingJob, TrainingJobCreate
from app.schemas.trajectories import TrajectorySummary
from app.services.events import add_events, append_event
from app.trajectories import (
    check_collection,
    check_groups,
    collection_to_art,
    groups_to_art,
    summarize_collection,
    summarize_groups,
)

T = TypeVar("T")
PAYLOAD_FORMAT = "training-job-create+json;zstd"
# Level 1: several hundred MB/s; JSON trajectories still shrink 5-10x.
_compressor = zstandard.ZstdCompressor(level=1)


def new_job_id() -> str:
    """Time-ordered ids, so listing newest-first is an index scan on the primary key."""
    return f"job_{time.time_ns() // 1000:014x}{secrets.token_hex(5)}"


def _invalid(detail: str, errors: list[dict[str, Any]]) -> InvalidInputError:
    return InvalidInputError(detail, errors=field_errors(errors))


def _hyperparameter_errors(backend: str, hyperparameters: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        SPECS[backend].hyperparameters.model_validate(hyperparameters)
    except ValidationError as exc:
        return [{**e, "loc": ("hyperparameters", *e["loc"])} for e in exc.errors()]
    return []


def _check_trajectories(body: TrainingJobCreate) -> tuple[TrajectorySummary, list[dict[str, Any]]]:
    opt_out = body.hyperparameters.get("allow_training_without_logprobs") is True
    if body.collection is not None:
        prefix: tuple[str, ...] = ("collection",)
        issues = check_collection(body.collection, require_logprobs=not opt_out)
        summary = summarize_collection(body.collection)
    else:
        assert body.groups is not None
        prefix = ("groups",)
        issues = check_groups(body.groups, require_logprobs=not opt_out)
        summary = summarize_groups(body.groups)
    errors = [{"loc": (*prefix, *i.loc), "msg": i.msg, "type": i.type} for i in issues]
    return summary, errors


async def create_training_job(
    session: AsyncSession,
    *,
    body: TrainingJobCreate,
    raw: bytes,
    idempotency_key: str | None,
    max_attempts: int,
) -> tuple[JobRow, bool]:
    """Validate and store a job with its payload and first event. Returns (job, replayed).

    Every problem with the request is reported at once (422); nothing is stored then.
    """
    # The CPU-heavy part runs before the first query, so no transaction waits on it.
    summary, errors = _check_trajectories(body)
    payload = _compressor.compress(raw) if not errors else b""
    request_hash = hashlib.sha256(raw).hexdigest()
    await begin_write(session)
    if idempotency_key is not None:
        replay = await _replay(session, idempotency_key, request_hash)
        if replay is not None:
            return replay, True
    model = await session.get(ModelRow, body.model)
    if model is None:
        errors.insert(
            0,
            {
                "loc": ("model",),
                "msg": "no such model; create it with POST /v1/models",
                "type": "unknown_model",
            },
        )
    else:
        errors += _hyperparameter_errors(model.backend, body.hyperparameters)
    if errors:
        raise _invalid(f"{len(errors)} problem(s) in the request; nothing was stored", errors)
    assert model is not None
    hyperparameters = (
        SPECS[model.backend]
        .hyperparameters.model_validate(body.hyperparameters)
        .model_dump(mode="json", exclude_unset=True)
    )
    job = JobRow(
        id=new_job_id(),
        kind=JobKind.training.value,
        model_name=model.name,
        status=JobStatus.queued.value,
        payload=payload,
        payload_format=PAYLOAD_FORMAT,
        payload_bytes=len(raw),
        hyperparameters=hyperparameters,
        meta=body.metadata,
        summary=summary.model_dump(),
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        attempts=0,
        max_attempts=max_attempts,
        not_before=utcnow(),
        last_event_seq=1,  # its first event, job_queued
    )
    session.add(job)
    try:
        await session.flush()
    except IntegrityError as exc:
        # A concurrent request with the same key committed first: answer as its replay.
        await session.rollback()
        await begin_write(session)
        if idempotency_key is not None:
            replay = await _replay(session, idempotency_key, request_hash)
            if replay is not None:
                return replay, True
        raise ConflictError("a request with this Idempotency-Key is in progress") from exc
    await add_events(session, job.id, 1, [("job_queued", {"summary": job.summary})])
    return job, False


async def _replay(session: AsyncSession, key: str, request_hash: str) -> JobRow | None:
    job = await session.scalar(select(JobRow).where(JobRow.idempotency_key == key))
    if job is None:
        return None
    if job.request_hash != request_hash:
        raise _invalid(
            "this Idempotency-Key was used with a different request body",
            [
                {
                    "loc": ("header", "idempotency-key"),
                    "msg": "key reused with another body",
                    "type": "idempotency_key_reused",
                }
            ],
        )
    return job


def load_groups(payload: bytes, payload_bytes: int) -> list[art.TrajectoryGroup]:
    """Rebuild the ART objects of a stored job (in the worker, off the request path)."""
    raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=payload_bytes)
    body = TrainingJobCreate.model_validate_json(raw)
    if body.collection is not None:
        return collection_to_art(body.collection)
    assert body.groups is not None
    return groups_to_art(body.groups)


async def get_job(
    session: AsyncSession,
    job_id: str,
    *,
    kind: JobKind = JobKind.training,
    for_update: bool = False,
) -> JobRow:
    query = select(JobRow).where(JobRow.id == job_id, JobRow.kind == kind.value)
    if for_update:
        query = query.with_for_update()
    job = await session.scalar(query)
    if job is None:
        raise NotFoundError(f"no {kind.value} job {job_id!r}")
    return job


async def list_jobs(
    session: AsyncSession,
    *,
    status: JobStatus | None,
    model: str | None,
    after: str | None,
    limit: int,
    kind: JobKind = JobKind.training,
) -> tuple[list[JobRow], bool]:
    query = (
        select(JobRow).where(JobRow.kind == kind.value).order_by(JobRow.id.desc()).limit(limit + 1)
    )
    if status is not None:
        query = query.where(JobRow.status == status.value)
    if model is not None:
        query = query.where(JobRow.model_name == model)
    if after:
        query = query.where(JobRow.id < after)
    rows = (await session.scalars(query)).all()
    return list(rows[:limit]), len(rows) > limit


async def cancel_job(
    session: AsyncSession, job_id: str, *, kind: JobKind = JobKind.training
) -> JobRow:
    """Queued: cancelled now. Running: flagged; its worker interrupts it. Finished: 409."""
    await begin_write(session)
    job = await get_job(session, job_id, kind=kind, for_update=True)
    status = JobStatus(job.status)
    if status.is_final:
        raise ConflictError(f"job {job_id} already {status.value}; it cannot be cancelled")
    if status is JobStatus.queued:
        job.status = JobStatus.cancelled.value
        job.finished_at = utcnow()
        await session.flush()
        await append_event(session, job.id, "job_cancelled", {"while": "queued"})
    elif not job.cancel_requested:
        job.cancel_requested = True
        await session.flush()
        await append_event(session, job.id, "cancel_requested", {})
    return job


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


def to_wire(job: JobRow) -> TrainingJob:
    result = None
    if job.status == JobStatus.succeeded.value:
        result = JobResult(
            start_step=job.start_step,
            final_step=job.final_step,
            checkpoint_path=job.checkpoint_path,
            metrics=job.metrics,
            recovered=job.recovered,
        )
    return TrainingJob(
        **job_fields(job),
        summary=TrajectorySummary.model_validate(job.summary),
        hyperparameters=job.hyperparameters,
        result=result,
    )
