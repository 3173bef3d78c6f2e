"""A Tinker training run's journal: every operation written when it is accepted (before the
SDK gets its request id) and again with its result (`tinker_operations`).

What it buys: a restart loses nothing accepted. A run that a new process does not hold is
made again from its registry model (base model and LoRA config: the same seeded start) by
doing its operations over in the order they were accepted; gradients summed before the
restart are summed again, AdamW's steps taken again, and an operation that was accepted but
not done is done then. A retrieve of a future this process never held is answered from the
row. A request the SDK sends again (the same `model_id`, kind and `seq_id`) finds its row and
is not done twice.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Table, bindparam, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db import begin_write, utcnow
from app.models import TinkerOperationRow
from app.schemas.models import TinkerStep
from app.tinker.futures import Result
from app.tinker.wire import WireError, read_output_metrics

Sessions = async_sessionmaker[AsyncSession]


@dataclass(frozen=True)
class Operation:
    """A journal row, as a replay or a retrieve reads it."""

    request_id: str
    model_id: str
    seq: int
    kind: str
    done: bool
    step: int | None
    path: str | None


async def accept(
    sessions: Sessions, *, request_id: str, model_name: str, model_id: str, kind: str, body: bytes
) -> bool:
    """Write the operation as accepted, next in its run's order. False: it was accepted
    before (the SDK sent it again). The caller holds the run's accepting lock, so the
    next `seq` is not taken meanwhile by this process. One statement: the run's next
    `seq` read in the insert itself, which inserts nothing where the id exists (where a
    read of the row, a read of the run's last `seq` and the ORM's insert took three)."""
    async with sessions() as session:
        # A writing transaction from the start (SQLite: BEGIN IMMEDIATE): begun as a
        # reader, a write failed at once with "database is locked" whenever another write
        # had committed since its read (`bench.tinker`'s optim_step, sent while
        # forward_backward's result was being written).
        await begin_write(session)
        dialect = (await session.connection()).dialect.name
        try:
            inserted = await session.scalar(
                _accept_statement(dialect),
                {
                    "request_id": request_id,
                    "model_name": model_name,
                    "model_id": model_id,
                    "kind": kind,
                    "body": body,
                    "created_at": utcnow(),
                },
            )
            await session.commit()
        except IntegrityError:  # its `seq` taken meanwhile by another process
            return False
    return inserted is not None


@functools.cache
def _accept_statement(dialect: str) -> Any:
    table = cast(Table, TinkerOperationRow.__table__)
    upsert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    columns = ("request_id", "model_name", "model_id", "kind", "body", "created_at")
    next_seq = (
        select(func.coalesce(func.max(table.c.seq), 0) + 1)
        .where(table.c.model_name == bindparam("model_name"))
        .scalar_subquery()
    )
    statement = upsert(table).values({**{c: bindparam(c) for c in columns}, "seq": next_seq})
    return statement.on_conflict_do_nothing(index_elements=[table.c.request_id]).returning(
        table.c.request_id
    )


async def finish(
    sessions: Sessions,
    request_id: str,
    result: Result,
    *,
    step: int | None = None,
    path: str | None = None,
) -> None:
    """Write the operation's result (once: a replay does not overwrite what was answered)."""
    if result.error is not None:
        kind, payload = "error", result.error.encode()
    elif result.proto is not None:
        kind, payload = "proto", result.proto
    else:
        kind, payload = "json", json.dumps(result.json).encode()
    async with sessions() as session:
        await session.execute(
            update(TinkerOperationRow)
            .where(
                TinkerOperationRow.request_id == request_id,
                TinkerOperationRow.done_at.is_(None),
            )
            .values(
                result_type=kind,
                result=payload,
                category=result.category if result.error is not None else None,
                step=step,
                path=path,
                done_at=utcnow(),
            )
        )
        await session.commit()


def _operation(row: Any) -> Operation:
    return Operation(
        row.request_id,
        row.model_id,
        row.seq,
        row.kind,
        row.done_at is not None,
        row.step,
        row.path,
    )


_COLUMNS = (
    TinkerOperationRow.request_id,
    TinkerOperationRow.model_id,
    TinkerOperationRow.seq,
    TinkerOperationRow.kind,
    TinkerOperationRow.done_at,
    TinkerOperationRow.step,
    TinkerOperationRow.path,
)


async def find(sessions: Sessions, request_id: str) -> Operation | None:
    async with sessions() as session:
        row = (
            await session.execute(
                select(*_COLUMNS).where(TinkerOperationRow.request_id == request_id)
            )
        ).one_or_none()
    return None if row is None else _operation(row)


async def result(sessions: Sessions, request_id: str) -> Result | None:
    """The stored result of a done operation; None while it is not done."""
    async with sessions() as session:
        row = (
            await session.execute(
                select(
                    TinkerOperationRow.result_type,
                    TinkerOperationRow.result,
                    TinkerOperationRow.category,
                ).where(TinkerOperationRow.request_id == request_id)
            )
        ).one_or_none()
    if row is None or row.result_type is None or row.result is None:
        return None
    if row.result_type == "error":
        return Result(error=row.result.decode(), category=row.category or "server")
    if row.result_type == "proto":
        return Result(proto=row.result)
    return Result(json=json.loads(row.result))


async def operations(sessions: Sessions, model_name: str) -> list[Operation]:
    """The run's operations in the order they were accepted (without their bodies)."""
    async with sessions() as session:
        rows = await session.execute(
            select(*_COLUMNS)
            .where(TinkerOperationRow.model_name == model_name)
            .order_by(TinkerOperationRow.seq)
        )
        return [_operation(row) for row in rows]


async def bodies(sessions: Sessions, ops: list[Operation]) -> AsyncIterator[bytes]:
    """Each operation's body, read one at a time (a long run's journal is not held whole)."""
    for op in ops:
        async with sessions() as session:
            body = await session.scalar(
                select(TinkerOperationRow.body).where(
                    TinkerOperationRow.request_id == op.request_id
                )
            )
        yield body or b""


async def saved(sessions: Sessions, path: str) -> tuple[str, int] | None:
    """The registry model and step of a save with this `tinker://` path (the newest)."""
    async with sessions() as session:
        row = (
            await session.execute(
                select(TinkerOperationRow.model_name, TinkerOperationRow.step)
                .where(TinkerOperationRow.path == path, TinkerOperationRow.step.is_not(None))
                .order_by(TinkerOperationRow.created_at.desc())
                .limit(1)
            )
        ).one_or_none()
    return None if row is None else (row.model_name, row.step)


async def steps(
    session: AsyncSession, model_name: str, *, after: int, limit: int
) -> tuple[list[TinkerStep], bool]:
    """The run's optimizer steps after step `after` (at most `limit`, and whether more
    follow), each with the loss of the `forward_backward` calls it applied: those done after
    the step before it, in the journal's order. Only done operations count: a step that
    failed (an error result) trained nothing and is no step; a `forward` computed no
    gradient. The database finds where step `after` and step `after + limit + 1` are (an
    index scan, no rows sent), so a page reads the small columns of its own operations alone
    (a dashboard asking for the steps after its last reads next to nothing); the results,
    `STEPS_READ` steps at a time."""
    done = (
        TinkerOperationRow.model_name == model_name,
        TinkerOperationRow.result_type.in_(("proto", "json")),
    )

    async def optim_seq(number: int) -> int | None:
        """The journal's seq of the run's `number`th step (from 1)."""
        found: int | None = await session.scalar(
            select(TinkerOperationRow.seq)
            .where(*done, TinkerOperationRow.kind == "optim_step")
            .order_by(TinkerOperationRow.seq)
            .offset(number - 1)
            .limit(1)
        )
        return found

    start = 0 if after == 0 else await optim_seq(after)
    if start is None:
        return [], False
    end = await optim_seq(after + limit + 1)
    query = select(
        TinkerOperationRow.seq, TinkerOperationRow.kind, TinkerOperationRow.done_at
    ).where(
        *done,
        TinkerOperationRow.kind.in_(("forward_backward", "optim_step")),
        TinkerOperationRow.seq > start,
    )
    if end is not None:
        query = query.where(TinkerOperationRow.seq < end)
    ops = (await session.execute(query.order_by(TinkerOperationRow.seq))).all()
    # Each step: its number, its optim_step's seq and time, the forward_backward seqs before it.
    page: list[tuple[int, int, Any, list[int]]] = []
    pending: list[int] = []
    for op in ops:
        if op.kind == "forward_backward":
            pending.append(op.seq)
        else:
            page.append((after + len(page) + 1, op.seq, op.done_at, pending))
            pending = []
    found: list[TinkerStep] = []
    for first in range(0, len(page), STEPS_READ):
        found += await _read_steps(session, model_name, page[first : first + STEPS_READ])
    return found, end is not None


# Steps whose results are read in one query: a forward_backward's result holds every token's
# logprob and loss, so a page is read a slice at a time, and parsed off the event loop.
STEPS_READ = 32


async def _read_steps(
    session: AsyncSession, model_name: str, page: list[tuple[int, int, Any, list[int]]]
) -> list[TinkerStep]:
    low = min([page[0][1], *page[0][3]])
    read = await session.execute(
        select(TinkerOperationRow.seq, TinkerOperationRow.result).where(
            TinkerOperationRow.model_name == model_name,
            TinkerOperationRow.seq.between(low, page[-1][1]),
            TinkerOperationRow.kind.in_(("forward_backward", "optim_step")),
        )
    )
    results: dict[int, bytes | None] = {row.seq: row.result for row in read}
    return await asyncio.to_thread(_steps_of, page, results)


def _steps_of(
    page: list[tuple[int, int, Any, list[int]]], results: dict[int, bytes | None]
) -> list[TinkerStep]:
    found = []
    for number, seq, done_at, backward in page:
        losses = [_loss(results.get(s)) for s in backward]
        known = [x for x in losses if x is not None]
        metrics = _optim_metrics(results.get(seq))
        found.append(
            TinkerStep(
                step=number,
                seq=seq,
                loss=sum(known) if known else None,
                forward_backward=len(backward),
                learning_rate=metrics.get("learning_rate"),
                metrics=metrics,
                created_at=done_at,
            )
        )
    return found


def _loss(result: bytes | None) -> float | None:
    try:
        return read_output_metrics(result or b"").get("loss:sum")
    except WireError:
        return None


def _optim_metrics(result: bytes | None) -> dict[str, float]:
    try:
        metrics = json.loads(result or b"{}").get("metrics") or {}
    except (ValueError, AttributeError):
        return {}
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
