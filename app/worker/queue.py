"""Claiming, leases and guarded writes: the database side of the workers.

Each function is one short transaction on a bare connection (this is the hot path; on
Postgres a claim and a final write are one statement each, see `statements`). A worker
that lost its lease (another worker recovered the job) finds that every guarded write
matches zero rows, and stops.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.backends.base import ModelSpec
from app.db import is_unavailable, json_dumps, utcnow, write_connection
from app.models import JobStatus
from app.services.events import Event, add_events
from app.worker import statements
from app.worker.statements import RUNNING, jobs, workers

log = logging.getLogger(__name__)
# How long a final write keeps trying while the database is away.
FINAL_WRITE_RETRY_SECONDS = 15.0
# Times a claim looks again after colliding with another worker's on the same model.
CLAIM_COLLISIONS = 8


@dataclass(frozen=True)
class Lease:
    job_id: str
    token: str
    owner: str
    model_name: str
    kind: str
    attempt: int


@dataclass(frozen=True)
class Claim:
    """A claimed job with all a worker needs to run it, read in the claiming transaction."""

    lease: Lease
    model: ModelSpec
    backend: str
    payload: bytes
    payload_bytes: int
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    max_attempts: int = 1
    # The model's step as recorded with the claim (None: not known; the worker reads the
    # backend's and records it before training). Recovery compares the backend against it.
    start_step: int | None = None


def _lease_params(lease: Lease) -> dict[str, Any]:
    return {"g_id": lease.job_id, "g_token": lease.token}


def backoff_seconds(attempt: int, base: float) -> float:
    """Exponential backoff with jitter: uniform in [c/2, c] where c = base * 2^(attempt-1)."""
    ceiling = base * 2 ** max(attempt - 1, 0)
    return random.uniform(ceiling / 2, ceiling)


def _write_params(
    lease: Lease,
    values: dict[str, Any],
    events: Sequence[Event],
    expired_before: datetime | None,
) -> tuple[tuple[str, ...], dict[str, Any]]:
    keys = tuple(sorted(values))
    params = {f"v_{key}": values[key] for key in keys}
    params |= _lease_params(lease) | {"g_events": len(events), "g_now": utcnow()}
    if expired_before is not None:
        params["g_expired_before"] = expired_before
    return keys, params


async def _write(
    conn: AsyncConnection,
    lease: Lease,
    values: dict[str, Any],
    events: Sequence[Event],
    *,
    expired_before: datetime | None = None,
    unless_cancel_requested: bool = False,
) -> int | None:
    """Guarded update of a running job that also numbers its new events; None if nothing
    matched (the lease is lost). `expired_before`: only while the lease is still expired."""
    keys, params = _write_params(lease, values, events, expired_before)
    statement = statements.job_update(keys, expired_before is not None, unless_cancel_requested)
    seq = (await conn.execute(statement, params)).scalar_one_or_none()
    if seq is not None:
        await add_events(conn, lease.job_id, seq, events)
    return seq


async def update_model(conn: AsyncConnection, name: str, values: dict[str, Any]) -> None:
    keys = tuple(sorted(values))
    await conn.execute(
        statements.model_update(keys), {"m_name": name} | {f"m_{key}": values[key] for key in keys}
    )


async def claim(
    engine: AsyncEngine, *, owner: str, lease_seconds: float, limit: int = 1
) -> list[Claim]:
    """Take up to `limit` of the oldest eligible queued jobs, at most one per model. Never
    two running jobs per model. Fewer than `limit`: no other job is eligible right now."""
    if engine.dialect.name == "postgresql":
        return await _claim_alone(engine, owner=owner, lease_seconds=lease_seconds, limit=limit)
    for _ in range(CLAIM_COLLISIONS):
        try:
            async with write_connection(engine) as conn:
                return await _claim_once(
                    conn, owner=owner, lease_seconds=lease_seconds, limit=limit
                )
        except IntegrityError:
            # Another worker started a job of the same model between our read and write
            # (the partial unique index refused ours); look again.
            continue
    return []


async def _claim_once(
    conn: AsyncConnection, *, owner: str, lease_seconds: float, limit: int
) -> list[Claim]:
    """SQLite: look and take inside the caller's BEGIN IMMEDIATE transaction."""
    now = utcnow()
    query = statements.claim_query()
    claims: list[Claim] = []
    while len(claims) < limit:
        wanted = limit - len(claims)
        rows = (await conn.execute(query, {"now": now, "page": wanted * 4})).all()
        picked: dict[str, Any] = {}
        for row in rows:
            picked.setdefault(row.model_name, row)
            if len(picked) == wanted:
                break
        for row in picked.values():
            claims.append(await _take(conn, row, owner=owner, now=now, lease_seconds=lease_seconds))
        if len(rows) < wanted * 4:
            break  # every eligible job was seen; fewer than `limit` means none is left
        # The page held several jobs of one model: look past them (the models just
        # claimed are busy now, so they drop out).
    return claims


async def _take(
    conn: AsyncConnection, row: Any, *, owner: str, now: datetime, lease_seconds: float
) -> Claim:
    token = secrets.token_hex(16)
    # Nothing trained the model since a worker last read its step from the backend (the
    # model row is locked with this claim): that step is where this job starts.
    start_step = row.current_step if row.step_known else None
    params = {
        "g_id": row.id,
        "v_token": token,
        "v_owner": owner,
        "v_expires": now + timedelta(seconds=lease_seconds),
        "v_now": now,
        "v_start_step": start_step,
    }
    job = (await conn.execute(statements.TAKE, params)).one()
    await add_events(
        conn,
        row.id,
        job.last_event_seq,
        [("job_claimed", {"worker": owner, "attempt": job.attempts})],
    )
    return _claim(row, job, token=token, owner=owner, start_step=start_step)


def _claim(row: Any, job: Any, *, token: str, owner: str, start_step: int | None) -> Claim:
    """`row`: the job's id, kind and model as the claim read them; `job`: the taken job."""
    return Claim(
        lease=Lease(row.id, token, owner, row.model_name, row.kind, job.attempts),
        model=ModelSpec(row.model_name, row.project, row.base_model, row.config),
        backend=row.backend,
        payload=job.payload,
        payload_bytes=job.payload_bytes,
        hyperparameters=job.hyperparameters,
        max_attempts=job.max_attempts,
        start_step=start_step,
    )


async def _claim_alone(
    engine: AsyncEngine, *, owner: str, lease_seconds: float, limit: int
) -> list[Claim]:
    """Postgres: each look is one statement (`statements.claim_statement`) outside a
    transaction, committed by itself, so what one look claimed stays claimed if a later
    look collides."""
    claims: list[Claim] = []
    collisions = 0
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        while len(claims) < limit:
            wanted = limit - len(claims)
            now = utcnow()
            params = {
                "now": now,
                "page": wanted * 4,
                "wanted": wanted,
                "v_secret": secrets.token_hex(16),
                "v_owner": owner,
                "v_expires": now + timedelta(seconds=lease_seconds),
            }
            try:
                rows = (await conn.execute(statements.claim_statement(), params)).all()
            except IntegrityError:
                collisions += 1  # as in `claim`: another worker, same model; look again
                if collisions == CLAIM_COLLISIONS:
                    break
                continue
            for row in sorted(rows, key=lambda r: (r.not_before, r.id)):
                claims.append(
                    _claim(row, row, token=row.lease_token, owner=owner, start_step=row.start_step)
                )
            if not rows or rows[0].candidates < wanted * 4:
                break  # every eligible job was seen (see `_claim_once`)
    return claims


@dataclass(frozen=True)
class Heartbeat:
    alive: bool  # False: the lease is gone, stop and discard the work
    cancel_requested: bool


async def heartbeat(
    engine: AsyncEngine,
    lease: Lease,
    *,
    lease_seconds: float,
    progress: tuple[int, int | None] | None = None,
    events: Sequence[Event] = (),
) -> Heartbeat:
    """Extend the lease, record progress and events, and learn whether cancel was asked."""
    params = _lease_params(lease) | {
        "v_expires": utcnow() + timedelta(seconds=lease_seconds),
        "g_events": len(events),
    }
    if progress is not None:
        params["v_step"], params["v_total"] = progress
    async with write_connection(engine) as conn:
        statement = statements.heartbeat(with_progress=progress is not None)
        row = (await conn.execute(statement, params)).one_or_none()
        if row is None:
            return Heartbeat(alive=False, cancel_requested=False)
        await add_events(conn, lease.job_id, row.last_event_seq, events)
        return Heartbeat(alive=True, cancel_requested=row.cancel_requested)


def started_event(lease: Lease, start_step: int, data: dict[str, Any]) -> Event:
    return ("training_started", {"start_step": start_step, "attempt": lease.attempt, **data})


async def record_start(
    engine: AsyncEngine, lease: Lease, *, start_step: int, data: dict[str, Any]
) -> bool:
    """Write the model's step, as the backend just reported it, before training: recovery
    compares against it. The model row learns it too, so later claims record it at once."""
    event = started_event(lease, start_step, data)
    async with write_connection(engine) as conn:
        if await _write(conn, lease, {"start_step": start_step}, [event]) is None:
            return False
        await update_model(conn, lease.model_name, {"current_step": start_step, "step_known": True})
        return True


async def finish(
    engine: AsyncEngine,
    lease: Lease,
    *,
    status: JobStatus,
    event: str,
    data: dict[str, Any],
    earlier_events: Sequence[Event] = (),
    model_update: dict[str, Any] | None = None,
    expired_before: datetime | None = None,
    unless_cancel_requested: bool = False,
    new_job: dict[str, Any] | None = None,
    **fields: Any,
) -> bool:
    """Final write of a job, guarded by the lease token. False: the lease was lost.

    `expired_before` (recovery): write only if the lease is still expired, i.e. its
    worker did not come back and renew it meanwhile.
    """
    values: dict[str, Any] = {
        "status": status.value,
        "lease_token": None,
        "lease_expires_at": None,
        **fields,
    }
    if status.is_final:
        values["finished_at"] = utcnow()
    # A database that is away for a moment (restart, failover, a busy SQLite file) must
    # not cost a finished job its result: try again for a while. Safe to repeat: once a
    # write committed, the lease token is gone and a repeat matches nothing.
    delay, deadline = 0.1, time.monotonic() + FINAL_WRITE_RETRY_SECONDS
    while True:
        try:
            return await _finish_once(
                engine,
                lease,
                values,
                [*earlier_events, (event, data)],
                model_update=model_update,
                expired_before=expired_before,
                unless_cancel_requested=unless_cancel_requested,
                new_job=new_job,
            )
        except Exception as exc:
            if not is_unavailable(exc) or time.monotonic() + delay > deadline:
                raise
            log.warning("job %s: final write failed (%s); retrying", lease.job_id, exc)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)


async def _finish_once(
    engine: AsyncEngine,
    lease: Lease,
    values: dict[str, Any],
    events: Sequence[Event],
    *,
    model_update: dict[str, Any] | None,
    expired_before: datetime | None,
    unless_cancel_requested: bool,
    new_job: dict[str, Any] | None,
) -> bool:
    if new_job is None and engine.dialect.name == "postgresql":
        # One statement outside a transaction, so it commits by itself: one round trip
        # where BEGIN, three statements and COMMIT took five.
        keys, params = _write_params(lease, values, events, expired_before)
        model_values = model_update or {}
        model_keys = tuple(sorted(model_values))
        statement = statements.write_in_one(
            keys, expired_before is not None, unless_cancel_requested, model_keys
        )
        params |= {f"m_{key}": model_values[key] for key in model_keys}
        params |= {
            "m_name": lease.model_name,
            "e_types": [type_ for type_, _ in events],
            "e_data": [json_dumps(data) for _, data in events],
        }
        async with engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            return (await conn.execute(statement, params)).scalar_one_or_none() is not None
    async with write_connection(engine) as conn:
        written = await _write(
            conn,
            lease,
            values,
            events,
            expired_before=expired_before,
            unless_cancel_requested=unless_cancel_requested,
        )
        if written is None:
            return False
        if new_job is not None:  # a job this one enqueues, in the same transaction
            await conn.execute(insert(jobs).values(**new_job, last_event_seq=1))
            await add_events(conn, new_job["id"], 1, [("job_queued", {"after": lease.job_id})])
        if model_update:
            await update_model(conn, lease.model_name, model_update)
        return True


async def retry_or_fail(
    engine: AsyncEngine,
    lease: Lease,
    *,
    error: dict[str, Any],
    max_attempts: int,
    retry_base_seconds: float,
    expired_before: datetime | None = None,
    earlier_events: Sequence[Event] = (),
) -> JobStatus | None:
    """Queue the job again after a backoff, or fail it once its attempts are spent.

    Returns the status written, or None when the lease was lost.
    """
    if lease.attempt >= max_attempts:
        failed = await finish(
            engine,
            lease,
            status=JobStatus.failed,
            event="training_failed",
            data={"error": error, "attempt": lease.attempt},
            error=error,
            expired_before=expired_before,
            earlier_events=earlier_events,
        )
        return JobStatus.failed if failed else None
    delay = backoff_seconds(lease.attempt, retry_base_seconds)
    queued = await finish(
        engine,
        lease,
        status=JobStatus.queued,
        event="job_retrying",
        data={"error": error, "attempt": lease.attempt, "delay_s": round(delay, 3)},
        error=error,
        not_before=utcnow() + timedelta(seconds=delay),
        lease_owner=None,
        expired_before=expired_before,
        unless_cancel_requested=True,
        earlier_events=earlier_events,
    )
    if queued:
        return JobStatus.queued
    # Not queued again: the lease is gone, or someone asked to cancel meanwhile.
    cancelled = await finish(
        engine,
        lease,
        status=JobStatus.cancelled,
        event="job_cancelled",
        data={"while": "retrying", "error": error},
        error=error,
        expired_before=expired_before,
        earlier_events=earlier_events,
    )
    return JobStatus.cancelled if cancelled else None


@dataclass(frozen=True)
class Expired:
    lease: Lease
    start_step: int | None
    cancel_requested: bool
    max_attempts: int


async def expired_leases(
    engine: AsyncEngine, *, now: datetime | None = None, limit: int = 20
) -> list[Expired]:
    """Running jobs whose worker stopped renewing its lease."""
    now = now or utcnow()
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(
                    jobs.c.id,
                    jobs.c.lease_token,
                    jobs.c.lease_owner,
                    jobs.c.model_name,
                    jobs.c.kind,
                    jobs.c.attempts,
                    jobs.c.start_step,
                    jobs.c.cancel_requested,
                    jobs.c.max_attempts,
                )
                .where(jobs.c.status == RUNNING, jobs.c.lease_expires_at < now)
                .order_by(jobs.c.lease_expires_at)
                .limit(limit)
            )
        ).all()
    return [
        Expired(
            Lease(r.id, r.lease_token or "", r.lease_owner or "", r.model_name, r.kind, r.attempts),
            r.start_step,
            r.cancel_requested,
            r.max_attempts,
        )
        for r in rows
    ]


async def beat_worker(
    engine: AsyncEngine, *, worker_id: str, hostname: str, pid: int, stopped: bool = False
) -> None:
    now = utcnow()
    values: dict[str, Any] = {"heartbeat_at": now}
    if stopped:
        values["stopped_at"] = now
    async with write_connection(engine) as conn:
        result = await conn.execute(
            update(workers).where(workers.c.id == worker_id).values(**values)
        )
        if result.rowcount == 0:
            await conn.execute(
                insert(workers).values(
                    id=worker_id, hostname=hostname, pid=pid, started_at=now, **values
                )
            )
