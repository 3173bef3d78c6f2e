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
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.backends import Backends
from app.backends.base import BackendError, ModelSpec
from app.db import transaction
from app.models import JobRow, JobStatus, ModelRow
from app.services.jobs import load_groups
from app.settings import Settings
from app.worker import queue
from app.worker.queue import Lease

log = logging.getLogger(__name__)


@dataclass
class _Progress:
    """Gradient-step progress collected from the backend, flushed on the next heartbeat."""

    step: int = 0
    total: int | None = None
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    dirty: asyncio.Event = field(default_factory=asyncio.Event)

    def __call__(self, step: int, total: int | None, metrics: dict[str, float]) -> None:
        self.step, self.total = step, total
        self.events.append(("gradient_step", {"step": step, "total": total, "metrics": metrics}))
        self.dirty.set()

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        events, self.events = self.events, []
        self.dirty.clear()
        return events


def error_dict(exc: BackendError) -> dict[str, Any]:
    return {
        "type": type(exc.__cause__ or exc).__name__,
        "message": str(exc),
        "transient": exc.transient,
    }


async def _load(
    sessions: async_sessionmaker[AsyncSession], lease: Lease
) -> tuple[JobRow, ModelSpec, str]:
    async with transaction(sessions) as session:
        job = await session.get(JobRow, lease.job_id)
        model = await session.get(ModelRow, lease.model_name)
        assert job is not None and model is not None
        spec = ModelSpec(model.name, model.project, model.base_model, model.config)
        return job, spec, model.backend


async def run_training(
    lease: Lease,
    *,
    sessions: async_sessionmaker[AsyncSession],
    backends: Backends,
    settings: Settings,
) -> None:
    job, spec, backend_name = await _load(sessions, lease)
    try:
        adapter = backends.get(backend_name)
        groups = await asyncio.to_thread(load_groups, job)
        start_step = await adapter.get_step(spec)
    except BackendError as exc:
        await _failed(sessions, lease, exc, max_attempts=job.max_attempts, settings=settings)
        return
    if not await queue.record_start(
        sessions, lease, start_step=start_step, data={"groups": len(groups)}
    ):
        log.warning("job %s: lease lost before training; discarding", lease.job_id)
        return
    progress = _Progress()
    train = asyncio.create_task(
        adapter.train(spec, groups, job.hyperparameters, on_progress=progress),
        name=f"train:{lease.job_id}",
    )
    try:
        outcome = await _supervise(train, lease, progress, sessions, settings)
    except BackendError as exc:
        await _failed(sessions, lease, exc, max_attempts=job.max_attempts, settings=settings)
        return
    if outcome == "lost":
        log.warning("job %s: lease lost while training; result discarded", lease.job_id)
        return
    if outcome == "cancelled":
        await queue.finish(
            sessions,
            lease,
            status=JobStatus.cancelled,
            event="job_cancelled",
            data={"while": "running", "step": progress.step},
        )
        return
    result = train.result()
    inference = None
    with contextlib.suppress(BackendError):
        inference = await adapter.inference(spec)
    model_update: dict[str, Any] = {"current_step": result.step}
    if inference is not None:
        model_update |= {
            "inference_base_url": inference.base_url,
            "inference_model_name": inference.model_name,
        }
    await queue.finish(
        sessions,
        lease,
        status=JobStatus.succeeded,
        event="training_ended",
        data={
            "start_step": start_step,
            "final_step": result.step,
            "trained": result.trained,
            "metrics": result.metrics,
        },
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
    sessions: async_sessionmaker[AsyncSession],
    settings: Settings,
) -> str:
    """Heartbeat until training ends. Returns "done", "cancelled" or "lost"."""
    loop = asyncio.get_running_loop()
    next_beat = loop.time() + settings.heartbeat_seconds
    renewed = loop.time()
    try:
        while True:
            dirty = asyncio.create_task(progress.dirty.wait())
            await asyncio.wait(
                {train, dirty},
                timeout=max(0.0, next_beat - loop.time()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            dirty.cancel()
            if train.done() and not progress.events:
                train.result()  # raises the backend's error, if any
                return "done"
            events = progress.take()
            try:
                beat = await queue.heartbeat(
                    sessions,
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


async def _failed(
    sessions: async_sessionmaker[AsyncSession],
    lease: Lease,
    exc: BackendError,
    *,
    max_attempts: int,
    settings: Settings,
) -> None:
    error = error_dict(exc)
    log.warning("job %s attempt %d failed: %s", lease.job_id, lease.attempt, exc)
    if exc.transient:
        await queue.retry_or_fail(
            sessions,
            lease,
            error=error,
            max_attempts=max_attempts,
            retry_base_seconds=settings.retry_base_seconds,
        )
    else:
        await queue.finish(
            sessions,
            lease,
            status=JobStatus.failed,
            event="training_failed",
            data={"error": error, "attempt": lease.attempt},
            error=error,
        )
