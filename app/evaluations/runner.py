"""Run one claimed evaluation job: sample the step it names `samples_per_example` times per
example, score each answer (`app.evaluations.scoring`, as a run's validation does), and
store every answer with its score or its error, a batch at a time.

An answer that cannot be sampled or scored is stored with its error; the job goes on. The
job is retried (from the examples not yet complete) only when the endpoint itself is
away. Once every example is done, the summary is read back from the stored rows.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from app.backends.base import BackendError, Inference, classify
from app.egress import EgressClient, EgressPolicy
from app.evaluations import results, scoring, spec
from app.evaluations.spec import EvaluationSpec
from app.jobs.lifecycle import Cancelled, ErrorInfo, EventType, JobUpdate, Outcome, Succeeded
from app.jobs.store import Claim, LeaseState
from app.jobs.supervise import (
    KindRunner,
    Progress,
    RunContext,
    failure,
    gone,
    started_event,
    supervise,
    with_used,
)
from app.rollouts.sampling import SamplingClient, SamplingError, tokens_of
from app.schemas.rollouts import Example

log = logging.getLogger(__name__)


async def run(claim: Claim, ctx: RunContext) -> None:
    lease, store = claim.lease, ctx.store
    try:
        try:
            recipe = spec.decode(claim.payload)
        except ValidationError:
            raise BackendError("the stored spec is not valid", transient=False) from None
        adapter = ctx.backends.get(claim.backend)
        inference = await adapter.inference(claim.model, step=recipe.step)
        api_key = (await adapter.model(claim.model)).inference_api_key
        if not inference.base_url:
            raise BackendError(f"backend {claim.backend!r} serves no endpoint", transient=False)
        complete = await results.complete_examples(
            store.engine, lease.job_id, recipe.samples_per_example
        )
    except Exception as exc:
        await ctx.apply(lease, failure(classify(exc), claim, ctx.settings))
        ctx.signal()
        return
    total = len(recipe.examples) * recipe.samples_per_example
    started = started_event(
        lease,
        recipe.step,
        {"model": inference.model_name, "samples": total, "resumed": len(complete)},
    )
    if not await store.record_start(lease, start_step=recipe.step, event=started):
        return
    ctx.signal()
    progress = Progress(EventType.evaluation_progress, coalesce=True)
    sink = _Sink(store.engine, lease.job_id)
    work = asyncio.create_task(
        _evaluate(recipe, inference, api_key, complete, sink, progress, ctx),
        name=f"evaluation:{lease.job_id}",
    )
    try:
        outcome = await _outcome(claim, work, progress, ctx, sink.tokens)
        outcome = with_used(outcome, sink.used())
    finally:
        if not work.done():
            work.cancel()
    if outcome is not None:
        await ctx.apply(lease, outcome, earlier=progress.take())
    ctx.signal()


async def _outcome(
    claim: Claim,
    work: asyncio.Task[None],
    progress: Progress,
    ctx: RunContext,
    tokens: dict[str, int],
) -> Outcome | None:
    try:
        supervised = await supervise(work, claim.lease, progress, ctx)
    except SamplingError as exc:
        return failure(BackendError(str(exc), transient=exc.transient), claim, ctx.settings)
    except Exception as exc:
        return failure(classify(exc), claim, ctx.settings)
    if supervised == "lost":
        return None
    if supervised == "cancelled":
        return Cancelled("running", {"samples": progress.step})
    try:
        summed = await results.totals(ctx.store.engine, claim.lease.job_id)
    except Exception as exc:
        return failure(classify(exc), claim, ctx.settings)
    return Succeeded(
        summed,
        job={
            "metrics": summed,
            "progress_step": progress.step,
            "progress_total": progress.total,
            "prompt_tokens": tokens["prompt_tokens"],
            "completion_tokens": tokens["completion_tokens"],
        },
    )


async def settle(state: LeaseState, ctx: RunContext, reason: ErrorInfo) -> Outcome:
    """An evaluation whose worker is gone: cancelled if asked, else retried (its stored
    answers stay: the retry goes on from the examples not yet complete) or failed."""
    if state.cancel_requested:
        return Cancelled("recovering")
    return gone(reason, state, ctx.settings)


RUNNER = KindRunner(run=run, settle=settle)


@dataclass
class _Sink:
    """Answers written a batch at a time, one write at a time."""

    engine: Any
    job_id: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Tokens this attempt sampled, added to the job's by its final write (a retry goes on
    # from the examples not yet complete; what each attempt sampled counts).
    tokens: dict[str, int] = field(
        default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0}
    )

    def used(self) -> JobUpdate:
        """The job's columns of what this attempt sampled."""
        return JobUpdate(
            prompt_tokens=self.tokens["prompt_tokens"],
            completion_tokens=self.tokens["completion_tokens"],
        )

    async def add(self, rows: list[dict[str, Any]]) -> None:
        self.rows += rows
        if len(self.rows) >= results.BATCH:
            await self.flush()

    async def flush(self) -> None:
        async with self.lock:
            batch, self.rows = self.rows, []
            await results.write(self.engine, self.job_id, batch)


async def _evaluate(
    recipe: EvaluationSpec,
    inference: Inference,
    api_key: str | None,
    complete: set[int],
    sink: _Sink,
    progress: Progress,
    ctx: RunContext,
) -> None:
    samples = recipe.samples_per_example
    total = len(recipe.examples) * samples
    done = len(complete) * samples
    scored: list[float] = []
    errors = 0

    def advance(rows: list[dict[str, Any]]) -> None:
        nonlocal done, errors
        done += len(rows)
        scored.extend(r["score"] for r in rows if r["score"] is not None)
        errors += sum(1 for r in rows if r["error"] is not None)
        mean = scoring.stats(scored).mean
        progress(done, total, {"mean_score": mean or 0.0, "errors": errors})

    progress(done, total, {"mean_score": 0.0, "errors": 0})
    policy = EgressPolicy.from_settings(ctx.settings)
    grading = asyncio.Semaphore(recipe.concurrency)
    async with (
        EgressClient(policy, max_connections=recipe.concurrency) as egress,
        SamplingClient(
            inference.base_url or "", api_key, concurrency=recipe.concurrency, timeout=600
        ) as sampler,
    ):

        async def one(index: int, example: Example) -> None:
            rows = await _example(
                recipe, index, example, inference, sampler, egress, grading, sink.tokens
            )
            advance(rows)
            await sink.add(rows)

        await asyncio.gather(
            *(one(i, e) for i, e in enumerate(recipe.examples) if i not in complete)
        )
    await sink.flush()


def _row(index: int, example: Example, sample: int, **values: Any) -> dict[str, Any]:
    for key in ("answer", "error"):  # Postgres text holds no NUL
        if isinstance(values.get(key), str):
            values[key] = values[key].replace("\x00", "\ufffd")
    error = values.get("error")
    if isinstance(error, str) and len(error) > results.MAX_ERROR_CHARS:
        values["error"] = error[: results.MAX_ERROR_CHARS - 3] + "..."
    return {
        "example": index,
        "sample": sample,
        "example_id": str(example.id)[:200],
        "answer": None,
        "score": None,
        "error": None,
        **values,
    }


async def _example(
    recipe: EvaluationSpec,
    index: int,
    example: Example,
    inference: Inference,
    sampler: SamplingClient,
    egress: EgressClient,
    grading: asyncio.Semaphore,
    tokens: dict[str, int],
) -> list[dict[str, Any]]:
    """The example's answers as rows: sampled in one request, each scored; `tokens`
    gains what the request sampled."""
    samples = recipe.samples_per_example
    request: dict[str, Any] = {
        "model": inference.model_name,
        "messages": example.messages,
        "n": samples,
        **recipe.sampling.model_dump(exclude_none=True),
    }
    try:
        response = await sampler.chat(request)
    except SamplingError as exc:
        if exc.transient:
            raise  # the endpoint is away: retry the job later, from here
        return [_row(index, example, s, error=f"sampling: {exc}") for s in range(samples)]
    prompt, completion = tokens_of(response)
    tokens["prompt_tokens"] += prompt
    tokens["completion_tokens"] += completion
    choices = response.get("choices")
    choices = choices if isinstance(choices, list) else []
    example_json = example.model_dump(mode="json")
    rows = []
    for sample in range(samples):
        if sample >= len(choices):
            rows.append(_row(index, example, sample, error="the endpoint answered no choice"))
            continue
        rows.append(
            await _scored(
                recipe, index, example, example_json, sample, choices[sample], egress, grading
            )
        )
    return rows


async def _scored(
    recipe: EvaluationSpec,
    index: int,
    example: Example,
    example_json: dict[str, Any],
    sample: int,
    choice: Any,
    egress: EgressClient,
    grading: asyncio.Semaphore,
) -> dict[str, Any]:
    try:
        answer = scoring.answer_of(choice)
    except scoring.Unscorable as exc:
        return _row(index, example, sample, error=str(exc))
    try:
        async with grading:
            graded = await scoring.score(
                recipe.grader, example=example_json, answer=answer, generation=sample, client=egress
            )
    except Exception as exc:  # one answer never sinks the job
        log.exception("evaluation: example %d sample %d could not be scored", index, sample)
        return _row(index, example, sample, answer=answer, error=type(exc).__name__)
    if graded.reward is None:
        return _row(index, example, sample, answer=answer, error=graded.error or "not scored")
    return _row(index, example, sample, answer=answer, score=graded.reward)
