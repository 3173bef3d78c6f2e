"""The database side of a run's lifecycle: the only code that writes a run's status, its
state or its events, and its children's cancellation.

A run's driver decides (`app.runs.schedule`), `app.jobs.lifecycle.plan_run` turns the
decision into a `RunWrite`, and `apply_move` writes it in one transaction guarded twice:
by the run's `version` (two drivers that decide at once cannot both write: the second
matches no row and decides again) and by what the driver saw of the run's job row
(a cancel that came since is not overwritten); `write_move` writes it in a transaction
already open (a child's final write, `app.runs.driver.JoinedMove`). Routes pause and
resume through `apply_pause`, inside their own transaction, under the same version.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from sqlalchemy import Table, Update, bindparam, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from app.db import write_connection
from app.jobs.events import add_events_of, append_event
from app.jobs.lifecycle import Event, RunWrite
from app.jobs.statements import jobs, models
from app.jobs.store import cancel_job_now, enqueue_new, queued_event
from app.models import RunMetricRow, RunRow

runs = cast(Table, RunRow.__table__)
run_metrics = cast(Table, RunMetricRow.__table__)


async def apply_move(
    engine: AsyncEngine,
    run_id: str,
    *,
    version: int,
    seen: tuple[str, bool],
    write: RunWrite,
    then: Callable[[AsyncConnection], Awaitable[None]] | None = None,
) -> bool:
    """Write `write`, planned from the run at `version` whose job row said `seen` (status,
    cancel requested); False, and nothing written, if either has changed since. `then`
    runs last in the same transaction (a worker claims the children just queued: one
    transaction where a separate claim took a second)."""
    async with write_connection(engine) as conn:
        if not await write_move(conn, run_id, version=version, seen=seen, write=write):
            await conn.rollback()
            return False
        if then is not None:
            await then(conn)
    return True


async def lock_run(conn: AsyncConnection, run_id: str) -> tuple[str, bool] | None:
    """Lock the run's job row (`FOR UPDATE`; SQLite's transaction holds the file) and
    return what it says: status, cancel requested. The routes that change a run (cancel,
    pause) and every move lock it before the run's row and its children's, so none of
    them waits on another in a cycle."""
    row = (
        await conn.execute(
            select(jobs.c.status, jobs.c.cancel_requested)
            .where(jobs.c.id == run_id)
            .with_for_update()
        )
    ).one_or_none()
    return None if row is None else (row.status, row.cancel_requested)


async def write_move(
    conn: AsyncConnection,
    run_id: str,
    *,
    version: int,
    seen: tuple[str, bool] | None,
    write: RunWrite,
) -> bool:
    """`apply_move` in the caller's write transaction; False where the run changed since
    (the caller rolls back what it wrote). `seen` None: the caller locked the run's job
    row (`lock_run`) before it read the run, in this transaction."""
    if seen is not None and await lock_run(conn, run_id) != seen:
        return False
    state = dict(write.run.get("state") or {})
    seq = int(state.get("metric_seq") or 0)
    values = {
        **write.run,
        "state": {**state, "metric_seq": seq + len(write.metrics)},
        "updated_at": write.job.get("updated_at"),
    }
    params = {f"r_{key}": value for key, value in values.items()}
    moved = await conn.execute(
        _run_update(tuple(values)), params | {"r_id": run_id, "r_version": version}
    )
    if moved.rowcount != 1:
        return False
    # A decision taken again finds its children made: each insert makes none of an id
    # that exists. Their events go in with the run's, in one insert.
    events: list[tuple[str, int, Sequence[Event]]] = [
        queued_event(child) for child in write.children if await enqueue_new(conn, child)
    ]
    for target in write.cancel:
        await cancel_job_now(conn, target)
    if write.metrics:
        rows = [
            {
                "run_id": run_id,
                "seq": seq + offset,
                "kind": metric.kind,
                "step": metric.step,
                "data": metric.data,
                "created_at": write.job.get("updated_at"),
            }
            for offset, metric in enumerate(write.metrics, start=1)
        ]
        await conn.execute(_INSERT_METRICS, rows)
    # The run's job row and its events in one statement: the events take the numbers it
    # returns.
    columns = _columns(write)
    params = {f"j_{key}": value for key, value in columns.items()}
    row = _run_job_update(tuple(columns), bool(write.events))
    params |= {"j_id": run_id, "j_events": len(write.events)}
    if write.events:
        seq = await conn.scalar(row, params)
        events.append((run_id, int(seq), write.events))
    else:
        await conn.execute(row, params)
    await add_events_of(conn, events)
    return True


# A move's statements, built once for each set of columns it writes: a statement built
# for every move cost SQLAlchemy ~0.3 ms more each to build and key for its cache
# (`bench/README.md`, "A run's move in statements built once").
_INSERT_METRICS = insert(run_metrics)


@functools.cache
def _run_update(keys: tuple[str, ...]) -> Update:
    """The run's `runs` row at version `r_version` set to `r_<key>` for each key, and its
    version moved on; matches nothing where another move wrote first."""
    return (
        update(runs)
        .where(runs.c.id == bindparam("r_id"), runs.c.version == bindparam("r_version"))
        .values({key: bindparam(f"r_{key}") for key in keys})
        .values(version=runs.c.version + 1)
    )


@functools.cache
def _run_job_update(keys: tuple[str, ...], events: bool) -> Update:
    """The run's job row set to `j_<key>` for each key; with `events`, its event counter
    moved on by `j_events` and returned."""
    statement = (
        update(jobs)
        .where(jobs.c.id == bindparam("j_id"))
        .values({key: bindparam(f"j_{key}") for key in keys})
    )
    if events:
        statement = statement.values(
            last_event_seq=jobs.c.last_event_seq + bindparam("j_events")
        ).returning(jobs.c.last_event_seq)
    return statement


async def apply_pause(session: AsyncSession, run: RunRow, write: RunWrite) -> None:
    """Pause or resume, in the caller's write transaction, which holds the run's job row
    and `runs` row locked (`FOR UPDATE`)."""
    for key, value in write.run.items():
        setattr(run, key, value)
    run.version += 1
    await session.flush()
    for event in write.events:
        await append_event(session, run.id, event)


def _columns(write: RunWrite) -> dict[str, Any]:
    return {key: getattr(value, "value", value) for key, value in write.job.items()}


async def model_step(conn: AsyncConnection, model: str) -> int:
    """The model's step as recorded: where a run that starts now starts from."""
    step = await conn.scalar(select(models.c.current_step).where(models.c.name == model))
    return int(step or 0)
