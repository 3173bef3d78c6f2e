"""Run one claimed training job: load it, train through the adapter, apply the result.

No database session is open while the backend works; every write is guarded by the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.backends import Backends
from app.backends.base import BackendError
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


@dataclass
class _Progress:
    """Gradient-step progress collected from the backend, flushed on the next write."""

    step: int = 0
    total: int | None = None
    events: list[Event] = field(default_factory=list)
    dirty: asyncio.Event = field(default_factory=asyncio.Event)

    def __call__(self, step: int, total: int | None, metrics: dict[str, float]) -> None:
        self.step, self.total = step, total
        self.events.append(("gradient_step", {"step": step, "total": total, "metrics": metrics}))
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


async def run_training(
    claim: Claim, *, engine: AsyncEngine, backends: Backends, settings: Settings
) -> None:
    lease = claim.lease
    try:
        adapter = backends.get(claim.backend)
        if claim.payload_bytes > _THREAD_BYTES:
            groups = await asyncio.to_thread(load_groups, claim.payload, claim.payload_bytes)
        else:
            groups = load_groups(claim.payload, claim.payload_bytes)
        start_step = await adapter.get_step(claim.model)
    except BackendError as exc:
        await _failed(engine, claim, exc, settings)
        return
    if not await queue.record_start(
        engine, lease, start_step=start_step, data={"groups": len(groups)}
    ):
        log.warning("job %s: lease lost before training; discarding", lease.job_id)
        return
    progress = _Progress()
    train = asyncio.create_task(
        adapter.train(claim.model, groups, claim.hyperparameters, on_progress=progress),
        name=f"train:{lease.job_id}",
    )
    try:
        outcome = await _supervise(train, lease, progress, engine, settings)
    except BackendError as exc:
        await _failed(engine, claim, exc, settings)
        return
    if outcome == "lost":
        log.warning("job %s: lease lost while training; result discarded", lease.job_id)
        return
    if outcome == "cancelled":
        await queue.finish(
            engine,
            lease,
            status=JobStatus.cancelled,
            event="job_cancelled",
            data={"while": "running", "step": progress.step},
            earlier_events=progress.take(),
        )
        return
    result = train.result()
    model_update: dict[str, Any] = {"current_step": result.step}
    with contextlib.suppress(BackendError):
        inference = await adapter.inference(claim.model)
        model_update |= {
            "inference_base_url": inference.base_url,
            "inference_model_name": inference.model_name,
        }
    await queue.finish(
        engine,
        lease,
        status=JobStatus.succeeded,
        event="training_ended",
        data={
            "start_step": start_step,
            "final_step": result.step,
            "trained": result.trained,
            "metrics": result.metrics,
        },
        earlier_events=progress.take(),
        model_update=model_update,
        final_step=result.step,
        metrics=result.metrics,
        checkpoint_path=result.checkpoint_path,
        progress_step=progress.step,
        progress_total=progress.total if progress.total is not None else progress.step,
        error=None,
    )


async def _supervise(
    train: asyncio.Task[Any],
    lease: Lease,
    progress: _Progress,
    engine: AsyncEngine,
    settings: Settings,
) -> str:
    """Heartbeat until training ends. Returns "done", "cancelled" or "lost"."""
    loop = asyncio.get_running_loop()
    next_beat = loop.time() + settings.heartbeat_seconds
    renewed = loop.time()
    try:
        while True:
            # Wake for the end of training, the next heartbeat, or new progress; progress is
            # written at most every PROGRESS_SECONDS, so fast steps batch into one write.
            wake_at = next_beat
            waiting: set[asyncio.Future[Any]] = {train}
            if progress.events:
                wake_at = min(wake_at, renewed + PROGRESS_SECONDS)
            else:
                waiting.add(asyncio.ensure_future(progress.dirty.wait()))
            await asyncio.wait(
                waiting,
                timeout=max(0.0, wake_at - loop.time()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            for waiter in waiting - {train}:
                waiter.cancel()
            if progress.events and not train.done() and loop.time() < wake_at:
                continue  # progress arrived; write it when its turn comes
            if train.done():
                train.result()  # raises the backend's error, if any
                return "done"  # pending progress events go out with the final write
            events = progress.take()
            try:
                beat = await queue.heartbeat(
                    engine,
                    lease,
                    lease_seconds=settings.lease_seconds,
                    progress=(progress.step, progress.total),
                    events=events,
                )
            except (OSError, DBAPIError) as exc:
                # The database is away (restart, failover): keep training while the lease
                # may still be ours, and try again soon.
                progress.events[:0] = events
                if loop.time() - renewed > settings.lease_seconds:
                    await _stop(train)
                    return "lost"
                log.warning("job %s: heartbeat failed (%s); retrying", lease.job_id, exc)
                next_beat = loop.time() + min(1.0, settings.heartbeat_seconds)
                continue
            renewed = loop.time()
            next_beat = renewed + settings.heartbeat_seconds
            if not beat.alive or beat.cancel_requested:
                await _stop(train)
                return "lost" if not beat.alive else "cancelled"
    except asyncio.CancelledError:
        await _stop(train)
        raise


async def _stop(train: asyncio.Task[Any]) -> None:
    train.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await train


async def _failed(engine: AsyncEngine, claim: Claim, exc: BackendError, settings: Settings) -> None:
    lease, error = claim.lease, error_dict(exc)
    log.warning("job %s attempt %d failed: %s", lease.job_id, lease.attempt, exc)
    if exc.transient:
        await queue.retry_or_fail(
            engine,
            lease,
            error=error,
            max_attempts=claim.max_attempts,
            retry_base_seconds=settings.retry_base_seconds,
        )
    else:
        await queue.finish(
            engine,
            lease,
            status=JobStatus.failed,
            event="training_failed",
            data={"error": error, "attempt": lease.attempt},
            error=error,
        )
