"""The append-only event log of a job.

A job row counts its events (`last_event_seq`); whoever appends advances that counter in
the same statement that changes the job, and inserts the events with the numbers it got.
The counter's row lock (Postgres) orders concurrent writers of one job's history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from app.db import utcnow
from app.models import JobEventRow, JobRow
from app.schemas.jobs import JobEvent

Executor = AsyncConnection | AsyncSession
Event = tuple[str, dict[str, Any]]


_INSERT = insert(JobEventRow)  # built once: the workers insert events for every job


async def add_events(
    executor: Executor, job_id: str, last_seq: int, events: Sequence[Event]
) -> None:
    """Insert `events` as seqs `last_seq - len(events) + 1 .. last_seq`. On Postgres a
    trigger signals them to other processes when the transaction commits."""
    if not events:
        return
    now = utcnow()
    first = last_seq - len(events) + 1
    await executor.execute(
        _INSERT,
        [
            {"job_id": job_id, "seq": first + i, "type": type_, "data": data, "created_at": now}
            for i, (type_, data) in enumerate(events)
        ],
    )


async def append_event(
    executor: Executor, job_id: str, type: str, data: dict[str, Any] | None = None
) -> int:
    """Add one event inside the caller's transaction; returns its per-job sequence number."""
    seq = (
        await executor.execute(
            update(JobRow)
            .where(JobRow.id == job_id)
            .values(last_event_seq=JobRow.last_event_seq + 1)
            .returning(JobRow.last_event_seq)
        )
    ).scalar_one()
    await add_events(executor, job_id, seq, [(type, data or {})])
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
