"""What a job used and what it costs by the price table (issue 28 §4), pure: the wire
of every kind of job, a run's sums and `GET /v1/usage` price the same way.

A price is per hour (`trainer_hour`, `rollout_hour`) or per million tokens
(`sampled_mtok`: prompt and completion tokens sampled; `trained_mtok`), for every model
(`unit`), or for a model's base model or backend (`unit:<name>`); the base model's price
wins over the backend's, which wins over the one for every model; none given: 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from app.db import utcnow
from app.jobs.lifecycle import JobKind
from app.schemas.usage import JobCost, JobUsage

TRAINER_KINDS = frozenset({JobKind.training.value})
ROLLOUT_KINDS = frozenset({JobKind.rollout.value, JobKind.evaluation.value})


@dataclass(frozen=True)
class Pricing:
    """The price table and its currency (`TRAINYARD_PRICES`, `TRAINYARD_PRICE_CURRENCY`)."""

    prices: Mapping[str, float]
    currency: str

    def price(self, unit: str, *, backend: str | None, base_model: str | None) -> float:
        for name in (base_model, backend):
            if name and f"{unit}:{name}" in self.prices:
                return self.prices[f"{unit}:{name}"]
        return self.prices.get(unit, 0.0)

    def cost(self, usage: JobUsage, *, backend: str | None, base_model: str | None) -> JobCost:
        def at(unit: str) -> float:
            return self.price(unit, backend=backend, base_model=base_model)

        sampled = (usage.prompt_tokens or 0) + (usage.completion_tokens or 0)
        parts = {
            "sampled": sampled / 1e6 * at("sampled_mtok"),
            "trained": (usage.trained_tokens or 0) / 1e6 * at("trained_mtok"),
            "trainer": (usage.trainer_seconds or 0.0) / 3600 * at("trainer_hour"),
            "rollout": (usage.rollout_seconds or 0.0) / 3600 * at("rollout_hour"),
        }
        rounded = {name: round(value, 6) for name, value in parts.items()}
        return JobCost(currency=self.currency, amount=round(sum(parts.values()), 6), **rounded)


def seconds_ran(
    started_at: datetime | None, finished_at: datetime | None, now: datetime | None = None
) -> float | None:
    """From the last claim to the end (or to now while it runs); None: never started."""
    if started_at is None:
        return None
    end = finished_at or now or utcnow()
    return round(max(0.0, (end - started_at).total_seconds()), 3)


class Attempts(Protocol):
    """What a job's seconds are read from (`seconds_of`)."""

    @property
    def started_at(self) -> datetime | None: ...
    @property
    def finished_at(self) -> datetime | None: ...
    @property
    def attempts(self) -> int: ...
    @property
    def returned_at_attempt(self) -> int | None: ...
    @property
    def earlier_seconds(self) -> float | None: ...


def seconds_of(job: Attempts) -> float | None:
    """Every attempt's seconds: the earlier ones' (`earlier_seconds`, written as each went
    back to the queue) and the last one's unless it is among them (`returned_at_attempt`:
    see `statements.last_counts`); None: never started."""
    if job.started_at is None:
        return None
    returned = job.returned_at_attempt
    counts = returned is None or returned < job.attempts
    last = seconds_ran(job.started_at, job.finished_at) if counts else 0.0
    return round((job.earlier_seconds or 0.0) + (last or 0.0), 3)


class Ran(Attempts, Protocol):
    """What a job's usage is read from: its row, its view, or a row of a query of them."""

    @property
    def kind(self) -> str: ...
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def completion_tokens(self) -> int | None: ...
    @property
    def trained_tokens(self) -> int | None: ...


def job_usage(job: Ran) -> JobUsage:
    seconds = seconds_of(job)
    return JobUsage(
        prompt_tokens=job.prompt_tokens,
        completion_tokens=job.completion_tokens,
        trained_tokens=job.trained_tokens,
        trainer_seconds=seconds if job.kind in TRAINER_KINDS else None,
        rollout_seconds=seconds if job.kind in ROLLOUT_KINDS else None,
    )


def summed(parts: Iterable[JobUsage]) -> JobUsage:
    """Children's usage summed (a run's): a count none of them has stays null."""
    totals: dict[str, float | int | None] = dict.fromkeys(JobUsage.model_fields)
    for part in parts:
        for name, value in part.model_dump().items():
            if value is not None:
                totals[name] = (totals[name] or 0) + value
    for name in ("trainer_seconds", "rollout_seconds"):
        if totals[name] is not None:
            totals[name] = round(float(totals[name] or 0), 3)
    return JobUsage.model_validate(totals)
