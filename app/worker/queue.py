"""Claiming, leases and guarded writes: the database side of the workers.

Each function is one short transaction. A worker that lost its lease (another worker
recovered the job) finds that every guarded write matches zero rows, and stops.
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import aliased

from app.db import transaction, utcnow
from app.models import JobRow, JobStatus, ModelRow, WorkerRow
from app.services.events import append_event

RUNNING = JobStatus.running.value


@dataclass(frozen=True)
class Lease:
    job_id: str
    token: str
    owner: str
    model_name: str
    kind: str
    attempt: int


def _guard(lease: Lease) -> Any:
    return and_(JobRow.id == lease.job_id, JobRow.lease_token == lease.token)


def backoff_seconds(attempt: int, base: float) -> float:
    """Exponential backoff with full jitter: uniform in [base·2^(n-1)/2, base·2^(n-1)]."""
    ceiling = base * 2 ** max(attempt - 1, 0)
    return random.uniform(ceiling / 2, ceiling)


async def claim(
    sessions: async_sessionmaker[AsyncSession], *, owner: str, lease_seconds: float
) -> Lease | None:
    """Take the oldest eligible queued job, or None. Never two running jobs per model."""
    for _ in range(8):
        try:
            async with transaction(sessions) as session:
                return await _claim_once(session, owner=owner, lease_seconds=lease_seconds)
        except IntegrityError:
            # Another worker started a job of the same model between our read and write
            # (the partial unique index refused ours); look again.
            continue
    return None


async def _claim_once(session: AsyncSession, *, owner: str, lease_seconds: float) -> Lease | None:
    now = utcnow()
    running = aliased(JobRow)
    busy_models = select(running.model_name).where(running.status == RUNNING)
    query = (
        select(JobRow.id, JobRow.model_name, JobRow.kind)
        .where(
            JobRow.status == JobStatus.queued.value,
            JobRow.not_before <= now,
            JobRow.model_name.not_in(busy_models),
        )
        .order_by(JobRow.not_before, JobRow.id)
        .limit(1)
    )
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True, of=JobRow)
    row = (await session.execute(query)).first()
    if row is None:
        return None
    token = secrets.token_hex(16)
    attempt = (
        await session.execute(
            update(JobRow)
            .where(JobRow.id == row.id, JobRow.status == JobStatus.queued.value)
            .values(
                status=RUNNING,
                lease_token=token,
                lease_owner=owner,
                lease_expires_at=now + timedelta(seconds=lease_seconds),
                attempts=JobRow.attempts + 1,
                started_at=now,
                progress_step=0,
                progress_total=None,
            )
            .returning(JobRow.attempts)
        )
    ).scalar_one()
    await append_event(session, row.id, "job_claimed", {"worker": owner, "attempt": attempt})
    return Lease(row.id, token, owner, row.model_name, row.kind, attempt)


@dataclass(frozen=True)
class Heartbeat:
    alive: bool  # False: the lease is gone, stop and discard the work
    cancel_requested: bool


async def heartbeat(
    sessions: async_sessionmaker[AsyncSession],
    lease: Lease,
    *,
    lease_seconds: float,
    progress: tuple[int, int | None] | None = None,
    events: list[tuple[str, dict[str, Any]]] | None = None,
) -> Heartbeat:
    """Extend the lease, record progress and events, and learn whether cancel was asked."""
    values: dict[str, Any] = {"lease_expires_at": utcnow() + timedelta(seconds=lease_seconds)}
    if progress is not None:
        values["progress_step"], values["progress_total"] = progress
    async with transaction(sessions) as session:
        cancel = (
            await session.execute(
                update(JobRow)
                .where(_guard(lease), JobRow.status == RUNNING)
                .values(**values)
                .returning(JobRow.cancel_requested)
            )
        ).scalar_one_or_none()
        if cancel is None:
            return Heartbeat(alive=False, cancel_requested=False)
        for type_, data in events or ():
            await append_event(session, lease.job_id, type_, data)
        return Heartbeat(alive=True, cancel_requested=cancel)


async def record_start(
    sessions: async_sessionmaker[AsyncSession],
    lease: Lease,
    *,
    start_step: int,
    data: dict[str, Any],
) -> bool:
    """Write the model's step before training: recovery compares against it."""
    async with transaction(sessions) as session:
        result = await session.execute(
            update(JobRow)
            .where(_guard(lease), JobRow.status == RUNNING)
            .values(start_step=start_step)
        )
        if result.rowcount == 0:  # type: ignore[attr-defined]
            return False
        await append_event(
            session,
            lease.job_id,
            "training_started",
            {"start_step": start_step, "attempt": lease.attempt, **data},
        )
        return True


async def finish(
    sessions: async_sessionmaker[AsyncSession],
    lease: Lease,
    *,
    status: JobStatus,
    event: str,
    data: dict[str, Any],
    model_update: dict[str, Any] | None = None,
    expired_before: datetime | None = None,
    **fields: Any,
) -> bool:
    """Final write of a job, guarded by the lease token. False: the lease was lost.

    `expired_before` (recovery): write only if the lease is still expired, i.e. its
    worker did not come back and renew it meanwhile.
    """
    async with transaction(sessions) as session:
        values: dict[str, Any] = {
            "status": status.value,
            "lease_token": None,
            "lease_expires_at": None,
            **fields,
        }
        if status.is_final:
            values["finished_at"] = utcnow()
        guard = and_(_guard(lease), JobRow.status == RUNNING)
        if expired_before is not None:
            guard = and_(guard, JobRow.lease_expires_at < expired_before)
        result = await session.execute(update(JobRow).where(guard).values(**values))
        if result.rowcount == 0:  # type: ignore[attr-defined]
            return False
        await append_event(session, lease.job_id, event, data)
        if model_update:
            await session.execute(
                update(ModelRow).where(ModelRow.name == lease.model_name).values(**model_update)
            )
        return True


async def retry_or_fail(
    sessions: async_sessionmaker[AsyncSession],
    lease: Lease,
    *,
    error: dict[str, Any],
    max_attempts: int,
    retry_base_seconds: float,
    expired_before: datetime | None = None,
) -> JobStatus | None:
    """Queue the job again after a backoff, or fail it once its attempts are spent.

    Returns the status written, or None when the lease was lost.
    """
    if lease.attempt >= max_attempts:
        failed = await finish(
            sessions,
            lease,
            status=JobStatus.failed,
            event="training_failed",
            data={"error": error, "attempt": lease.attempt},
            error=error,
            expired_before=expired_before,
        )
        return JobStatus.failed if failed else None
    delay = backoff_seconds(lease.attempt, retry_base_seconds)
    queued = await finish(
        sessions,
        lease,
        status=JobStatus.queued,
        event="job_retrying",
        data={"error": error, "attempt": lease.attempt, "delay_s": round(delay, 3)},
        error=error,
        not_before=utcnow() + timedelta(seconds=delay),
        lease_owner=None,
        expired_before=expired_before,
    )
    return JobStatus.queued if queued else None


@dataclass(frozen=True)
class Expired:
    lease: Lease
    start_step: int | None
    cancel_requested: bool
    max_attempts: int


async def expired_leases(
    sessions: async_sessionmaker[AsyncSession], *, now: datetime | None = None, limit: int = 20
) -> list[Expired]:
    """Running jobs whose worker stopped renewing its lease."""
    now = now or utcnow()
    async with transaction(sessions) as session:
        rows = (
            await session.scalars(
                select(JobRow)
                .where(JobRow.status == RUNNING, JobRow.lease_expires_at < now)
                .order_by(JobRow.lease_expires_at)
                .limit(limit)
            )
        ).all()
        return [
            Expired(
                Lease(
                    r.id, r.lease_token or "", r.lease_owner or "", r.model_name, r.kind, r.attempts
                ),
                r.start_step,
                r.cancel_requested,
                r.max_attempts,
            )
            for r in rows
        ]


async def beat_worker(
    sessions: async_sessionmaker[AsyncSession],
    *,
    worker_id: str,
    hostname: str,
    pid: int,
    stopped: bool = False,
) -> None:
    async with transaction(sessions) as session:
        row = await session.get(WorkerRow, worker_id)
        now = utcnow()
        if row is None:
            session.add(
                WorkerRow(
                    id=worker_id, hostname=hostname, pid=pid, started_at=now, heartbeat_at=now
                )
            )
        else:
            row.heartbeat_at = now
        if stopped and row is not None:
            row.stopped_at = now
