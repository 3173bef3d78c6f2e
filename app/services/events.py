"""The append-only event log of a job."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app import notify
from app.models import JobEventRow, JobRow
from app.schemas.jobs import JobEvent


async def append_event(
    session: AsyncSession, job_id: str, type: str, data: dict[str, Any] | None = None
) -> int:
    """Add an event inside the caller's transaction; returns its per-job sequence number."""
    # Incrementing the counter row-locks the job (Postgres), so concurrent writers of the
    # same job's history queue up instead of colliding on (job_id, seq).
    seq = (
        await session.execute(
            update(JobRow)
            .where(JobRow.id == job_id)
            .values(last_event_seq=JobRow.last_event_seq + 1)
            .returning(JobRow.last_event_seq)
        )
    ).scalar_one()
    session.add(JobEventRow(job_id=job_id, seq=seq, type=type, data=data or {}))
    await notify.send(session, notify.EVENTS_CHANNEL, job_id)
    return seq


async def list_events(
    session: AsyncSession, job_id: str, *, after: int = 0, limit: int = 100
) -> tuple[list[JobEvent], bool]:
    rows = (
        await session.scalars(
            select(JobEventRow)
            .where(JobEventRow.job_id == job_id, JobEventRow.seq > after)
            .order_by(JobEventRow.seq)
            .limit(limit + 1)
        )
    ).all()
    events = [
        JobEvent(seq=r.seq, type=r.type, created_at=r.created_at, data=r.data) for r in rows[:limit]
    ]
    return events, len(rows) > limit
