"""The workers' hot statements, built once per shape with bound parameters: SQLAlchemy then
reuses their cache keys and compiled SQL instead of rebuilding both for every job (building
and cache-keying an UPDATE cost ~0.6 ms).

Core tables, not ORM entities: these run per job and the ORM layer costs CPU here. On
Postgres a claim and a final write are each one statement (data-modifying CTEs) that the
worker runs outside a transaction, so it commits by itself: one round trip each.
"""

from __future__ import annotations

import functools
from typing import Any, cast

from sqlalchemy import (
    Integer,
    String,
    Table,
    Text,
    and_,
    bindparam,
    case,
    exists,
    func,
    insert,
    literal,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, distinct_on

from app.models import JobEventRow, JobRow, JobStatus, ModelRow, WorkerRow

RUNNING = JobStatus.running.value
QUEUED = JobStatus.queued.value
jobs = cast(Table, JobRow.__table__)
models = cast(Table, ModelRow.__table__)
workers = cast(Table, WorkerRow.__table__)
job_events = cast(Table, JobEventRow.__table__)
_running = jobs.alias("running")
_busy_models = select(_running.c.model_name).where(_running.c.status == RUNNING)


def guarded(*extra: Any) -> Any:
    """The lease's job, still running under the same token."""
    return and_(
        jobs.c.id == bindparam("g_id"),
        jobs.c.lease_token == bindparam("g_token"),
        jobs.c.status == RUNNING,
        *extra,
    )


@functools.cache
def job_update(keys: tuple[str, ...], expired_before: bool, unless_cancel: bool) -> Any:
    """Set `v_<key>` on the lease's job and count `g_events` new events, returning the new
    counter (and the id, for `write_in_one`); matches nothing once the lease is lost.
    `expired_before`: only while the lease is expired; `unless_cancel`: only if no cancel
    was asked."""
    extra = []
    if expired_before:
        extra.append(jobs.c.lease_expires_at < bindparam("g_expired_before"))
    if unless_cancel:
        extra.append(jobs.c.cancel_requested.is_(False))
    values: dict[Any, Any] = {key: bindparam(f"v_{key}") for key in keys}
    values |= {
        "last_event_seq": jobs.c.last_event_seq + bindparam("g_events"),
        "updated_at": bindparam("g_now"),
    }
    return (
        update(jobs)
        .where(guarded(*extra))
        .values(values)
        .returning(jobs.c.last_event_seq, jobs.c.id)
    )


@functools.cache
def model_update(keys: tuple[str, ...]) -> Any:
    return (
        update(models)
        .where(models.c.name == bindparam("m_name"))
        .values({key: bindparam(f"m_{key}") for key in keys})
    )


@functools.cache
def claim_query(postgres: bool = False) -> Any:
    """A page of the oldest eligible queued jobs (due, their model not busy) with their
    models, oldest first."""
    query = (
        select(
            jobs.c.id,
            jobs.c.model_name,
            jobs.c.kind,
            jobs.c.not_before,
            models.c.project,
            models.c.base_model,
            models.c.backend,
            models.c.config,
            models.c.current_step,
            models.c.step_known,
        )
        .join(models, models.c.name == jobs.c.model_name)
        .where(
            jobs.c.status == QUEUED,
            jobs.c.not_before <= bindparam("now"),
            jobs.c.model_name.not_in(_busy_models),
        )
        .order_by(jobs.c.not_before, jobs.c.id)
        .limit(bindparam("page"))
    )
    if postgres:
        # Locking the model row too makes a concurrent claimer skip every job of a model
        # that is being claimed right now, instead of colliding on the unique index.
        query = query.with_for_update(skip_locked=True, of=(jobs, models))
    return query


TAKE = (
    update(jobs)
    .where(jobs.c.id == bindparam("g_id"), jobs.c.status == QUEUED)
    .values(
        status=RUNNING,
        lease_token=bindparam("v_token"),
        lease_owner=bindparam("v_owner"),
        lease_expires_at=bindparam("v_expires"),
        attempts=jobs.c.attempts + 1,
        started_at=bindparam("v_now"),
        progress_step=0,
        progress_total=None,
        start_step=bindparam("v_start_step"),
        last_event_seq=jobs.c.last_event_seq + 1,
    )
    .returning(
        jobs.c.attempts,
        jobs.c.last_event_seq,
        jobs.c.payload,
        jobs.c.payload_bytes,
        jobs.c.hyperparameters,
        jobs.c.max_attempts,
    )
)


@functools.cache
def heartbeat(*, with_progress: bool) -> Any:
    values: dict[str, Any] = {
        "lease_expires_at": bindparam("v_expires"),
        "last_event_seq": jobs.c.last_event_seq + bindparam("g_events"),
    }
    if with_progress:
        values |= {"progress_step": bindparam("v_step"), "progress_total": bindparam("v_total")}
    return (
        update(jobs)
        .where(guarded())
        .values(values)
        .returning(jobs.c.cancel_requested, jobs.c.last_event_seq)
    )


@functools.cache
def write_in_one(
    keys: tuple[str, ...],
    expired_before: bool,
    unless_cancel: bool,
    model_keys: tuple[str, ...],
) -> Any:
    """Postgres: `queue._write` and `queue.update_model` as one statement (data-modifying CTEs). The
    events come as two arrays and are numbered from the counter the job update returned;
    the model is updated only if the job update matched."""
    job = job_update(keys, expired_before, unless_cancel).cte("job")
    event = (
        func.unnest(bindparam("e_types", type_=ARRAY(Text)), bindparam("e_data", type_=ARRAY(Text)))
        .table_valued("type", "data", with_ordinality="ord")
        .render_derived()
        .alias("event")
    )
    numbered = select(
        job.c.id,
        job.c.last_event_seq - bindparam("g_events", type_=Integer) + event.c.ord,
        event.c.type,
        event.c.data.cast(JSONB),
        func.clock_timestamp(),  # see `claim_statement`
    ).select_from(job.join(event, true()))
    statement = select(job.c.last_event_seq).add_cte(
        insert(job_events)
        .from_select(["job_id", "seq", "type", "data", "created_at"], numbered)
        .cte("events")
    )
    if model_keys:
        matched = exists(select(job.c.id))
        statement = statement.add_cte(model_update(model_keys).where(matched).cte("model"))
    return statement


@functools.cache
def claim_statement() -> Any:
    """Postgres: `queue._claim_once`'s look, `TAKE` and the claim events as one statement.

    The oldest eligible jobs are locked with their models (SKIP LOCKED: rows another
    claimer holds are passed over), the oldest job of each model is taken, up to
    `wanted`, each with its own lease token (md5 of a per-statement secret and the id),
    and each gets its `job_claimed` event. `candidates` tells whether the page was full.
    """
    candidate = claim_query(postgres=True).cte("candidate")
    first = (
        select(candidate)
        .ext(distinct_on(candidate.c.model_name))
        .order_by(candidate.c.model_name, candidate.c.not_before, candidate.c.id)
        .cte("first")
    )
    picked = (
        select(first).order_by(first.c.not_before, first.c.id).limit(bindparam("wanted"))
    ).cte("picked")
    owner = bindparam("v_owner", type_=String)
    # The database's clock, read while the statement runs (not the worker's, read before
    # sending it): a claim that saw the model's previous job end is stamped after that
    # job's last event, so the event log orders them as the database did.
    now = func.clock_timestamp()
    taken = (
        update(jobs)
        .where(jobs.c.id == picked.c.id, jobs.c.status == QUEUED)
        .values(
            status=RUNNING,
            lease_token=func.md5(bindparam("v_secret", type_=String) + jobs.c.id),
            lease_owner=owner,
            lease_expires_at=bindparam("v_expires"),
            attempts=jobs.c.attempts + 1,
            started_at=now,
            progress_step=0,
            progress_total=None,
            start_step=case((picked.c.step_known, picked.c.current_step)),
            last_event_seq=jobs.c.last_event_seq + 1,
        )
        .returning(
            jobs.c.id,
            jobs.c.model_name,
            jobs.c.kind,
            jobs.c.not_before,
            jobs.c.lease_token,
            jobs.c.attempts,
            jobs.c.last_event_seq,
            jobs.c.start_step,
            jobs.c.payload,
            jobs.c.payload_bytes,
            jobs.c.hyperparameters,
            jobs.c.max_attempts,
            picked.c.project,
            picked.c.base_model,
            picked.c.backend,
            picked.c.config,
        )
        .cte("taken")
    )
    claimed_event = func.jsonb_build_object("worker", owner, "attempt", taken.c.attempts)
    events = insert(job_events).from_select(
        ["job_id", "seq", "type", "data", "created_at"],
        select(
            taken.c.id,
            taken.c.last_event_seq,
            literal("job_claimed", String),
            claimed_event,
            now,
        ),
    )
    candidates = select(func.count()).select_from(candidate).scalar_subquery()
    return select(taken, candidates.label("candidates")).add_cte(events.cte("claimed"))
