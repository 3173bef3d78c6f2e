"""The worker loop: claim jobs, run them, recover jobs whose worker died, shut down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from app.backends import SPECS, Backends
from app.backends.base import ModelSpec
from app.db import utcnow, write_connection
from app.models import JobKind, JobRow, JobStatus, ModelRow
from app.notify import Notifier
from app.settings import Settings
from app.worker import queue
from app.worker.queue import Claim, Lease
from app.worker.rollout import run_rollout
from app.worker.training import run_training

log = logging.getLogger(__name__)
BACKEND_TIMEOUT = 30.0  # seconds the loop waits on a backend before moving on


class Worker:
    def __init__(
        self,
        *,
        settings: Settings,
        engine: AsyncEngine,
        backends: Backends,
        notifier: Notifier,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.backends = backends
        self.notifier = notifier
        self.hostname = socket.gethostname()
        self.id = f"{self.hostname}:{os.getpid()}:{secrets.token_hex(3)}"
        self.tasks: dict[str, tuple[Lease, asyncio.Task[None]]] = {}  # by job id
        self.last_heartbeat: float | None = None  # loop time of the last worker heartbeat
        self._stopping = asyncio.Event()
        self._models_seen = -1  # notifier.models_version last served
        self._served: set[str] = set()
        self._loop_task: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Announce this worker, then run its loop in the background."""
        await self._beat()
        self._loop_task = asyncio.create_task(self.run(), name=f"worker:{self.id}")

    async def _beat(self) -> None:
        await queue.beat_worker(
            self.engine, worker_id=self.id, hostname=self.hostname, pid=os.getpid()
        )
        self.last_heartbeat = asyncio.get_running_loop().time()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_recovery = 0.0
        next_beat = 0.0
        while not self._stopping.is_set():
            try:
                if loop.time() >= next_beat:
                    await self._beat()
                    next_beat = loop.time() + self.settings.heartbeat_seconds
                if self.notifier.models_version != self._models_seen:
                    self._models_seen = self.notifier.models_version
                    await self.serve_models()
                if loop.time() >= next_recovery:
                    next_recovery = loop.time() + self.settings.lease_seconds / 3
                    await self.recover_expired()
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
        started = 0
        while not self._stopping.is_set():
            free = self.settings.worker_concurrency - len(self.tasks)
            if free <= 0:
                break
            claims = await queue.claim(
                self.engine, owner=self.id, lease_seconds=self.settings.lease_seconds, limit=free
            )
            for claim in claims:
                lease = claim.lease
                task = asyncio.create_task(self._process(claim), name=f"job:{lease.job_id}")
                self.tasks[lease.job_id] = (lease, task)
            started += len(claims)
            if len(claims) < free:
                break  # nothing else is eligible now
        return started

    async def _process(self, claim: Claim) -> None:
        lease = claim.lease
        try:
            await self.process(claim)
        except asyncio.CancelledError:
            raise
        except Exception:
            # The lease expires and recovery decides; nothing accepted is lost.
            log.exception("job %s: processing failed", lease.job_id)
        finally:
            self.tasks.pop(lease.job_id, None)
            self.notifier.jobs_changed()  # a slot is free; the model may have more jobs

    async def process(self, claim: Claim) -> None:
        job_id = claim.lease.job_id
        run = run_rollout if claim.lease.kind == JobKind.rollout.value else run_training
        await run(
            claim,
            engine=self.engine,
            backends=self.backends,
            settings=self.settings,
            signal=lambda: self.notifier.events_appended(job_id),
        )

    async def stop(self, grace: float = 10.0) -> None:
        """Stop claiming, let running jobs finish for `grace` seconds, then release them."""
        self._stopping.set()
        self.notifier.jobs_changed()
        if self._loop_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        running = [task for _, task in self.tasks.values()]
        if running:
            await asyncio.wait(running, timeout=grace)
        for lease, task in list(self.tasks.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            with contextlib.suppress(Exception):
                await self.release(lease)
        with contextlib.suppress(Exception):
            await queue.beat_worker(
                self.engine,
                worker_id=self.id,
                hostname=self.hostname,
                pid=os.getpid(),
                stopped=True,
            )

    # -- serving ---------------------------------------------------------------------------

    async def serve_models(self) -> None:
        """Register models whose backend serves inference here, so their endpoint shows
        before their first job. Failures are logged; the first job reports them."""
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
                    ).where(ModelRow.backend.in_(serving))
                )
            ).all()
        for row in rows:
            if row.name in self._served:
                continue
            self._served.add(row.name)
            spec = ModelSpec(row.name, row.project, row.base_model, row.config)
            try:
                adapter = self.backends.get(row.backend)
                inference = await asyncio.wait_for(adapter.inference(spec), BACKEND_TIMEOUT)
            except Exception as exc:
                log.warning("model %s: cannot serve it yet: %s", row.name, exc)
                continue
            # Only where it is served: the step is the jobs' to write (a job may be
            # finishing on another worker right now).
            async with write_connection(self.engine) as conn:
                await conn.execute(
                    update(ModelRow)
                    .where(ModelRow.name == row.name)
                    .values(
                        inference_base_url=inference.base_url,
                        inference_model_name=inference.model_name,
                    )
                )

    # -- recovery --------------------------------------------------------------------------

    async def _model_step(self, model_name: str) -> int:
        async with self.engine.connect() as conn:
            model = (
                await conn.execute(
                    select(
                        ModelRow.project, ModelRow.base_model, ModelRow.config, ModelRow.backend
                    ).where(ModelRow.name == model_name)
                )
            ).one()
        spec = ModelSpec(model_name, model.project, model.base_model, model.config)
        adapter = self.backends.get(model.backend)
        return await asyncio.wait_for(adapter.get_step(spec), BACKEND_TIMEOUT)

    async def settle(
        self,
        lease: Lease,
        *,
        start_step: int | None,
        cancel_requested: bool,
        max_attempts: int,
        reason: dict[str, object],
        expired_before: datetime | None = None,
    ) -> str:
        """Decide the fate of a job whose worker is gone: counted once, retried or failed."""
        step = await self._model_step(lease.model_name)
        if start_step is not None and step > start_step:
            # The step happened before the worker died: count it, never train it again.
            done = await queue.finish(
                self.engine,
                lease,
                status=JobStatus.succeeded,
                event="training_ended",
                data={"start_step": start_step, "final_step": step, "recovered": True},
                model_update={"current_step": step, "step_known": True},
                final_step=step,
                recovered=True,
                error=None,
                expired_before=expired_before,
            )
            return "recovered" if done else "skipped"
        if cancel_requested:
            done = await queue.finish(
                self.engine,
                lease,
                status=JobStatus.cancelled,
                event="job_cancelled",
                data={"while": "recovering"},
                expired_before=expired_before,
            )
            return "cancelled" if done else "skipped"
        status = await queue.retry_or_fail(
            self.engine,
            lease,
            error={**reason, "transient": True},
            max_attempts=max_attempts,
            retry_base_seconds=self.settings.retry_base_seconds,
            expired_before=expired_before,
        )
        outcomes = {
            JobStatus.queued: "retried",
            JobStatus.failed: "failed",
            JobStatus.cancelled: "cancelled",
        }
        return outcomes.get(status, "skipped") if status is not None else "skipped"

    async def recover_expired(self) -> dict[str, str]:
        now = utcnow()
        outcomes: dict[str, str] = {}
        for expired in await queue.expired_leases(self.engine, now=now):
            try:
                outcomes[expired.lease.job_id] = await self.settle(
                    expired.lease,
                    start_step=expired.start_step,
                    cancel_requested=expired.cancel_requested,
                    max_attempts=expired.max_attempts,
                    reason={
                        "type": "LeaseExpired",
                        "message": f"worker {expired.lease.owner} stopped renewing its lease",
                    },
                    expired_before=now,
                )
                self.notifier.events_appended(expired.lease.job_id)
            except Exception as exc:  # one bad job must not stop recovery of the others
                log.warning("job %s: cannot settle it yet: %s", expired.lease.job_id, exc)
        return outcomes

    async def release(self, lease: Lease) -> None:
        """Hand a job back at shutdown so another worker can take it at once."""
        async with self.engine.connect() as conn:
            job = (
                await conn.execute(
                    select(JobRow.start_step, JobRow.cancel_requested, JobRow.max_attempts).where(
                        JobRow.id == lease.job_id, JobRow.lease_token == lease.token
                    )
                )
            ).one_or_none()
        if job is None:
            return
        start_step, cancel, max_attempts = job.start_step, job.cancel_requested, job.max_attempts
        step = await self._model_step(lease.model_name)
        if (start_step is not None and step > start_step) or cancel:
            await self.settle(
                lease,
                start_step=start_step,
                cancel_requested=cancel,
                max_attempts=max_attempts,
                reason={},
            )
            return
        await queue.finish(
            self.engine,
            lease,
            status=JobStatus.queued,
            event="job_released",
            data={"worker": self.id},
            lease_owner=None,
            not_before=utcnow(),
            attempts=lease.attempt - 1,  # the token held: attempts is the lease's
        )
