"""The worker loop: claim jobs, hand each to its kind's runner, recover jobs whose worker
died, serve models, shut down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
from collections.abc import Mapping

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app import __version__
from app.backends import SPECS, Backends, load_training_stack, loadable_backends
from app.backends.base import ModelSpec
from app.db import is_unavailable
from app.evaluations.runner import RUNNER as EVALUATION
from app.jobs import pools
from app.jobs.lifecycle import Cancelled, ErrorInfo, JobKind, JobStatus, Recovered, Released
from app.jobs.pools import Capabilities
from app.jobs.store import Claim, Joined, Lease, LeaseState, QueueStore
from app.jobs.supervise import KindRunner, RunContext
from app.models import ModelRow
from app.notify import Notifier
from app.rollouts.runner import RUNNER as ROLLOUT
from app.runs.driver import RunDriver
from app.runs.schedule import queues_next, run_of
from app.settings import Settings
from app.tenants import audit
from app.training.runner import RUNNER as TRAINING
from app.webhooks.sender import PRUNE_EVERY_SECONDS, WebhookSender

log = logging.getLogger(__name__)
BACKEND_TIMEOUT = 30.0  # seconds the loop waits on a backend before moving on
SERVE_RETRY_SECONDS = 30.0
RUNNERS: Mapping[JobKind, KindRunner] = {
    JobKind.training: TRAINING,
    JobKind.rollout: ROLLOUT,
    JobKind.evaluation: EVALUATION,
}


def capabilities_of(settings: Settings) -> Capabilities:
    """What a worker with these settings runs: its pool, its backends (unless told, every
    backend this process can load), its labels. ValueError for an unknown backend."""
    backends = settings.worker_backends or loadable_backends()
    unknown = [name for name in backends if name not in SPECS]
    if unknown:
        raise ValueError(f"unknown backend {', '.join(unknown)}; known: {', '.join(sorted(SPECS))}")
    return Capabilities(
        settings.worker_pool, tuple(dict.fromkeys(backends)), dict(settings.worker_labels)
    )


class Worker:
    def __init__(
        self,
        *,
        settings: Settings,
        store: QueueStore,
        backends: Backends,
        notifier: Notifier,
        capabilities: Capabilities | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.backends = backends
        self.notifier = notifier
        self.capabilities = capabilities or capabilities_of(settings)
        # Set once a drain was asked of it (through the database: `POST
        # /v1/workers/{id}/drain`, `trainyard worker --drain`): it has stopped claiming,
        # and its process stops it (`stop`), which finishes or hands back what it runs.
        self.drain_asked = asyncio.Event()
        self.draining = False
        self.hostname = socket.gethostname()
        self.id = f"{self.hostname}:{os.getpid()}:{secrets.token_hex(3)}"
        self.tasks: dict[str, tuple[Lease, asyncio.Task[None]]] = {}  # by job id
        self.last_heartbeat: float | None = None  # loop time of the last worker heartbeat
        self._stopping = asyncio.Event()
        self._models_seen = -1  # notifier.models_version last served
        # Models this process serves, with their endpoints, and those it could not serve,
        # with why; readyz checks them.
        self.serving: dict[str, str] = {}
        self.not_served: dict[str, str] = {}
        self._serve_retry_at = 0.0  # loop time to try again models that failed to serve
        self._loop_task: asyncio.Task[None] | None = None
        # Runs are advanced by every worker, between their children (`app.runs.driver`).
        self.runs = RunDriver(store=store, backends=backends, settings=settings, notifier=notifier)
        self._filling = asyncio.Lock()
        # Webhook deliveries: sent by their own loop, beside the jobs (`app.webhooks`).
        self.webhooks = WebhookSender(
            engine=store.engine, settings=settings, wake=notifier.webhooks
        )
        self._webhooks_task: asyncio.Task[None] | None = None
        self._audit_task: asyncio.Task[None] | None = None

    @property
    def engine(self) -> AsyncEngine:
        return self.store.engine

    def context(self, job_id: str, joined: Joined | None = None) -> RunContext:
        return RunContext(
            store=self.store,
            backends=self.backends,
            settings=self.settings,
            signal=lambda: self.notifier.events_appended(job_id),
            joined=joined,
        )

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Announce this worker, then run its loop in the background. A database that is
        away now (restarting, locked) does not stop it: the loop announces it once the
        database is back, as it renews every heartbeat."""
        try:
            await self._beat()
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            log.warning("worker %s: database unavailable at start (%s); retrying", self.id, exc)
        self._loop_task = asyncio.create_task(self.run(), name=f"worker:{self.id}")
        self._webhooks_task = asyncio.create_task(
            self.webhooks.run(self._stopping), name=f"webhooks:{self.id}"
        )
        self._audit_task = asyncio.create_task(self._prune_audit(), name=f"audit:{self.id}")

    async def _prune_audit(self) -> None:
        """Delete audit events past TRAINYARD_AUDIT_RETENTION_SECONDS: at start, then every
        PRUNE_EVERY_SECONDS, as the webhook sender does its log."""
        while not self._stopping.is_set():
            try:
                await audit.prune(
                    self.engine, self.settings.audit_retention_seconds, stopping=self._stopping
                )
            except Exception as exc:  # the next sweep tries again
                log.warning("audit: pruning failed (%s)", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), PRUNE_EVERY_SECONDS)

    async def _beat(self, *, stopped: bool = False) -> None:
        asked = await self.store.beat_worker(
            worker_id=self.id,
            hostname=self.hostname,
            pid=os.getpid(),
            stopped=stopped,
            draining=self.draining,
            registration=pools.registration(self.capabilities, __version__),
        )
        self.last_heartbeat = asyncio.get_running_loop().time()
        if asked and not self.drain_asked.is_set():
            log.info("worker %s: a drain was asked; it stops claiming", self.id)
            self._stopping.set()  # the loop ends; `stop` finishes or hands back the rest
            self.drain_asked.set()

    async def run(self) -> None:
        # The training stack (ART, and torch through it) loads lazily, so an API-only
        # process never pays for it. A worker needs it for its first job: load it now, off
        # the event loop, before claiming. Loaded by the first job instead, it held the
        # loop (and the job's lease renewals) for as long as the import took: 18 s on a
        # busy machine, long enough for the lease to lapse and the step to be trained twice.
        await asyncio.to_thread(load_training_stack)
        loop = asyncio.get_running_loop()
        next_recovery = 0.0
        next_beat = 0.0
        while not self._stopping.is_set():
            try:
                if loop.time() >= next_beat:
                    await self._beat()
                    next_beat = loop.time() + self.settings.heartbeat_seconds
                if (
                    self.notifier.models_version != self._models_seen
                    or 0 < self._serve_retry_at <= loop.time()
                ):
                    self._models_seen = self.notifier.models_version
                    await self.serve_models()
                if loop.time() >= next_recovery:
                    next_recovery = loop.time() + self.settings.lease_seconds / 3
                    await self.recover_expired()
                await self.runs.advance_all()
                await self.fill()
            except Exception:  # the database may be restarting; keep the loop alive
                log.exception("worker %s: loop iteration failed; retrying", self.id)
                await asyncio.sleep(min(1.0, self.settings.poll_seconds))
                continue
            # Idle: sleep until a wake-up, with jitter so many workers do not poll in step.
            timeout = self.settings.poll_seconds * random.uniform(0.8, 1.2)
            timeout = min(timeout, max(0.05, next_beat - loop.time()))
            await self.notifier.wait_for_jobs(timeout)

    async def fill(self) -> int:
        """Claim and start jobs until this worker is full or nothing is eligible."""
        async with self._filling:  # the loop and a finished run child may both fill
            return await self._fill()

    async def _fill(self) -> int:
        started = 0
        while not self._stopping.is_set():
            free = self.settings.worker_concurrency - len(self.tasks)
            if free <= 0:
                break
            claims = await self.store.claim(
                owner=self.id,
                lease_seconds=self.settings.lease_seconds,
                limit=free,
                capabilities=self.capabilities,
            )
            self.run_claims(claims)
            started += len(claims)
            if len(claims) < free:
                break  # nothing else is eligible now
        return started

    def run_claims(self, claims: list[Claim]) -> None:
        """Run claimed jobs, each in a task of its own."""
        for claim in claims:
            lease = claim.lease
            task = asyncio.create_task(self._process(claim), name=f"job:{lease.job_id}")
            self.tasks[lease.job_id] = (lease, task)

    async def claim_in(self, conn: AsyncConnection, *, slots: int | None = None) -> list[Claim]:
        """Claim in a run's move, inside its transaction; the caller starts what this
        returns once the transaction commits. `slots` None (`RunDriver.advance`): this
        worker's free slots, counted under `_filling`, which the caller holds. `slots=1`
        (`JoinedMove`, in a child's final write): the slot the child frees, which no
        other claim counts as free while the child's task lasts, in one look (a collision
        with another worker's claim fails the move, and the child's write is made alone)."""
        free = self.settings.worker_concurrency - len(self.tasks) if slots is None else slots
        if free <= 0 or self._stopping.is_set():
            return []
        return await self.store.claim_in(
            conn,
            owner=self.id,
            lease_seconds=self.settings.lease_seconds,
            limit=free,
            capabilities=self.capabilities,
            retry=slots is None,
        )

    async def _process(self, claim: Claim) -> None:
        lease = claim.lease
        # A run's child: its final write moves the run on and claims the next job into the
        # slot it frees, in one transaction (`JoinedMove`).
        run_id = run_of(lease.job_id)
        joined = None if run_id is None else self.runs.joined(run_id, lease.job_id, self)
        try:
            await self.process(claim, joined)
        except asyncio.CancelledError:
            raise
        except Exception:
            # The lease expires and recovery decides; nothing accepted is lost.
            log.exception("job %s: processing failed", lease.job_id)
        finally:
            self.tasks.pop(lease.job_id, None)
        # Where the final write did not move the run (its spec not yet read here, pruning
        # as it ends, a lost lease, a failure), start its next child now, rather than at
        # the loop's next turn (the loop would, a wake-up later). A rollout child has
        # queued its training job itself: claim that first. Then move the run on,
        # claiming whatever child the move queues in the move's own transaction.
        refilled = False
        if joined is not None and not self._stopping.is_set():
            run_id, running = joined.run_id, len(self.tasks)
            try:
                if joined.settled:
                    refilled = joined.claimed > 0
                    if joined.again:  # the next child had ended already: move on again
                        async with self._filling:
                            await self.runs.advance(run_id, claimer=self)
                else:
                    if queues_next(lease.job_id):
                        await self.fill()
                    async with self._filling:  # `claim_in` counts this worker's free slots
                        await self.runs.advance(run_id, claimer=self)
                refilled = refilled or len(self.tasks) > running
            except Exception as exc:
                if is_unavailable(exc):  # busy or restarting: the loop's next turn does it
                    log.warning("run %s: not advanced after %s: %s", run_id, lease.job_id, exc)
                else:
                    log.exception("run %s: advancing it after %s failed", run_id, lease.job_id)
        if not refilled:
            # A slot is free, the model may have more jobs: the loop claims and advances.
            # Not when the run's next child took the slot: that claim (`fill`, or the move's
            # `claim_in`) took every eligible job up to this worker's free slots, and the
            # model is busy again, so the loop's turn would only claim nothing and advance
            # the run again beside its child's start (a write each, on SQLite serialised
            # with the child's own: `bench.runs`).
            self.notifier.jobs_changed()
        self.notifier.webhooks_due()  # its end may be a webhook event

    async def process(self, claim: Claim, joined: Joined | None = None) -> None:
        await RUNNERS[claim.lease.kind].run(claim, self.context(claim.lease.job_id, joined))

    async def stop(self, grace: float = 10.0) -> None:
        """Stop claiming, let running jobs finish for `grace` seconds, then release them.
        Its row says it is draining meanwhile (`GET /v1/workers`)."""
        self._stopping.set()
        self.notifier.jobs_changed()
        self.draining = True
        with contextlib.suppress(Exception):
            await self._beat()
        if self._loop_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        running = [task for _, task in self.tasks.values()]
        if running:
            await asyncio.wait(running, timeout=grace)
        await self.runs.close()
        if self._webhooks_task is not None:  # its batch under way ends within a timeout
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._webhooks_task
        await self.webhooks.close()
        if self._audit_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._audit_task
        for lease, task in list(self.tasks.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            with contextlib.suppress(Exception):
                await self.release(lease)
        for name, base_url in self.serving.items():  # its endpoints go with this process
            if base_url:
                with contextlib.suppress(Exception):
                    await self.store.withdraw_inference(name, base_url=base_url)
        with contextlib.suppress(Exception):
            await self._beat(stopped=True)

    # -- serving ---------------------------------------------------------------------------

    async def serve_models(self) -> None:
        """Register models whose backend serves inference here (those this worker can run:
        its pool, backends, labels), so their endpoint shows before their first job.
        Failures are logged and tried again every SERVE_RETRY_SECONDS; the first job
        reports them."""
        serving = [name for name, spec in SPECS.items() if spec.serves]
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(
                        ModelRow.name,
                        ModelRow.project,
                        ModelRow.base_model,
                        ModelRow.config,
                        ModelRow.backend,
                        ModelRow.pool,
                        ModelRow.labels,
                    ).where(ModelRow.backend.in_(serving))
                )
            ).all()
        self._serve_retry_at = 0.0
        for row in rows:
            if row.name in self.serving:
                continue
            if not self.capabilities.fits(row.pool, row.backend, row.labels):
                continue  # another pool's, or a backend or label this worker lacks
            spec = ModelSpec(row.name, row.project, row.base_model, row.config)
            try:
                adapter = self.backends.get(row.backend)
                inference = await asyncio.wait_for(adapter.inference(spec), BACKEND_TIMEOUT)
            except Exception as exc:
                log.warning("model %s: cannot serve it yet: %s", row.name, exc)
                self.not_served[row.name] = str(exc)[:200]
                self._serve_retry_at = asyncio.get_running_loop().time() + SERVE_RETRY_SECONDS
                continue
            self.not_served.pop(row.name, None)
            self.serving[row.name] = inference.base_url or ""
            # Only where it is served: the step is the jobs' to write (a job may be
            # finishing on another worker right now).
            await self.store.set_inference(
                row.name,
                base_url=inference.base_url,
                model_name=inference.model_name,
                api_key=inference.api_key,
            )

    # -- recovery --------------------------------------------------------------------------

    async def settle(self, state: LeaseState, reason: ErrorInfo) -> JobStatus | None:
        """Apply the fate of a job whose lease expired, by its kind's rules; only while
        the lease is still expired (its worker did not come back)."""
        lease = state.lease
        outcome = await RUNNERS[lease.kind].settle(state, self.context(lease.job_id), reason)
        return await self.store.apply(lease, outcome, only_if_expired=True)

    async def recover_expired(self) -> dict[str, JobStatus | None]:
        """Settle running jobs whose worker stopped renewing its lease. Returns the status
        each was written in (None: its worker came back meanwhile)."""
        outcomes: dict[str, JobStatus | None] = {}
        for state in await self.store.expired():
            lease = state.lease
            reason = ErrorInfo(
                type="LeaseExpired",
                message=f"worker {lease.owner} stopped renewing its lease",
                transient=True,
            )
            try:
                outcomes[lease.job_id] = await self.settle(state, reason)
                self.notifier.events_appended(lease.job_id)
            except Exception as exc:  # one bad job must not stop recovery of the others
                log.warning("job %s: cannot settle it yet: %s", lease.job_id, exc)
        return outcomes

    async def release(self, lease: Lease) -> None:
        """Hand a job back at shutdown so another worker can take it at once, unless a
        landed step or a cancel decides its fate already."""
        state = await self.store.lease_state(lease)
        if state is None:
            return
        reason = ErrorInfo(type="Released", message=f"worker {self.id} stopped", transient=True)
        outcome = await RUNNERS[lease.kind].settle(state, self.context(lease.job_id), reason)
        if not isinstance(outcome, Recovered | Cancelled):
            outcome = Released(self.id)
        await self.store.apply(lease, outcome)
