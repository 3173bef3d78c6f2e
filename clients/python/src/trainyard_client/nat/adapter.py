"""`TrainyardTrainerAdapter`: NAT's trainer adapter over Trainyard's HTTP API (the SDK).

NAT's trainer (e.g. `openpipe_art_trainer`) hands the adapter one `TrajectoryCollection`
per epoch and waits for it to be trained before the next epoch samples again. Here each
collection becomes one Trainyard training job (one gradient step of the model), submitted
as NAT serializes it; the adapter follows the job's event stream to its end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from nat.data_models.finetuning import (
    FinetuneConfig,
    TrainingJobRef,
    TrainingJobStatus,
    TrainingStatusEnum,
    TrajectoryCollection,
)
from nat.finetuning.interfaces.trainer_adapter import TrainerAdapter

from trainyard_client import models as m
from trainyard_client._async import AsyncTrainyard
from trainyard_client._base import resolve_url
from trainyard_client._retry import RetryPolicy
from trainyard_client.errors import NotFoundError, TrainyardError, WaitTimeoutError
from trainyard_client.hyperparameters import check_hyperparameters
from trainyard_client.nat.config import TrainyardTrainerAdapterConfig
from trainyard_client.progress import Progress

logger = logging.getLogger(__name__)

BACKEND = "trainyard"

# Trainyard's job statuses as NAT names them (NAT spells `canceled` with one l).
STATUSES: dict[str, TrainingStatusEnum] = {
    m.JobStatus.queued: TrainingStatusEnum.PENDING,
    m.JobStatus.running: TrainingStatusEnum.RUNNING,
    m.JobStatus.succeeded: TrainingStatusEnum.COMPLETED,
    m.JobStatus.failed: TrainingStatusEnum.FAILED,
    m.JobStatus.cancelled: TrainingStatusEnum.CANCELED,
}


class TrainingJobFailed(RuntimeError):
    """A Trainyard job of this run failed or was cancelled."""


class TrainyardTrainerAdapter(TrainerAdapter):
    """Submits each epoch's trajectories to Trainyard as a training job and waits on it.

    - `initialize` checks that the server answers, that the model exists, that the
      hyper-parameters are ones its backend accepts and that the model's endpoint answers
      on the gateway: a mistake fails before NAT spends a rollout.
    - `submit` posts the collection with an Idempotency-Key made once per submit (NAT
      reuses one `run_id` for every epoch), so a retried request never trains twice; the
      job's id is in the returned ref's `metadata["job_id"]`.
    - `wait_until_complete` follows the job's Server-Sent Events (no polling) and
      `status` reads the job; both can be called again for any ref.
    - A job that failed or was cancelled is logged as an error and raised from
      `wait_until_complete`, which ends NAT's epoch loop with a FAILED status.
    """

    adapter_config: TrainyardTrainerAdapterConfig

    def __init__(self, adapter_config: TrainyardTrainerAdapterConfig) -> None:
        super().__init__(adapter_config)
        self.adapter_config = adapter_config
        self._instance = uuid.uuid4().hex[:12]
        self._submissions = 0
        self._jobs: dict[str, list[str]] = {}  # NAT run_id -> its job ids, in submit order

    # ----------------------------------------------------------------- clients

    @contextlib.asynccontextmanager
    async def _client(self, *, retries: int | None = None) -> AsyncIterator[AsyncTrainyard]:
        """A client for one operation: NAT leaves the builder's context (where the adapter
        was made) before it trains, so no client is held across operations."""
        config = self.adapter_config
        retry = RetryPolicy(max_retries=config.max_retries if retries is None else retries)
        # An empty key (`api_key: ${TRAINYARD_API_KEY}` with the variable unset) is no key:
        # the client then takes TRAINYARD_API_KEY, as when the block names none.
        key = (config.api_key.get_secret_value() or None) if config.api_key is not None else None
        async with AsyncTrainyard(
            config.url, api_key=key, timeout=config.request_timeout, retry=retry
        ) as client:
            yield client

    @property
    def url(self) -> str:
        return resolve_url(self.adapter_config.url)

    # ----------------------------------------------------------------- NAT's interface

    async def initialize(self, run_config: FinetuneConfig) -> None:
        await super().initialize(run_config)
        config = self.adapter_config
        async with self._client() as client:
            try:
                model = await client.models.get(config.model)
            except NotFoundError:
                raise ValueError(
                    f"Trainyard at {client.url} has no model `{config.model}`: register it "
                    "first (POST /v1/models)"
                ) from None
            backends = {backend.name: backend for backend in await client.backends.list()}
        backend = backends.get(model.backend)
        if backend is None:
            raise ValueError(
                f"model `{config.model}` is on backend `{model.backend}`, which the server "
                f"does not list ({', '.join(sorted(backends))})"
            )
        schema = backend.hyperparameters if config.method == "rl" else None
        schema = schema or backend.methods.get(config.method)
        if schema is None:
            raise ValueError(
                f"model `{config.model}` is on backend `{backend.name}`, which does not "
                f"train with `{config.method}`"
            )
        problems = check_hyperparameters(schema, config.hyperparameters)
        if problems:
            raise ValueError(
                f"hyperparameters of the trainer adapter are not accepted by backend "
                f"`{backend.name}` of model `{config.model}`: " + "; ".join(problems)
            )
        if not await self.is_healthy():
            raise RuntimeError(
                f"Trainyard at {self.url} is not healthy (see the warning above): it must be "
                f"ready and serve `{config.model}` on its gateway"
            )
        logger.info(
            "Trainyard trainer adapter: model %s (backend %s, step %d) at %s",
            model.name,
            model.backend,
            model.current_step,
            self.url,
        )

    async def is_healthy(self) -> bool:
        """The server is ready (`/readyz`) and the model's endpoint answers a one-token
        request through the gateway."""
        model = self.adapter_config.model
        async with self._client(retries=0) as client:
            try:
                ready = await client.ready()
                if ready.status != "ready":
                    failing = [name for name, check in ready.checks.items() if not check.ok]
                    logger.warning("Trainyard at %s is not ready: %s", client.url, failing)
                    return False
                await client.gateway.chat_completions(
                    model=model, messages=[{"role": "user", "content": "ping"}], max_tokens=1
                )
            except TrainyardError as exc:
                logger.warning("Trainyard at %s: %s", client.url, exc)
                return False
        return True

    async def submit(self, trajectories: TrajectoryCollection) -> TrainingJobRef:
        """One training job for the collection; the ref's `metadata["job_id"]` names it."""
        config = self.adapter_config
        run_id = trajectories.run_id
        collection = trajectories.model_dump(mode="json")
        if not collection["trajectories"]:
            raise ValueError("no trajectory groups to submit")
        self._submissions += 1
        submission = self._submissions
        # NAT sends every epoch of a run with the same run_id: the key names this submit.
        key = f"nat-{run_id[:160]}-{self._instance}-{submission}"
        metadata = {**config.metadata, "nat_run_id": run_id, "nat_submission": submission}
        async with self._client() as client:
            try:
                job = await client.training_jobs.create(
                    model=config.model,
                    # NAT's DPO trajectory builder emits DPO items: a DPO job trains them.
                    method="dpo" if _holds_dpo_items(collection) else _method(config),
                    collection=collection,
                    hyperparameters=config.hyperparameters,
                    metadata=metadata,
                    idempotency_key=key,
                )
            except TrainyardError as exc:
                logger.error("Trainyard refused the trajectories of run %s: %s", run_id, exc)
                raise
        self._jobs.setdefault(run_id, []).append(job.id)
        summary = job.summary
        if isinstance(summary, m.TrajectorySummary):
            logger.info(
                "Trainyard job %s: %d groups, %d trajectories (%d groups trainable)",
                job.id,
                summary.num_groups,
                summary.num_trajectories,
                summary.num_trainable_groups,
            )
        else:
            logger.info("Trainyard %s job %s: %s", job.method, job.id, summary.model_dump())
        return TrainingJobRef(
            run_id=run_id,
            backend=BACKEND,
            metadata={
                "job_id": job.id,
                "model": config.model,
                "url": self.url,
                "submission": submission,
                "idempotency_key": key,
            },
        )

    async def status(self, ref: TrainingJobRef) -> TrainingJobStatus:
        """Where the ref's job stands (read again on every call)."""
        async with self._client() as client:
            job = await client.training_jobs.get(self._job_id(ref))
        return self._status(ref, job)

    async def wait_until_complete(
        self, ref: TrainingJobRef, poll_interval: float = 10.0
    ) -> TrainingJobStatus:
        """Follow the job's event stream until it ends (`poll_interval` is not used: the
        server says when the job moves). Raises TrainingJobFailed when it failed or was
        cancelled, after logging why."""
        job_id = self._job_id(ref)
        output_dir = self._output_dir()

        def progressed(progress: Progress) -> None:
            if progress.event.type == m.EventType.gradient_step:
                self.log_progress(
                    ref,
                    {
                        "event": progress.event.type,
                        "step": progress.step,
                        "total": progress.total,
                        "metrics": dict(progress.metrics),
                    },
                    output_dir,
                )

        async with self._client() as client:
            try:
                job = await client.training_jobs.wait(
                    job_id, timeout=self.adapter_config.job_timeout, on_progress=progressed
                )
            except WaitTimeoutError:
                message = (
                    f"Trainyard job {job_id} had not ended after "
                    f"{self.adapter_config.job_timeout} s (it goes on)"
                )
                logger.error(message)
                raise TrainingJobFailed(message) from None
        status = self._status(ref, job)
        self.log_progress(
            ref, {"event": "job_ended", "status": job.status, **(status.metadata or {})}, output_dir
        )
        if status.status in (TrainingStatusEnum.FAILED, TrainingStatusEnum.CANCELED):
            logger.error("Trainyard job %s of run %s: %s", job_id, ref.run_id, status.message)
            raise TrainingJobFailed(status.message)
        if job.result is not None and job.result.trained is False:
            logger.warning("Trainyard job %s: %s", job_id, status.message)
        return status

    def log_progress(
        self, ref: TrainingJobRef, metrics: dict[str, Any], output_dir: str | None = None
    ) -> None:
        """Append `metrics` as a JSON line to `trainer_adapter_<run_id>.jsonl` under
        `output_dir` (default: the finetuning output_dir's `trainyard/`)."""
        directory = Path(output_dir) if output_dir else Path(self._output_dir())
        directory.mkdir(parents=True, exist_ok=True)
        line = {
            "time": time.time(),
            "run_id": ref.run_id,
            "job_id": (ref.metadata or {}).get("job_id"),
            **metrics,
        }
        with (directory / f"trainer_adapter_{ref.run_id}.jsonl").open("a") as file:
            file.write(json.dumps(line, default=str) + "\n")

    # ----------------------------------------------------------------- helpers

    def _job_id(self, ref: TrainingJobRef) -> str:
        job_id = (ref.metadata or {}).get("job_id")
        if isinstance(job_id, str):
            return job_id
        jobs = self._jobs.get(ref.run_id)
        if not jobs:
            raise ValueError(f"no Trainyard job was submitted for run {ref.run_id}")
        return jobs[-1]  # a ref without metadata: the run's latest job

    def _output_dir(self) -> str:
        base = self.run_config.output_dir if self.run_config is not None else Path(".tmp/nat")
        return str(Path(base) / "trainyard")

    def _status(self, ref: TrainingJobRef, job: m.TrainingJob) -> TrainingJobStatus:
        status = STATUSES.get(job.status, TrainingStatusEnum.RUNNING)
        progress: float | None = job.progress.percent
        if status == TrainingStatusEnum.PENDING:
            progress = 0.0
        elif status == TrainingStatusEnum.COMPLETED:
            progress = 100.0
        elif status == TrainingStatusEnum.RUNNING and progress is None:
            progress = 0.0
        result = job.result
        if job.status == m.JobStatus.succeeded and result is not None:
            message = f"succeeded: model step {result.start_step} -> {result.final_step}"
            if result.trained is False:
                message += f", nothing trained ({result.reason or 'no trainable group'})"
        elif job.status == m.JobStatus.failed:
            error = job.error
            message = f"failed: {error.type}: {error.message}" if error else "failed"
        elif job.status == m.JobStatus.running:
            total = job.progress.total
            message = f"running: gradient step {job.progress.step}/{total if total else '?'}"
        else:
            message = job.status
        metadata: dict[str, Any] = {
            "job_id": job.id,
            "trainyard_status": job.status,
            "model": job.model,
            "method": job.method,
            **job.summary.model_dump(exclude={"method"}),
        }
        if result is not None:
            metadata.update(
                start_step=result.start_step,
                final_step=result.final_step,
                trained=result.trained,
                metrics=result.metrics,
            )
        return TrainingJobStatus(
            run_id=ref.run_id,
            backend=BACKEND,
            status=status,
            progress=progress,
            message=f"Trainyard job {job.id} {message}",
            metadata=metadata,
        )


def _holds_dpo_items(collection: dict[str, Any]) -> bool:
    """Whether a NAT collection's episodes are DPO items (`prompt`, `chosen_response`,
    `rejected_response`), as NAT's DPO trajectory builder emits them."""
    return any(
        isinstance(item, dict) and "chosen_response" in item and "role" not in item
        for group in collection["trajectories"]
        for trajectory in group
        for item in trajectory.get("episode") or []
    )


def _method(config: TrainyardTrainerAdapterConfig) -> str | None:
    return None if config.method == "rl" else config.method
