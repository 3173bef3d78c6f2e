"""The append-only event log of a job.

A job row counts its events (`last_event_seq`); whoever appends advances that counter in
the same statement that changes the job, and inserts the events with the numbers it got.
The counter's row lock (Postgres) orders concurrent writers of one job's history.

Which clock stamps an event, on every path: on Postgres the database's
(`clock_timestamp()`, read while the inserting statement runs), so the log orders events
as the database serialized their writes, whichever process or host wrote them; on SQLite
the writing process's, read inside its write transaction (one process writes at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import ColumnElement, Insert, Table, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from app.db import utcnow
from app.jobs import outbox
from app.jobs.lifecycle import Event, EventType
from app.models import JobEventRow, JobRow
from app.schemas.jobs import JobEvent

Executor = AsyncConnection | AsyncSession
job_events = cast(Table, JobEventRow.__table__)
jobs = cast(Table, JobRow.__table__)


def database_clock() -> ColumnElement[Any]:
    """Postgres: the time the statement reads it (not the transaction's start)."""
    return func.clock_timestamp()


@dataclass(frozen=True)
class _EventInsert:
    """How a dialect stamps the events it inserts: Postgres by the database's clock, in
    the statement; SQLite (one writer) by the writer's, in the rows."""

    statement: Insert
    writer_stamps: bool


# Built once: the workers insert events for every job.
_INSERT = {
    "postgresql": _EventInsert(insert(job_events).values(created_at=database_clock()), False),
    "sqlite": _EventInsert(insert(job_events), True),
}


def _dialect(executor: Executor) -> str:
    if isinstance(executor, AsyncConnection):
        return executor.dialect.name
    return executor.get_bind().dialect.name


async def add_events(
    executor: Executor, job_id: str, last_seq: int, events: Sequence[Event]
) -> None:
    """Insert `events` as seqs `last_seq - len(events) + 1 .. last_seq`, and the webhook
    deliveries of those that are webhook events (`app.jobs.outbox`), in the caller's
    transaction. On Postgres a trigger signals them to other processes when it commits."""
    await add_events_of(executor, [(job_id, last_seq, events)])


async def add_events_of(
    executor: Executor, batches: Sequence[tuple[str, int, Sequence[Event]]]
) -> None:
    """`add_events` for several jobs, each `(job_id, last_seq, events)`, in one insert."""
    rows: list[dict[str, Any]] = []
    reported: list[tuple[str, int, tuple[str | None, str | None]]] = []
    for job_id, last_seq, events in batches:
        first = last_seq - len(events) + 1
        for i, (type_, data) in enumerate(events):
            rows.append({"job_id": job_id, "seq": first + i, "type": type_.value, "data": data})
            pair = outbox.reported(type_)
            if pair is not None:
                reported.append((job_id, first + i, pair))
    if not rows:
        return
    how = _INSERT.get(_dialect(executor), _INSERT["sqlite"])
    if how.writer_stamps:
        now = utcnow()
        for row in rows:
            row["created_at"] = now
    await executor.execute(how.statement, rows)
    for job_id, seq, pair in reported:
        await executor.execute(outbox.fan_out(), outbox.fan_out_params(job_id, seq, pair, utcnow()))


async def append_event(executor: Executor, job_id: str, event: Event) -> int:
    """Add one event inside the caller's transaction; returns its per-job sequence number."""
    seq = (
        await executor.execute(
            update(jobs)
            .where(jobs.c.id == job_id)
            .values(last_event_seq=jobs.c.last_event_seq + 1)
            .returning(jobs.c.last_event_seq)
        )
    ).scalar_one()
    await add_events(executor, job_id, seq, [event])
    return int(seq)


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
        JobEvent(seq=r.seq, type=EventType(r.type), created_at=r.created_at, data=r.data)
        for r in rows[:limit]
    ]
    return events, len(rows) > limit
