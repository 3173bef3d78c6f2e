"""Run one claimed training job, and settle one whose worker is gone.

No database session is open while the backend works; every write is guarded by the lease.
Whatever ends a training call (success, error, cancel, a dead worker), the backend's step
decides the outcome (`lifecycle.landed_step`): a step that landed is counted once and never
trained again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.backends.base import (
    BackendError,
    ModelSpec,
    ProgressCallback,
    TrainerAdapter,
    TrainOutcome,
    classify,
)
from app.checkpoints.service import retain_after_step
from app.jobs.lifecycle import (
    Cancelled,
    ErrorInfo,
    EventType,
    Failed,
    JobStatus,
    ModelUpdate,
    Outcome,
    Recovered,
    Succeeded,
    landed_step,
)
from app.jobs.payloads import Payload
from app.jobs.store import Claim, LeaseState
from app.jobs.supervise import (
    KindRunner,
    Progress,
    RunContext,
    failure,
    gone,
    started_event,
    supervise,
)
from app.training import methods, spec, tokens
from app.trajectories import groups_to_art

if TYPE_CHECKING:
    import art

log = logging.getLogger(__name__)

# Payloads above this are decoded in a thread so the event loop keeps serving.
_THREAD_BYTES = 1 << 20
STEP_TIMEOUT = 30.0  # seconds to wait on a backend's step before moving on


async def step_or_none(adapter: TrainerAdapter, model: ModelSpec) -> int | None:
    """The backend's step, or None when it cannot say right now."""
    try:
        return await asyncio.wait_for(adapter.get_step(model), STEP_TIMEOUT)
    except (BackendError, TimeoutError):
        return None


async def run(claim: Claim, ctx: RunContext) -> None:
    lease, store = claim.lease, ctx.store
    try:
        adapter = ctx.backends.get(claim.backend)
        if claim.payload.size > _THREAD_BYTES:
            work = await asyncio.to_thread(_work, claim.payload)
        else:
            work = _work(claim.payload)
        start_step = await adapter.get_step(claim.model)
    except Exception as exc:  # nothing was trained: record the real error
        await ctx.apply(lease, failure(classify(exc), claim, ctx.settings))
        ctx.signal()
        return
    stale = stale_policy(claim, start_step)
    if stale is not None:
        await ctx.apply(lease, stale)
        ctx.signal()
        return
    progress = Progress(EventType.gradient_step)
    started = started_event(lease, start_step, work.counts)
    if start_step == claim.start_step:
        progress.events.append(started)  # recorded with the claim: out with the next write
    else:
        if not await store.record_start(lease, start_step=start_step, event=started):
            log.warning("job %s: lease lost before training; discarding", lease.job_id)
            return
        ctx.signal()
    train = asyncio.create_task(
        work.train(adapter, claim.model, claim.hyperparameters, progress),
        name=f"train:{lease.job_id}",
    )
    try:
        outcome = await _outcome(claim, adapter, train, start_step, work, progress, ctx)
    finally:
        if not train.done():
            train.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await train
    if outcome is not None:
        written = await ctx.apply(lease, outcome, earlier=progress.take())
        ctx.signal()
        if written is JobStatus.succeeded:
            # After the final write: the step stands whatever retention does.
            await retain_after_step(store.engine, ctx.backends, lease.model_name)
        return
    ctx.signal()


async def _outcome(
    claim: Claim,
    adapter: TrainerAdapter,
    train: asyncio.Task[TrainOutcome],
    start_step: int,
    work: _Work,
    progress: Progress,
    ctx: RunContext,
) -> Outcome | None:
    """`work.learnable`: some group has two different rewards; `work.tokens`: counted as
    trained once a step landed. None: nothing to write (the
    lease is lost, or the step is unknown: the lease lapses
    and recovery asks the backend again later)."""
    try:
        supervised = await supervise(train, claim.lease, progress, ctx)
    except Exception as exc:
        # The step may have landed before the error (a reply lost on the way back).
        step = await step_or_none(adapter, claim.model)
        if landed_step(start_step, step) is None:
            return None if step is None else failure(classify(exc), claim, ctx.settings)
        assert step is not None
        note = f"{type(exc).__name__}: {exc}"
        return await _recovered(adapter, claim, start_step, step, progress, note, work)
    if supervised == "lost":
        log.warning("job %s: lease lost while training; result discarded", claim.lease.job_id)
        return None
    if supervised == "cancelled":
        step = await step_or_none(adapter, claim.model)
        if landed_step(start_step, step) is not None:
            assert step is not None
            note = "cancel arrived after the step landed"
            return await _recovered(adapter, claim, start_step, step, progress, note, work)
        # Unknown: the step may yet land; the next job reads it from the backend.
        unknown = ModelUpdate(step_known=False) if step is None else None
        return Cancelled("running", {"step": progress.step}, model=unknown)
    result = train.result()
    return Succeeded(
        {
            "start_step": start_step,
            "final_step": result.step,
            "trained": result.trained,
            "metrics": result.metrics or {},
        },
        job={
            "final_step": result.step,
            "metrics": result.metrics,
            "checkpoint_path": result.checkpoint_path,
            "recovered": False,
            # ART counts the step either way; only a group with two different rewards
            # (and a backend that trained on it) changes the weights.
            "trained": result.trained and work.learnable,
            "trained_tokens": work.tokens,
            **_progress_columns(progress),
        },
        model=await _served(adapter, claim.model, result.step),
    )


@dataclass(frozen=True)
class _Work:
    """What a stored spec asks the backend to do, by its method (`rl`, `sft`, `dpo`)."""

    counts: dict[str, Any]  # the `training_started` event's data
    tokens: int  # what the trainer is handed (`app.training.tokens`)
    learnable: bool  # whether a step on it can change the weights
    train: Callable[
        [TrainerAdapter, ModelSpec, dict[str, Any], ProgressCallback],
        Coroutine[Any, Any, TrainOutcome],
    ]


def _work(payload: Payload) -> _Work:
    """Decode a stored spec into the call that trains it (off the loop for a large one)."""
    method = methods.method_of(payload.format)
    if method == "sft":
        chats = methods.sft_trajectories(payload)
        return _Work(
            {"method": "sft", "examples": len(chats)},
            tokens.count(methods.stored_examples(payload)),
            True,
            lambda adapter, model, hp, progress: adapter.train_sft(model, chats, hp, progress),
        )
    if method == "dpo":
        pairs = methods.stored_pairs(payload)
        return _Work(
            {"method": "dpo", "pairs": len(pairs)},
            tokens.count(pairs),
            True,
            lambda adapter, model, hp, progress: adapter.train_dpo(model, pairs, hp, progress),
        )
    stored = spec.stored_groups(payload)
    groups = groups_to_art(stored)
    return _Work(
        {"groups": len(groups)},
        tokens.count(stored),
        any(map(_learnable, groups)),
        lambda adapter, model, hp, progress: adapter.train(model, groups, hp, on_progress=progress),
    )


def _learnable(group: art.TrajectoryGroup) -> bool:
    """GRPO learns from a group only if its rewards differ (else every advantage is 0)."""
    return len({trajectory.reward for trajectory in group.trajectories}) > 1


def stale_policy(claim: Claim, start_step: int) -> Failed | None:
    """The job's trajectories came from a policy further behind the model than it allows
    (or from a step the model never had): fail it rather than train on them."""
    sampled, allowed = claim.policy_step, claim.max_steps_off_policy
    if sampled is None:
        return None
    if sampled > start_step:
        message = (
            f"the trajectories were sampled from step {sampled}, but the model is at step "
            f"{start_step}: that policy never existed"
        )
    elif allowed is not None and start_step - sampled > allowed:
        message = (
            f"the trajectories were sampled from step {sampled}; the model is at step "
            f"{start_step}, {start_step - sampled} steps past it, and max_steps_off_policy "
            f"is {allowed}"
        )
    else:
        return None
    error = ErrorInfo(type="StalePolicy", message=message, transient=False)
    return Failed(error, data={"policy_step": sampled, "model_step": start_step})


async def _recovered(
    adapter: TrainerAdapter,
    claim: Claim,
    start_step: int,
    step: int,
    progress: Progress,
    note: str,
    work: _Work,
) -> Recovered:
    return Recovered(
        start_step,
        step,
        note,
        model=await _served(adapter, claim.model, step),
        job={**_progress_columns(progress), "trained_tokens": work.tokens},
    )


def _progress_columns(progress: Progress) -> Any:
    total = progress.total if progress.total is not None else progress.step
    return {"progress_step": progress.step, "progress_total": total}


async def _served(adapter: TrainerAdapter, model: ModelSpec, step: int) -> ModelUpdate:
    """The model's new step, and where it is served now if the backend says."""
    update = ModelUpdate(current_step=step, step_known=True)
    with contextlib.suppress(BackendError):
        inference = await adapter.inference(model, step=step)
        update["inference_base_url"] = inference.base_url
        update["inference_model_name"] = inference.model_name
        update["inference_api_key"] = inference.api_key
    return update


async def settle(state: LeaseState, ctx: RunContext, reason: ErrorInfo) -> Outcome:
    """A job whose worker is gone: counted once if its step landed, cancelled if asked,
    else retried or failed. Raises if the backend cannot say its step (try again later)."""
    model, backend = await ctx.store.model_spec(state.lease.model_name)
    adapter = ctx.backends.get(backend)
    step = await asyncio.wait_for(adapter.get_step(model), STEP_TIMEOUT)
    landed = landed_step(state.start_step, step)
    if landed is not None:
        assert state.start_step is not None
        return Recovered(state.start_step, landed)
    if state.cancel_requested:
        return Cancelled("recovering")
    return gone(reason, state, ctx.settings)


RUNNER = KindRunner(run=run, settle=settle)
