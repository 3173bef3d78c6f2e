"""Per-project quotas (issue 28 §3): the checks a submission passes, and what a project uses.

The running quota is kept by the claim (`app.jobs.statements.claim_query`): over it, jobs
wait queued. The others are checked here, in the submission's write transaction, before
its job is inserted: over one, the submission is refused with 429 and nothing is stored.
On Postgres the project's row is locked first, so two submissions at once cannot both take
the last place; on SQLite the write transaction is the only writer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Connection, Table, func, literal, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import utcnow
from app.errors import ProblemError, not_found
from app.jobs import statements
from app.jobs.events import Executor
from app.jobs.lifecycle import JobKind, JobStatus
from app.models import JobRow, ModelRow, ProjectRow
from app.schemas.tenants import ProjectQuotas, Quotas, QuotaUsage

jobs = cast(Table, JobRow.__table__)
projects = cast(Table, ProjectRow.__table__)
models = cast(Table, ModelRow.__table__)

COLUMNS = {
    "running_jobs": projects.c.max_running_jobs,
    "queued_jobs": projects.c.max_queued_jobs,
    "submissions_per_minute": projects.c.max_submissions_per_minute,
    "trainer_seconds_per_day": projects.c.max_trainer_seconds_per_day,
}
QUEUED_RETRY_AFTER = 10
"""The `Retry-After` of a full queue: a hint (queued jobs leave it as workers claim them)."""
WINDOW = timedelta(seconds=60)


class QuotaExceededError(ProblemError):
    """A project quota refuses the submission (`quota` names it, `limit` its value)."""

    status, title, slug = 429, "Too Many Requests", "quota-exceeded"


@dataclass(frozen=True)
class ProjectName:
    id: str
    name: str


def _quotas(row: Any) -> Quotas:
    return Quotas(**{quota: getattr(row, column.name) for quota, column in COLUMNS.items()})


CACHE_SECONDS = 2.0
"""How long a process trusts what it read of a project's quotas: a quota an admin sets
applies at once in the process that set it, and within this many seconds in every other
(as a revoked key is refused, `TRAINYARD_KEY_CACHE_SECONDS`)."""
MAX_CACHED = 10_000
_cache: dict[tuple[str, str], tuple[float, ProjectName, Quotas]] = {}


def _cache_key(session: AsyncSession, project_id: str) -> tuple[str, str]:
    bind = session.get_bind()
    engine = bind.engine if isinstance(bind, Connection) else bind
    return str(engine.url), project_id


async def _read(session: AsyncSession, project_id: str) -> tuple[ProjectName, Quotas] | None:
    key = _cache_key(session, project_id)
    hit = _cache.get(key)
    now = time.monotonic()
    if hit is not None and now - hit[0] < CACHE_SECONDS:
        return hit[1], hit[2]
    row = (
        await session.execute(
            select(projects.c.id, projects.c.name, *COLUMNS.values()).where(
                projects.c.id == project_id
            )
        )
    ).one_or_none()
    if row is None:
        return None
    if len(_cache) >= MAX_CACHED:
        _cache.clear()
    _cache[key] = (now, ProjectName(row.id, row.name), _quotas(row))
    return _cache[key][1], _cache[key][2]


def forget(session: AsyncSession, project_id: str) -> None:
    """Drop this process's read of the project's quotas (they were just set)."""
    _cache.pop(_cache_key(session, project_id), None)


async def admit(session: AsyncSession, model_name: str, *, now: datetime | None = None) -> None:
    """Refuse (429) a submission for `model_name` that its project's quotas do not allow.
    In the caller's write transaction, before the job is inserted. A project without
    submission quotas costs no query here: its model is in the session already (the
    service looked it up) and its quotas in this process's cache."""
    model = await session.get(ModelRow, model_name)
    if model is None:
        return  # no such model: the service answers its own 404
    found = await _read(session, model.project_id)
    if found is None:
        return  # a project without a row has no quotas
    project, quotas = found
    if (
        quotas.queued_jobs is None
        and quotas.submissions_per_minute is None
        and quotas.trainer_seconds_per_day is None
    ):
        return
    if session.get_bind().dialect.name == "postgresql":
        # Submissions of this project take turns from here to their commit; the counts
        # below are read after the lock, so they include every submission before ours.
        await session.execute(
            select(projects.c.id).where(projects.c.id == project.id).with_for_update()
        )
    now = now or utcnow()
    if quotas.queued_jobs is not None:
        queued = await _queued(session, project.id)
        if queued >= quotas.queued_jobs:
            raise _refused(
                project,
                "queued_jobs",
                quotas.queued_jobs,
                f"{queued} jobs queued",
                QUEUED_RETRY_AFTER,
            )
    if quotas.submissions_per_minute is not None:
        count, oldest = await _submissions(session, project.id, now)
        if count >= quotas.submissions_per_minute:
            wait = (oldest + WINDOW - now).total_seconds() if oldest is not None else 60
            raise _refused(
                project,
                "submissions_per_minute",
                quotas.submissions_per_minute,
                f"{count} submissions in the last minute",
                wait,
            )
    if quotas.trainer_seconds_per_day is not None:
        used = await trainer_seconds(session, project.id, now)
        if used >= quotas.trainer_seconds_per_day:
            midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time())
            raise _refused(
                project,
                "trainer_seconds_per_day",
                quotas.trainer_seconds_per_day,
                f"{used:.0f} trainer-seconds used today (UTC)",
                (midnight.replace(tzinfo=now.tzinfo) - now).total_seconds(),
            )


def _refused(
    project: ProjectName, quota: str, limit: int, used: str, retry_after: float
) -> QuotaExceededError:
    return QuotaExceededError(
        f"project {project.name!r} has {used}: its {quota} quota is {limit}; nothing was stored",
        headers={"Retry-After": str(max(1, math.ceil(retry_after)))},
        quota=quota,
        limit=limit,
    )


async def _queued(session: AsyncSession, project_id: str) -> int:
    query = select(func.count()).where(
        jobs.c.project_id == project_id, jobs.c.status == JobStatus.queued.value
    )
    return int(await session.scalar(query) or 0)


async def _running(session: AsyncSession, project_id: str) -> int:
    return int(await session.scalar(select(statements.running_in(literal(project_id)))) or 0)


async def _submissions(
    session: AsyncSession, project_id: str, now: datetime
) -> tuple[int, datetime | None]:
    """The project's submissions in the minute before `now`, and the oldest of them."""
    query = select(func.count(), func.min(jobs.c.created_at)).where(
        jobs.c.project_id == project_id,
        jobs.c.submitted.is_(True),
        jobs.c.created_at > now - WINDOW,
    )
    count, oldest = (await session.execute(query)).one()
    return int(count), oldest


async def trainer_seconds(session: AsyncSession, project_id: str, now: datetime) -> float:
    """Seconds the project's training jobs ran in the UTC day of `now`: each from its last
    claim (`started_at`) to its end, or to now while it runs, clipped to the day (the one
    expression `GET /v1/usage` sums too: `statements.ran_within`)."""
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    at = jobs.c.started_at.type
    query = select(
        func.coalesce(
            func.sum(statements.ran_within(literal(day, at), literal(now, at), literal(now, at))),
            0.0,
        )
    ).where(
        jobs.c.project_id == project_id,
        jobs.c.kind == JobKind.training.value,
        jobs.c.started_at.is_not(None),
        jobs.c.started_at < now,
        or_(jobs.c.status.in_(statements.UNFINISHED), jobs.c.finished_at >= day),
    )
    return max(0.0, float(await session.scalar(query) or 0.0))


async def get(session: AsyncSession, project_id: str) -> ProjectQuotas:
    row = (
        await session.execute(
            select(projects.c.id, projects.c.name, *COLUMNS.values()).where(
                projects.c.id == project_id
            )
        )
    ).one_or_none()
    if row is None:
        raise not_found("project", project_id, param="project_id")
    now = utcnow()
    count, _ = await _submissions(session, project_id, now)
    usage = QuotaUsage(
        running_jobs=await _running(session, project_id),
        queued_jobs=await _queued(session, project_id),
        submissions_last_minute=count,
        trainer_seconds_today=round(await trainer_seconds(session, project_id, now), 3),
    )
    return ProjectQuotas(project_id=project_id, quotas=_quotas(row), usage=usage)


async def put(session: AsyncSession, project_id: str, quotas: Quotas) -> None:
    """Set every quota of the project (a missing one: no limit). In a write transaction."""
    values = {column.name: getattr(quotas, quota) for quota, column in COLUMNS.items()}
    result = await session.execute(
        update(projects).where(projects.c.id == project_id).values(values)
    )
    if result.rowcount == 0:  # type: ignore[attr-defined]
        raise not_found("project", project_id, param="project_id")


async def projects_of(executor: Executor, names: Iterable[str]) -> dict[str, str]:
    """Each model's project."""
    rows = await executor.execute(
        select(models.c.name, models.c.project_id).where(models.c.name.in_(list(names)))
    )
    return {row.name: row.project_id for row in rows}


async def at_running_quota(executor: Executor) -> dict[str, tuple[int, int]]:
    """The projects whose jobs wait for their running quota: (running, quota) of each."""
    running = statements.running_in(projects.c.id)
    limit = projects.c.max_running_jobs
    rows = await executor.execute(
        select(projects.c.id, running.label("running"), limit).where(
            limit.is_not(None), running >= limit
        )
    )
    return {row.id: (row.running, row.max_running_jobs) for row in rows}
