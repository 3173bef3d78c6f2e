"""One training writer per model: a run owns its model while it is active.

A run's baseline, its rollouts and its best checkpoint must come from its own updates, so
at most one run is active (queued, running or paused) per model, and no training job of
anyone else starts on that model meanwhile. Both are refused at submission with 409 and
the id of what holds the model; the caller submits again once it has ended (the run's
`GET` says when). Sampling without training (plain rollouts, the gateway) is untouched.

The check and the insert it guards are one write transaction, with the model's row locked
on Postgres (SQLite's writes are one at a time already), so two submissions cannot both
pass it.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app.errors import ConflictError
from app.jobs.lifecycle import JobKind, JobStatus
from app.jobs.statements import jobs, models

ACTIVE = (JobStatus.queued.value, JobStatus.running.value)


async def lock_model(session: AsyncSession, name: str) -> None:
    """Hold the model's row until the caller's write transaction ends."""
    await session.execute(select(models.c.name).where(models.c.name == name).with_for_update())


async def active_run(session: AsyncSession, model: str) -> str | None:
    """The id of the run active on `model`, if any."""
    query = (
        select(jobs.c.id)
        .where(
            jobs.c.model_name == model,
            jobs.c.kind == JobKind.run.value,
            jobs.c.status.in_(ACTIVE),
        )
        .limit(1)
    )
    return await session.scalar(query)


async def active_training(session: AsyncSession, model: str) -> str | None:
    """The id of a training job active on `model` that no run owns, if any (a run's
    children have ids derived from the run's, with a dash)."""
    query = (
        select(jobs.c.id)
        .where(
            jobs.c.model_name == model,
            jobs.c.kind == JobKind.training.value,
            jobs.c.status.in_(ACTIVE),
            ~jobs.c.id.contains("-"),
        )
        .limit(1)
    )
    return await session.scalar(query)


async def ensure_no_run(session: AsyncSession, model: str, *, what: str) -> None:
    """409 if a run is active on `model` (`what`: the thing refused, for the message)."""
    await lock_model(session, model)
    run_id = await active_run(session, model)
    if run_id is not None:
        raise ConflictError(
            f"{what} on model {model!r} is refused while run {run_id} trains it: a run's "
            "curves describe that run alone; submit again once the run has ended",
            holder=run_id,
        )


async def ensure_model_free(session: AsyncSession, model: str) -> None:
    """409 unless `model` is free for a new run: no other run active, no training job."""
    await ensure_no_run(session, model, what="a second run")
    job_id = await active_training(session, model)
    if job_id is not None:
        raise ConflictError(
            f"a run on model {model!r} is refused while training job {job_id} is queued or "
            "running on it; submit again once it has ended",
            holder=job_id,
        )
