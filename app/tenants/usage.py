"""What projects used (issue 28 §4), read from the ledgers themselves: the jobs table (a
job's times and tokens are written by the write that ends it, so nothing is counted
twice and nothing accepted is lost) and the gateway's usage rows; priced by the price
table (`app.jobs.usage.Pricing`).

A job counts the seconds it ran within the window (`statements.ran_within`: trainer
seconds for training jobs, rollout seconds for rollout and evaluation jobs), on the UTC
day it started (or `from`, if it started before), and its tokens if it ended in the
window. A gateway call counts on the day it was answered.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any, Literal, cast

from sqlalchemy import ColumnElement, Table, func, literal, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.backends import Backends
from app.checkpoints.service import bytes_kept
from app.db import utcnow
from app.jobs.statements import UNFINISHED, greatest, ran_within
from app.jobs.usage import ROLLOUT_KINDS, TRAINER_KINDS, Pricing
from app.models import GatewayUsageRow, JobRow, ModelRow
from app.schemas.tenants import Usage, UsageRow
from app.schemas.usage import JobUsage
from app.settings import Settings

GroupBy = Literal["day", "model", "run", "kind", "key"]
jobs = cast(Table, JobRow.__table__)
models = cast(Table, ModelRow.__table__)
calls = cast(Table, GatewayUsageRow.__table__)
NO_KEY = "none"
"""The group of what no stored key did: jobs a run made, keys of TRAINYARD_API_KEYS."""


def _day(dialect: str, column: Any) -> ColumnElement[str]:
    if dialect == "postgresql":
        return func.to_char(func.timezone("UTC", column), "YYYY-MM-DD")
    return func.strftime("%Y-%m-%d", column)


def _job_group(dialect: str, group_by: GroupBy, since: Any) -> ColumnElement[Any]:
    if group_by == "day":
        return _day(dialect, greatest(jobs.c.started_at, since))
    if group_by == "model":
        return jobs.c.model_name
    if group_by == "kind":
        return jobs.c.kind
    if group_by == "key":
        return func.coalesce(jobs.c.key_id, NO_KEY)
    return jobs.c.metadata["run"].as_string()  # a run's children carry its id


def _call_group(dialect: str, group_by: GroupBy) -> ColumnElement[Any]:
    if group_by == "day":
        return _day(dialect, calls.c.created_at)
    if group_by == "model":
        return calls.c.model
    if group_by == "key":
        return func.coalesce(calls.c.key_id, NO_KEY)
    return literal("gateway")  # kind


def _tokens(column: Any, ended: ColumnElement[bool]) -> ColumnElement[int]:
    return func.coalesce(func.sum(func.coalesce(column, 0)).filter(ended), 0)


async def _jobs(
    session: AsyncSession,
    group_by: GroupBy,
    since: datetime,
    until: datetime,
    project_id: str | None,
) -> list[Any]:
    dialect = session.get_bind().dialect.name
    at = jobs.c.started_at.type
    start, end = literal(since, at), literal(until, at)
    group = _job_group(dialect, group_by, start).label("grp")
    ended = (jobs.c.finished_at >= since) & (jobs.c.finished_at < until)
    query = (
        select(
            group,
            models.c.backend,
            models.c.base_model,
            jobs.c.kind,
            func.count().label("jobs"),
            func.coalesce(func.sum(ran_within(start, end, literal(utcnow(), at))), 0.0).label(
                "seconds"
            ),
            _tokens(jobs.c.prompt_tokens, ended).label("prompt_tokens"),
            _tokens(jobs.c.completion_tokens, ended).label("completion_tokens"),
            _tokens(jobs.c.trained_tokens, ended).label("trained_tokens"),
        )
        .join(models, models.c.name == jobs.c.model_name)
        .where(
            jobs.c.kind.in_(TRAINER_KINDS | ROLLOUT_KINDS),
            jobs.c.started_at.is_not(None),
            jobs.c.started_at < until,
            or_(jobs.c.status.in_(UNFINISHED), jobs.c.finished_at >= since),
        )
        .group_by(group, models.c.backend, models.c.base_model, jobs.c.kind)
    )
    if project_id is not None:
        query = query.where(jobs.c.project_id == project_id)
    if group_by == "run":
        query = query.where(group.is_not(None))
    return list(await session.execute(query))


async def _calls(
    session: AsyncSession,
    group_by: GroupBy,
    since: datetime,
    until: datetime,
    project_id: str | None,
) -> list[Any]:
    if group_by == "run":
        return []  # a gateway call is no run's
    group = _call_group(session.get_bind().dialect.name, group_by).label("grp")
    query = (
        select(
            group,
            models.c.backend,
            models.c.base_model,
            func.count().label("calls"),
            func.sum(calls.c.prompt_tokens).label("prompt_tokens"),
            func.sum(calls.c.completion_tokens).label("completion_tokens"),
        )
        .outerjoin(models, models.c.name == calls.c.model)
        .where(calls.c.created_at >= since, calls.c.created_at < until)
        .group_by(group, models.c.backend, models.c.base_model)
    )
    if project_id is not None:
        query = query.where(calls.c.project_id == project_id)
    return list(await session.execute(query))


async def usage(
    session: AsyncSession,
    settings: Settings,
    backends: Backends | None,
    *,
    since: datetime,
    until: datetime,
    group_by: GroupBy,
    project_id: str | None,
) -> Usage:
    """What was used in [since, until), grouped; `project_id` None: every project.
    `backends`: to read the checkpoint bytes each model keeps (group_by=model)."""
    pricing = Pricing(settings.prices, settings.price_currency)
    totals: dict[str, UsageRow] = {}
    for row in await _jobs(session, group_by, since, until, project_id):
        item = totals.setdefault(str(row.grp), UsageRow(group=str(row.grp)))
        seconds = max(0.0, float(row.seconds))
        trainer = row.kind in TRAINER_KINDS
        used = JobUsage(
            prompt_tokens=int(row.prompt_tokens),
            completion_tokens=int(row.completion_tokens),
            trained_tokens=int(row.trained_tokens),
            trainer_seconds=seconds if trainer else 0.0,
            rollout_seconds=0.0 if trainer else seconds,
        )
        _add(item, used, pricing, row, jobs=int(row.jobs))
    for row in await _calls(session, group_by, since, until, project_id):
        item = totals.setdefault(str(row.grp), UsageRow(group=str(row.grp)))
        used = JobUsage(
            prompt_tokens=int(row.prompt_tokens),
            completion_tokens=int(row.completion_tokens),
            trained_tokens=0,
            trainer_seconds=0.0,
            rollout_seconds=0.0,
        )
        _add(item, used, pricing, row, calls=int(row.calls))
    data = [_rounded(totals[key]) for key in sorted(totals)]
    if group_by == "model" and backends is not None:
        await _checkpoint_bytes(session, backends, data)
    return Usage(
        since=since,
        until=until,
        group_by=group_by,
        currency=settings.price_currency,
        data=data,
        total=_rounded(_sum(data)),
    )


def _add(item: UsageRow, used: JobUsage, pricing: Pricing, row: Any, **counts: int) -> None:
    item.jobs += counts.get("jobs", 0)
    item.gateway_calls += counts.get("calls", 0)
    item.trainer_seconds += used.trainer_seconds or 0.0
    item.rollout_seconds += used.rollout_seconds or 0.0
    item.prompt_tokens += used.prompt_tokens or 0
    item.completion_tokens += used.completion_tokens or 0
    item.trained_tokens += used.trained_tokens or 0
    item.cost += pricing.cost(used, backend=row.backend, base_model=row.base_model).amount


SUMMED = (
    "jobs",
    "gateway_calls",
    "trainer_seconds",
    "rollout_seconds",
    "prompt_tokens",
    "completion_tokens",
    "trained_tokens",
    "cost",
)


def _sum(data: list[UsageRow]) -> UsageRow:
    total = UsageRow(
        group="total", **{name: sum(getattr(r, name) for r in data) for name in SUMMED}
    )
    kept = [r.checkpoint_bytes for r in data if r.checkpoint_bytes is not None]
    total.checkpoint_bytes = sum(kept) if kept else None
    return total


async def _checkpoint_bytes(
    session: AsyncSession, backends: Backends, data: list[UsageRow]
) -> None:
    """The bytes each model's checkpoints take now (not within the window: what is kept)."""
    rows = {
        row.name: row
        for row in await session.scalars(
            select(ModelRow).where(ModelRow.name.in_([r.group for r in data]))
        )
    }
    sizes = await asyncio.gather(
        *(bytes_kept(rows[r.group], backends) for r in data if r.group in rows)
    )
    by_name = dict(zip([r.group for r in data if r.group in rows], sizes, strict=True))
    for item in data:
        item.checkpoint_bytes = by_name.get(item.group)


def _rounded(row: UsageRow) -> UsageRow:
    return row.model_copy(
        update={
            "trainer_seconds": round(row.trainer_seconds, 3),
            "rollout_seconds": round(row.rollout_seconds, 3),
            "cost": round(row.cost, 6),
        }
    )
