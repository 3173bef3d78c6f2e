"""A run priced before it starts (`POST /v1/run-estimates`): from its checked request,
an upper bound of the tokens it samples and trains, and its seconds from the model's own
recent jobs (no backend states how long a step takes); nothing is stored."""

from __future__ import annotations

import statistics
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import begin_write
from app.jobs import quotas
from app.jobs.lifecycle import JobKind, JobStatus
from app.jobs.usage import Pricing, seconds_ran
from app.models import JobRow
from app.runs.schedule import initial_state
from app.runs.service import Checked, Prepared, check_run
from app.schemas.runs import RunEstimate
from app.schemas.usage import JobUsage
from app.settings import Settings
from app.training import tokens

RECENT_JOBS = 20
"""The model's last succeeded jobs of a kind whose mean time prices a step."""


async def _mean_seconds(session: AsyncSession, model: str, kind: JobKind) -> float | None:
    rows = await session.execute(
        select(JobRow.started_at, JobRow.finished_at)
        .where(
            JobRow.model_name == model,
            JobRow.kind == kind.value,
            JobRow.status == JobStatus.succeeded.value,
            JobRow.started_at.is_not(None),
        )
        .order_by(JobRow.created_at.desc())
        .limit(RECENT_JOBS)
    )
    seconds = [s for s in (seconds_ran(a, b) for a, b in rows) if s is not None]
    return statistics.fmean(seconds) if seconds else None


def _prompt_tokens(examples: list[dict[str, Any]]) -> float:
    """The mean prompt tokens of an example (`app.training.tokens`' count of its text)."""
    if not examples:
        return 0.0
    return sum(tokens.count(e.get("messages")) for e in examples) / len(examples)


async def dry_run(
    session: AsyncSession,
    *,
    job: Prepared,
    settings: Settings,
    pricing: Pricing,
    project_id: str | None,
) -> RunEstimate:
    """A run request checked as `create_run` checks it (its project's quotas too), and
    priced; the caller rolls the transaction back: nothing is stored."""
    await begin_write(session)
    checked = await check_run(session, job=job, settings=settings, project_id=project_id)
    await quotas.admit(session, checked.model.name)
    return await estimate(session, checked, pricing)


async def estimate(session: AsyncSession, checked: Checked, pricing: Pricing) -> RunEstimate:
    stored, model = checked.stored, checked.model
    plan = stored.plan()
    steps = initial_state(plan).total_steps
    recipe = stored.recipe
    per_step = min(plan.examples_per_step, max(1, stored.num_train))
    samples = steps * per_step * recipe.num_generations
    validation = stored.validation
    validations = 0
    validation_samples = 0
    validation_tokens = recipe.sampling.max_tokens
    if validation is not None and checked.num_validation:
        validations = (
            1 + steps // validation.every_steps + (1 if steps % validation.every_steps else 0)
        )
        validation_samples = validations * checked.num_validation * validation.num_generations
        validation_tokens = (validation.sampling or recipe.sampling).max_tokens
    notes = [
        f"{steps} steps of at most {per_step} examples x {recipe.num_generations} answers, "
        f"each at most {recipe.sampling.max_tokens} completion tokens; {validations} "
        "validations; prompts counted at 4 bytes a token"
    ]
    prompt = _prompt_tokens(checked.train)
    usage: dict[str, Any] = {}
    if recipe.agent is not None:
        notes.append(
            "tokens sampled and trained: null, an agent samples through its own calls (the "
            "gateway counts those it answers)"
        )
    else:
        completion = samples * recipe.sampling.max_tokens + validation_samples * validation_tokens
        usage["prompt_tokens"] = round(steps * per_step * prompt)
        usage["completion_tokens"] = completion
        trained = samples * (prompt + recipe.sampling.max_tokens)
        if stored.warmup:
            trained += tokens.count(stored.warmup.get("examples"))
        usage["trained_tokens"] = round(trained)
    for kind, field, jobs in (
        (JobKind.training, "trainer_seconds", steps + (1 if stored.warmup else 0)),
        (JobKind.rollout, "rollout_seconds", steps + validations),
    ):
        mean = await _mean_seconds(session, model.name, kind)
        if mean is None:
            notes.append(
                f"{field}: null, no {kind.value} job of {model.name!r} has succeeded yet: "
                "its time is not known"
            )
        else:
            usage[field] = round(mean * jobs, 3)
            notes.append(
                f"{field}: {jobs} jobs at the mean of the model's last {kind.value} jobs "
                f"({mean:.3f} s)"
            )
    used = JobUsage.model_validate({name: usage.get(name) for name in JobUsage.model_fields})
    return RunEstimate(
        model=model.name,
        total_steps=steps,
        samples=samples + validation_samples,
        validations=validations,
        usage=used,
        cost=pricing.cost(used, backend=model.backend, base_model=model.base_model),
        notes=notes,
    )
