"""What projects used, read from the jobs themselves (issue 28 §4, its first part): trainer
seconds (training jobs) and rollout seconds (rollout and evaluation jobs: sampling and
grading), each job from its last claim to its end (or to now while it runs), counted on
the UTC day it started; and an estimated cost from the price table (`TRAINYARD_PRICES`).

The jobs table is the ledger: a job's times are written once, by the write that ends it,
so nothing is counted twice and nothing accepted is lost. Tokens sampled and trained are
not counted yet.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, cast

from sqlalchemy import ColumnElement, Table, func, literal, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import utcnow
from app.jobs.lifecycle import JobKind, JobStatus
from app.models import JobRow, ModelRow
from app.schemas.tenants import Usage, UsageRow
from app.settings import Settings

GroupBy = Literal["day", "model", "run", "kind"]
jobs = cast(Table, JobRow.__table__)
models = cast(Table, ModelRow.__table__)
TRAINER_KINDS = (JobKind.training.value,)
ROLLOUT_KINDS = (JobKind.rollout.value, JobKind.evaluation.value)


def _seconds(dialect: str, start: Any, end: Any) -> ColumnElement[float]:
    if dialect == "postgresql":
        return cast(ColumnElement[float], func.extract("epoch", end - start))
    return (func.julianday(end) - func.julianday(start)) * 86400.0


def _day(dialect: str, column: Any) -> ColumnElement[str]:
    if dialect == "postgresql":
        return func.to_char(func.timezone("UTC", column), "YYYY-MM-DD")
    return func.strftime("%Y-%m-%d", column)


def _group(dialect: str, group_by: GroupBy) -> ColumnElement[Any]:
    if group_by == "day":
        return _day(dialect, jobs.c.started_at)
    if group_by == "model":
        return jobs.c.model_name
    if group_by == "kind":
        return jobs.c.kind
    return jobs.c.metadata["run"].as_string()  # a run's children carry its id


def price(settings: Settings, unit: str, backend: str) -> float:
    """Per hour: the backend's own price, else the one for every backend, else 0."""
    prices = settings.prices
    return prices.get(f"{unit}:{backend}", prices.get(unit, 0.0))


async def usage(
    session: AsyncSession,
    settings: Settings,
    *,
    since: datetime,
    until: datetime,
    group_by: GroupBy,
    project_id: str | None,
) -> Usage:
    """The jobs that started in [since, until), grouped; `project_id` None: every project."""
    dialect = session.get_bind().dialect.name
    now = utcnow()
    end = func.coalesce(jobs.c.finished_at, literal(now, jobs.c.started_at.type))
    seconds = _seconds(dialect, jobs.c.started_at, end)
    group = _group(dialect, group_by).label("grp")
    counted = or_(jobs.c.status == JobStatus.running.value, jobs.c.finished_at.is_not(None))
    query = (
        select(
            group,
            models.c.backend,
            jobs.c.kind,
            func.count().label("jobs"),
            func.coalesce(func.sum(seconds), 0.0).label("seconds"),
        )
        .join(models, models.c.name == jobs.c.model_name)
        .where(
            jobs.c.kind.in_(TRAINER_KINDS + ROLLOUT_KINDS),
            jobs.c.started_at.is_not(None),
            jobs.c.started_at >= since,
            jobs.c.started_at < until,
            counted,
        )
        .group_by(group, models.c.backend, jobs.c.kind)
    )
    if project_id is not None:
        query = query.where(jobs.c.project_id == project_id)
    if group_by == "run":
        query = query.where(group.is_not(None))
    totals: dict[str, UsageRow] = {}
    for row in await session.execute(query):
        key = str(row.grp)
        item = totals.setdefault(key, UsageRow(group=key))
        seconds_used = max(0.0, float(row.seconds))
        if row.kind in TRAINER_KINDS:
            item.trainer_seconds += seconds_used
            item.cost += seconds_used / 3600 * price(settings, "trainer_hour", row.backend)
        else:
            item.rollout_seconds += seconds_used
            item.cost += seconds_used / 3600 * price(settings, "rollout_hour", row.backend)
        item.jobs += int(row.jobs)
    data = [_rounded(totals[key]) for key in sorted(totals)]
    total = UsageRow(
        group="total",
        jobs=sum(r.jobs for r in data),
        trainer_seconds=sum(r.trainer_seconds for r in data),
        rollout_seconds=sum(r.rollout_seconds for r in data),
        cost=sum(r.cost for r in data),
    )
    return Usage(
        since=since,
        until=until,
        group_by=group_by,
        currency=settings.price_currency,
        data=data,
        total=_rounded(total),
    )


def _rounded(row: UsageRow) -> UsageRow:
    return row.model_copy(
        update={
            "trainer_seconds": round(row.trainer_seconds, 3),
            "rollout_seconds": round(row.rollout_seconds, 3),
            "cost": round(row.cost, 6),
        }
    )
