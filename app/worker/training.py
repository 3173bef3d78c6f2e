"""Run one claimed training job: load it, train through the adapter, apply the result.

No database session is open while the backend works; every write is guarded by the lease.
Whatever ends a training call (success, error, cancel), the backend's step decides what
is written: a step that landed is counted once and never trained again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from app.backends import Backends
from app.backends.base import BackendError, ModelSpec, TrainerAdapter, classify
from app.db import is_unavailable
from app.models import JobStatus
from app.services.events import Event
from app.services.jobs import load_groups
from app.settings import Settings
from app.worker import queue
from app.worker.queue import Claim, Lease

log = logging.getLogger(__name__)

# Payloads above this are decoded in a thread so the event loop keeps serving.
_THREAD_BYTES = 1 << 20
PROGRESS_SECONDS = 0.25
STEP_TIMEOUT = 30.0


@dataclass
class Progress:
    """Progress reported by the work, flushed (as events) with the next write.

    `coalesce`: keep only the newest event between writes (rollouts report every sample).
    """

    event: str = "gradient_step"
    coalesce: bool = False
    step: int = 0
    total: int | None = None
    events: list[Event] = field(default_factory=list)
    dirty: asyncio.Event = field(default_factory=asyncio.Event)

    def __call__(self, step: int, total: int | None, metrics: dict[str, float]) -> None:
        self.step, self.total = step, total
        if self.coalesce:
            self.events.clear()
        self.events.append((self.event, {"step": step, "total": total, "metrics": metrics}))
        self.dirty.set()

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        self.dirty.clear()
        return events


def error_dict(exc: BackendError) -> dict[str, Any]:
    return {
        "type": type(exc.__cause__ or exc).__name__,
        "message": str(exc),
        "transient": exc.transient,
    }


async def step_or_none(adapter: TrainerAdapter, model: ModelSpec) -> int | None:
    """The backend's step, or None when it cannot say right now."""
    try:
        return await asyncio.wait_for(adapter.get_step(model), STEP_TIMEOUT)
    except (BackendError, TimeoutError):
        return None


async def run_training(
    claim: Claim,
    *,
    engine: AsyncEngine,
    backends: Backends,
    settings: Settings,
    signal: Callable[[], None] = lambda: None,
) -> None:
    """`signal` is called after each write of events (wakes this process's streams)."""
    lease = claim.lease
    try:
        adapter = backends.get(claim.backend)
        if claim.payload_bytes > _THREAD_BYTES:
            groups = await asyncio.to_thread(load_groups, claim.payload, claim.payload_bytes)
        else:
            groups = load_groups(claim.payload, claim.payload_bytes)
        start_step = await adapter.get_step(claim.model)
    except Exception as exc:  # nothing was trained: record the real error
        await failed(engine, claim, classify(exc), settings)
        signal()
        return
    progress = Progress()
    started = {"groups": len(groups)}
    if start_step == claim.start_step:
        # Recorded with the claim: the event goes out with the next write.
        progress.events.append(queue.started_event(lease, start_step, started))
    else:
        if not await queue.record_start(engine, lease, start_step=start_step, data=started):
            log.warning("job %s: lease lost before training; discarding", lease.job_id)
            return
        signal()
    train = asyncio.create_task(
        adapter.train(claim.model, groups, claim.hyperparameters, on_progress=progress),
        name=f"train:{lease.job_id}",
    )
    try:
        outcome = await supervise(train, lease, progress, engine, settings, signal)
    except Exception as exc:
        # The step may have landed before the error (a reply lost on the way back).
        note = f"{type(exc).__name__}: {exc}"
        step = await _count_if_landed(engine, claim, adapter, start_step, progress, note)
        if step is not None and step <= start_step:
            await failed(engine, claim, classify(exc), settings, progress.take())
        # else: the lease lapses and recovery asks the backend again later
        signal()
        return
    finally:
        if not train.done():
            await _stop(train)
    if outcome == "lost":
        log.warning("job %s: lease lost while training; result discarded", lease.job_id)
        return
    if outcome == "cancelled":
        note = "cancel arrived after the step landed"
        step = await _count_if_landed(engine, claim, adapter, start_step, progress, note)
        if step is None or step <= start_step:
            await queue.finish(
                engine,
                lease,
                status=JobStatus.cancelled,
                event="job_cancelled",
                data={"while": "running", "step": progress.step},
                earlier_events=progress.take(),
                # Unknown: the step may yet land; the next job reads it from the backend.
                model_update={"step_known": False} if step is None else None,
            )
        signal()
        return
    result = train.result()
    await _succeeded(
        engine,
        claim,
        adapter,
        start_step,
        result.step,
        progress,
        metrics=result.metrics,
        checkpoint_path=result.checkpoint_path,
        trained=result.trained,
    )
    signal()


async def _count_if_landed(
    engine: AsyncEngine,
    claim: Claim,
    adapter: TrainerAdapter,
    start_step: int,
    progress: Progress,
    note: str,
) -> int | None:
    """If the backend's step moved past `start_step` after all, the job succeeded: write
    that (the step counts once, never trained again). Returns the step; None: unknown
    (the lease lapses and recovery asks the backend again later)."""
    step = await step_or_none(adapter, claim.model)
    if step is not None and step > start_step:
        await _succeeded(
            engine, claim, adapter, start_step, step, progress, recovered=True, note=note
        )
    return step


async def _succeeded(
    engine: AsyncEngine,
    claim: Claim,
    adapter: TrainerAdapter,
    start_step: int,
    step: int,
    progress: Progress,
    *,
    metrics: dict[str, float] | None = None,
    checkpoint_path: str | None = None,
    trained: bool = True,
    recovered: bool = False,
    note: str | None = None,
) -> None:
    model_update: dict[str, Any] = {"current_step": step, "step_known": True}
    with contextlib.suppress(BackendError):
        inference = await adapter.inference(claim.model, step=step)
        model_update |= {
            "inference_base_url": inference.base_url,
            "inference_model_name": inference.model_name,
        }
    data: dict[str, Any] = {
        "start_step": start_step,
        "final_step": step,
        "trained": trained,
        "metrics": metrics or {},
    }
    if recovered:
        data |= {"recovered": True, "note": note}
    await queue.finish(
        engine,
        claim.lease,
        status=JobStatus.succeeded,
        event="training_ended",
        data=data,
        earlier_events=progress.take(),
        model_update=model_update,
        final_step=step,
        metrics=metrics,
        checkpoint_path=checkpoint_path,
        recovered=recovered,
        progress_step=progress.step,
        progress_total=progress.total if progress.total is not None else progress.step,
        error=None,
    )


async def supervise(
    train: asyncio.Task[Any],
    lease: Lease,
    progress: Progress,
    engine: AsyncEngine,
    settings: Settings,
    signal: Callable[[], None],
) -> str:
    """Heartbeat until training ends. Returns "done", "cancelled" or "lost"."""
    loop = asyncio.get_running_loop()
    renewed = loop.time()  # when the lease was last known to be extended
    next_beat = renewed + settings.heartbeat_seconds
    # Progress is written at most every PROGRESS_SECONDS; a step quicker than that writes
    # its events with the final write.
    next_write = renewed + PROGRESS_SECONDS
    while True:
        # Wake for the end of training, the next heartbeat, or new progress; fast steps
        # batch into one write.
        wake_at = next_beat
        waiting: set[asyncio.Future[Any]] = {train}
        if progress.events:
            wake_at = min(wake_at, next_write)
        else:
            waiting.add(asyncio.ensure_future(progress.dirty.wait()))
        await asyncio.wait(
            waiting, timeout=max(0.0, wake_at - loop.time()), return_when=asyncio.FIRST_COMPLETED
        )
        for waiter in waiting - {train}:
            waiter.cancel()
        if train.done():
            train.result()  # raises the backend's error, if any
            return "done"  # pending progress events go out with the final write
        if loop.time() < wake_at and not (progress.events and loop.time() >= next_write):
            continue
        events = progress.take()
        attempt = loop.time()
        try:
            beat = await queue.heartbeat(
                engine,
                lease,
                lease_seconds=settings.lease_seconds,
                progress=(progress.step, progress.total),
                events=events,
            )
        except Exception as exc:
            if not is_unavailable(exc):
                raise  # the caller stops training and settles the job
            # The database is away (restart, failover): keep training while the lease may
            # still be ours, and try again soon.
            progress.events[:0] = events
            if loop.time() - renewed > 0.8 * settings.lease_seconds:
                return "lost"
            log.warning("job %s: heartbeat failed (%s); retrying", lease.job_id, exc)
            next_beat = next_write = loop.time() + min(1.0, settings.heartbeat_seconds)
            continue
        renewed = attempt
        next_beat = renewed + settings.heartbeat_seconds
        next_write = renewed + PROGRESS_SECONDS
        if events:
            signal()
        if not beat.alive:
            return "lost"
        if beat.cancel_requested:
            return "cancelled"


async def _stop(train: asyncio.Task[Any]) -> None:
    train.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await train


async def failed(
    engine: AsyncEngine,
    claim: Claim,
    exc: BackendError,
    settings: Settings,
    earlier_events: list[Event] | None = None,
) -> None:
    lease, error = claim.lease, error_dict(exc)
    log.warning("job %s attempt %d failed: %s", lease.job_id, lease.attempt, exc)
    if exc.transient:
        await queue.retry_or_fail(
            engine,
            lease,
            error=error,
            max_attempts=claim.max_attempts,
            retry_base_seconds=settings.retry_base_seconds,
            earlier_events=earlier_events or (),
        )
    else:
        await queue.finish(
            engine,
            lease,
            status=JobStatus.failed,
            event="training_failed",
            data={"error": error, "attempt": lease.attempt},
            error=error,
            earlier_events=earlier_events or (),
        )
