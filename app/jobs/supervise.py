"""Running a claimed job: what a kind's runner gets (`RunContext`), the progress it reports
(`Progress`), and the supervision every run shares (`supervise`): heartbeats that renew the
lease and carry progress, and the cancel flag read back on each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from app.backends import Backends
from app.backends.base import BackendError
from app.db import is_unavailable
from app.jobs.lifecycle import (
    VOCABULARY,
    Cancelled,
    ErrorInfo,
    Event,
    EventType,
    Failed,
    JobStatus,
    JobUpdate,
    Outcome,
    Retry,
    retry_or_fail,
)
from app.jobs.store import Claim, Joined, Lease, LeaseState, QueueStore
from app.settings import Settings

log = logging.getLogger(__name__)
PROGRESS_SECONDS = 0.25


@dataclass(frozen=True)
class RunContext:
    """What a runner works with. `signal` is called after each write of events (it wakes
    this process's event streams). `joined`: work the job's final write does in its
    transaction (a run's child: the run's next move)."""

    store: QueueStore
    backends: Backends
    settings: Settings
    signal: Callable[[], None] = lambda: None
    joined: Joined | None = None

    async def apply(
        self, lease: Lease, outcome: Outcome, *, earlier: Sequence[Event] = ()
    ) -> JobStatus | None:
        """The job's final write (`QueueStore.apply`), with the joined work."""
        return await self.store.apply(lease, outcome, earlier=earlier, joined=self.joined)


@dataclass(frozen=True)
class KindRunner:
    """One kind of job's rules for the worker.

    `run`: run a claimed job to its outcome and apply it (the runner applies it itself,
    since the work may end in several steps: a start record, progress, the end).
    `settle`: the outcome of a job whose worker is gone (lease expired, or released at
    shutdown while a cancel or a landed step was pending); `reason` is why.
    """

    run: Callable[[Claim, RunContext], Awaitable[None]]
    settle: Callable[[LeaseState, RunContext, ErrorInfo], Awaitable[Outcome]]


@dataclass
class Progress:
    """Progress reported by the work, flushed (as events) with the next write.

    `coalesce`: keep only the newest event between writes (rollouts report every sample).
    """

    event: EventType
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


def error_info(exc: BackendError) -> ErrorInfo:
    return ErrorInfo(
        type=type(exc.__cause__ or exc).__name__, message=str(exc), transient=exc.transient
    )


def failure(exc: BackendError, claim: Claim, settings: Settings) -> Retry | Failed:
    """The outcome of a run that failed with `exc`: retried while transient and attempts
    are left, else failed."""
    lease = claim.lease
    log.warning("job %s attempt %d failed: %s", lease.job_id, lease.attempt, exc)
    return retry_or_fail(
        error_info(exc),
        attempt=lease.attempt,
        max_attempts=claim.max_attempts,
        retry_base_seconds=settings.retry_base_seconds,
    )


def gone(reason: ErrorInfo, state: LeaseState, settings: Settings) -> Retry | Failed:
    """The outcome of a job whose worker is gone and that did nothing that counts."""
    return retry_or_fail(
        reason,
        attempt=state.lease.attempt,
        max_attempts=state.max_attempts,
        retry_base_seconds=settings.retry_base_seconds,
    )


def with_used(outcome: Outcome | None, used: JobUpdate) -> Outcome | None:
    """`outcome` carrying what its attempt used (the tokens it sampled) unless it says so
    already: a retry, a failure or a cancel part of the way through used them too, and
    the final write adds them to the job's (`lifecycle.ADDED_COLUMNS`)."""
    if isinstance(outcome, Retry | Failed | Cancelled) and not used.keys() & outcome.job.keys():
        return replace(outcome, job={**outcome.job, **used})
    return outcome


def started_event(lease: Lease, start_step: int, data: dict[str, Any]) -> Event:
    """The start event of the lease's kind: the model's step the work starts from."""
    started = VOCABULARY[lease.kind].started
    return (started, {"start_step": start_step, "attempt": lease.attempt, **data})


Supervised = Literal["done", "cancelled", "lost"]


async def supervise(
    work: asyncio.Task[Any], lease: Lease, progress: Progress, ctx: RunContext
) -> Supervised:
    """Heartbeat until the work ends. Returns "done", "cancelled" or "lost"; the work's
    own error, if any, is raised."""
    settings = ctx.settings
    loop = asyncio.get_running_loop()
    renewed = loop.time()  # when the lease was last known to be extended
    next_beat = renewed + settings.heartbeat_seconds
    # Progress is written at most every PROGRESS_SECONDS; work quicker than that writes
    # its events with the final write.
    next_write = renewed + PROGRESS_SECONDS
    while True:
        # Wake for the end of the work, the next heartbeat, or new progress; fast steps
        # batch into one write.
        wake_at = next_beat
        waiting: set[asyncio.Future[Any]] = {work}
        if progress.events:
            wake_at = min(wake_at, next_write)
        else:
            waiting.add(asyncio.ensure_future(progress.dirty.wait()))
        await asyncio.wait(
            waiting, timeout=max(0.0, wake_at - loop.time()), return_when=asyncio.FIRST_COMPLETED
        )
        for waiter in waiting - {work}:
            waiter.cancel()
        if work.done():
            work.result()  # raises the work's error, if any
            return "done"  # pending progress events go out with the final write
        if loop.time() < wake_at and not (progress.events and loop.time() >= next_write):
            continue
        events = progress.take()
        attempt = loop.time()
        try:
            beat = await ctx.store.heartbeat(
                lease,
                lease_seconds=settings.lease_seconds,
                progress=(progress.step, progress.total),
                events=events,
            )
        except Exception as exc:
            if not is_unavailable(exc):
                raise  # the caller stops the work and settles the job
            # The database is away (restart, failover): keep working while the lease may
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
            ctx.signal()
        if not beat.alive:
            return "lost"
        if beat.cancel_requested:
            return "cancelled"
