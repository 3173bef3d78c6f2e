"""The asynchronous client: `_sync.py`'s client, method for method, with `await`."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Generic, TypeVar, cast

import httpx

from trainyard_client import _calls as calls
from trainyard_client import models as m
from trainyard_client._base import (
    DEFAULT_TIMEOUT,
    deadline_of,
    headers,
    operation,
    remaining,
    resolve_api_key,
    resolve_url,
    sink,
    stream_timeout,
    timeout_of,
)
from trainyard_client._calls import Call, JobKind
from trainyard_client._retry import Attempts, RetryPolicy
from trainyard_client.errors import ConflictError, TrainyardConnectionError, error_for
from trainyard_client.progress import Progress, ProgressTracker, SSEDecoder

T = TypeVar("T")
J = TypeVar("J", m.TrainingJob, m.RolloutJob, m.EvaluationJob, m.Run)


class AsyncTrainyard:
    """A client of one Trainyard server.

    `url` and `api_key` default to `TRAINYARD_URL` and `TRAINYARD_API_KEY` (then
    http://127.0.0.1:8000, no key); `api_key` holds the key every call sends, for an OpenAI
    client of the gateway (`openai_base_url`). Requests that fail to connect, or get a 429
    or 503, are sent again after a backoff (`retry`); so are reads and idempotent writes
    whose connection broke. Errors are `trainyard_client.errors.APIError` subclasses.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = resolve_url(url)
        self.retry = retry or RetryPolicy()
        self.timeout = timeout_of(timeout)
        self._http = http_client or httpx.AsyncClient(timeout=self.timeout)
        self._owns_http = http_client is None  # a client passed in is the caller's to close
        self.api_key = resolve_api_key(api_key)
        self._headers = headers(self.api_key)
        self.backends = Backends(self)
        self.models = Models(self)
        self.checkpoints = Checkpoints(self)
        self.aliases = Aliases(self)
        self.retention = Retention(self)
        self.training_jobs = TrainingJobs(self)
        self.rollout_jobs = RolloutJobs(self)
        self.evaluations = EvaluationJobs(self)
        self.runs = Runs(self)
        self.datasets = Datasets(self)
        self.webhooks = Webhooks(self)
        self.workers = Workers(self)
        self.projects = Projects(self)
        self.audit_events = AuditEvents(self)
        self.usage = UsageLedger(self)
        self.gateway = Gateway(self)

    @property
    def openai_base_url(self) -> str:
        """The OpenAI-compatible gateway (`/openai/v1`), for an OpenAI client."""
        return f"{self.url}/openai/v1"

    @operation("health-healthz")
    async def health(self) -> m.Liveness:
        return await self._send(calls.healthz())

    @operation("health-readyz")
    async def ready(self) -> m.Readiness:
        """Readiness; `status` is `ready` or `unavailable` (with the failing checks)."""
        return await self._send(calls.readyz())

    @operation("health-metrics")
    async def metrics(self) -> str:
        """Prometheus metrics, as text."""
        return await self._send(calls.metrics())

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncTrainyard:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ----------------------------------------------------------------- sending

    async def _request(
        self, call: Call[Any], *, stream: bool = False, timeout: httpx.Timeout | None = None
    ) -> tuple[httpx.Response, Attempts]:
        """Send `call`, again after each failure the retry policy allows; the last answer
        and how the sends went."""
        sent = Attempts()
        while True:
            sent.count += 1
            request = self._http.build_request(
                call.method,
                self.url + call.path,
                params=list(call.params) or None,
                json=call.json,
                content=call.content,
                headers={**self._headers, **call.headers},
                timeout=timeout or self.timeout,
            )
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                delay = self.retry.after_error(call, exc, sent)
                if delay is None:
                    raise TrainyardConnectionError(
                        f"{call.method} {self.url}{call.path}: {type(exc).__name__}: {exc}",
                        attempts=sent.count,
                    ) from exc
                await asyncio.sleep(delay)
                continue
            delay = self.retry.after_response(call, response, sent)
            if delay is None:
                return response, sent
            await response.aclose()
            await asyncio.sleep(delay)

    async def _send(self, call: Call[T]) -> T:
        response, sent = await self._request(call)
        status = response.status_code
        if response.is_success or status in call.accept:
            return call.parse(response)
        if sent.doubtful and status in call.already_done:
            return call.parse(response)  # a copy whose answer was lost did it
        raise error_for(response, attempts=sent.count, doubtful=sent.doubtful)

    async def _open(self, call: Call[Any], timeout: httpx.Timeout | None = None) -> httpx.Response:
        """A streamed answer, its status checked; the caller closes it."""
        response, sent = await self._request(call, stream=True, timeout=timeout)
        if not response.is_success:
            await response.aread()
            await response.aclose()
            raise error_for(response, attempts=sent.count, doubtful=sent.doubtful)
        return response


class _Resource:
    def __init__(self, client: AsyncTrainyard) -> None:
        self._client = client

    async def _send(self, call: Call[T]) -> T:
        return await self._client._send(call)


class Backends(_Resource):
    @operation("backends-list")
    async def list(self) -> builtins.list[m.Backend]:
        """Trainer backends, with the JSON Schema of their hyper-parameters and config."""
        return await self._send(calls.backends_list())


class Models(_Resource):
    @operation("models-create")
    async def create(
        self,
        *,
        name: str,
        base_model: str,
        backend: str,
        project: str | None = None,
        config: Mapping[str, Any] | None = None,
        pool: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> m.Model:
        """Register a model (the same one again returns it; a different one by that name
        is a ConflictError). `pool`, `labels`: which workers run its jobs (a worker of
        that pool, running its backend, with every label)."""
        return await self._send(
            calls.models_create(
                name=name,
                base_model=base_model,
                backend=backend,
                project=project,
                config=config,
                pool=pool,
                labels=labels,
            )
        )

    @operation("models-get")
    async def get(self, name: str) -> m.Model:
        return await self._send(calls.models_get(name))

    @operation("models-tinker_metrics")
    async def tinker_metrics(
        self, name: str, *, after: int | None = None, limit: int | None = None
    ) -> m.Page[m.TinkerStep]:
        """A Tinker training run's optimizer steps: loss and learning rate per step."""
        return await self._send(calls.models_tinker_metrics(name, after=after, limit=limit))

    @operation("models-list")
    async def list(self, *, after: str | None = None, limit: int | None = None) -> m.Page[m.Model]:
        return await self._send(calls.models_list(after=after, limit=limit))

    def iterate(self, *, limit: int | None = None) -> AsyncIterator[m.Model]:
        """Every model, page after page."""
        return _pages(lambda after: self.list(after=after, limit=limit))


class Checkpoints(_Resource):
    @operation("checkpoints-list")
    async def list(
        self, model: str, *, after: str | None = None, limit: int | None = None
    ) -> m.Page[m.Checkpoint]:
        """The model's checkpoints on disk, newest first."""
        return await self._send(calls.checkpoints_list(model, after=after, limit=limit))

    def iterate(self, model: str, *, limit: int | None = None) -> AsyncIterator[m.Checkpoint]:
        return _pages(lambda after: self.list(model, after=after, limit=limit))

    @operation("checkpoints-get")
    async def get(self, model: str, step: int) -> m.Checkpoint:
        return await self._send(calls.checkpoints_get(model, step))

    @operation("checkpoints-delete")
    async def delete(self, model: str, step: int) -> None:
        """Delete a step's checkpoint (ConflictError while it is protected)."""
        await self._send(calls.checkpoints_delete(model, step))

    @operation("checkpoints-export")
    async def export(
        self, model: str, step: int, to: str | Path | IO[bytes], *, format: str = "tar.gz"
    ) -> int:
        """Write the step's LoRA adapter archive (`tar.gz` or `zip`), or with `merged` the
        base model with the adapter merged in (a Hugging Face directory in a tar), to a path
        or a binary file; returns the bytes written."""
        call = calls.checkpoints_export(model, step, format=format)
        response = await self._client._open(call)
        written = 0
        async with contextlib.aclosing(response):
            with sink(to) as out:
                async for chunk in response.aiter_bytes():
                    out.write(chunk)
                    written += len(chunk)
        return written


class Aliases(_Resource):
    @operation("checkpoints-list_aliases")
    async def list(
        self, model: str, *, after: str | None = None, limit: int | None = None
    ) -> m.Page[m.Alias]:
        return await self._send(calls.aliases_list(model, after=after, limit=limit))

    @operation("checkpoints-set_alias")
    async def set(self, model: str, alias: str, *, step: int) -> m.Alias:
        """Point `alias` at `step` (`name@alias` at the gateway)."""
        return await self._send(calls.aliases_set(model, alias, step=step))

    @operation("checkpoints-delete_alias")
    async def delete(self, model: str, alias: str) -> None:
        await self._send(calls.aliases_delete(model, alias))


class Retention(_Resource):
    @operation("checkpoints-get_retention")
    async def get(self, model: str) -> m.RetentionPolicy:
        return await self._send(calls.retention_get(model))

    @operation("checkpoints-set_retention")
    async def set(
        self,
        model: str,
        *,
        keep_last: int,
        keep_best_by: str | None = None,
        higher_is_better: bool | None = None,
    ) -> m.RetentionPolicy:
        return await self._send(
            calls.retention_set(
                model,
                keep_last=keep_last,
                keep_best_by=keep_best_by,
                higher_is_better=higher_is_better,
            )
        )

    @operation("checkpoints-delete_retention")
    async def delete(self, model: str) -> None:
        await self._send(calls.retention_delete(model))

    @operation("checkpoints-apply_retention")
    async def apply(self, model: str) -> m.RetentionRun:
        return await self._send(calls.retention_apply(model))


class _Followed(_Resource, Generic[J]):
    """What every kind of job shares (training, rollout, run): read, cancel, events, wait."""

    kind: JobKind

    @operation("{jobs}-get")
    async def get(self, job_id: str) -> J:
        return cast(J, await self._send(calls.jobs_get(self.kind, job_id)))

    @operation("{jobs}-cancel")
    async def cancel(self, job_id: str) -> J:
        """Queued: cancelled at once. Running: its worker interrupts it (the job says
        `cancel_requested` until it has). Finished: ConflictError."""
        try:
            return cast(J, await self._send(calls.jobs_cancel(self.kind, job_id)))
        except ConflictError as exc:
            # A resent cancel whose first copy did cancel the job: that is the answer.
            if exc.doubtful:
                job = await self.get(job_id)
                if job.status == m.JobStatus.cancelled:
                    return job
            raise

    @operation("{jobs}-events")
    async def list_events(
        self, job_id: str, *, after: int | None = None, limit: int | None = None
    ) -> m.Page[m.JobEvent]:
        """One page of the job's event log (`after`: a seq)."""
        return await self._send(calls.jobs_events(self.kind, job_id, after=after, limit=limit))

    @operation("{jobs}-stream")
    async def events(
        self, job_id: str, *, after: int = 0, timeout: float | None = None
    ) -> AsyncIterator[m.JobEvent]:
        """The job's events after seq `after`, live from its Server-Sent-Events stream,
        until the one that ends the job. A stream that breaks, or that the server ends
        before the job has, is opened again from the last event received (`Last-Event-ID`).
        `timeout`: seconds in all, then WaitTimeoutError (the job goes on)."""
        client = self._client
        deadline = deadline_of(timeout)
        cursor, failures, quiet = after, 0, 0
        while True:
            left = remaining(deadline, job_id)
            received = False
            call = calls.jobs_stream(self.kind, job_id, after=cursor)
            limit = stream_timeout(client.timeout, left, calls.STREAM_READ_SECONDS)
            try:
                async with contextlib.aclosing(await client._open(call, limit)) as response:
                    decoder = SSEDecoder()
                    async for line in response.aiter_lines():
                        sse = decoder.feed(line)
                        if sse is None:
                            continue
                        event = m.JobEvent.model_validate_json(sse.data)
                        cursor, received, failures = event.seq, True, 0
                        yield event
                        if event.type in m.FINAL_EVENTS:
                            return
            except httpx.TransportError as exc:
                failures += 1
                remaining(deadline, job_id)
                if failures > client.retry.max_retries:
                    raise TrainyardConnectionError(
                        f"the event stream of {job_id} kept breaking: {exc}", attempts=failures
                    ) from exc
                await asyncio.sleep(client.retry.backoff(failures))
                continue
            if not received:
                if (await self.get(job_id)).done:
                    return  # the job had ended and every event was read
                # Ended with nothing while the job runs (the server's 5-minute limit, or a
                # proxy's): open it again, but never in a tight loop.
                quiet += 1
                await asyncio.sleep(client.retry.backoff(min(quiet, 6)))
            else:
                quiet = 0

    async def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_progress: Callable[[Progress], object] | None = None,
    ) -> J:
        """Follow the job's events until it ends and return it, finished (check
        `status`). `on_progress` is called (and awaited, if it is a coroutine function)
        after each event with where the job stands.
        `timeout`: seconds, then WaitTimeoutError (the job goes on)."""
        job = await self.get(job_id)
        if job.done and on_progress is None:
            return job
        tracker = ProgressTracker(job_id)
        async for event in self.events(job_id, timeout=timeout):
            progress = tracker.update(event)
            if on_progress is not None:
                called = on_progress(progress)
                if inspect.isawaitable(called):
                    await called
        return await self.get(job_id)


class _Jobs(_Followed[J]):
    """Training and rollout jobs: listed with label filters."""

    @operation("{jobs}-list")
    async def list(
        self,
        *,
        status: str | None = None,
        model: str | None = None,
        metadata: Mapping[str, str | int | float | bool] | None = None,
        after: str | None = None,
        limit: int | None = None,
    ) -> m.Page[J]:
        """Newest first; `metadata` keeps jobs with each label (`{"experiment": "a"}`)."""
        call = calls.jobs_list(
            self.kind, status=status, model=model, metadata=metadata, after=after, limit=limit
        )
        return cast("m.Page[J]", await self._send(call))

    def iterate(
        self,
        *,
        status: str | None = None,
        model: str | None = None,
        metadata: Mapping[str, str | int | float | bool] | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[J]:
        return _pages(
            lambda after: self.list(
                status=status, model=model, metadata=metadata, after=after, limit=limit
            )
        )


class TrainingJobs(_Jobs[m.TrainingJob]):
    kind: JobKind = "training"

    @operation("training_jobs-create")
    async def create(
        self,
        *,
        model: str,
        collection: Mapping[str, Any] | None = None,
        groups: Sequence[Mapping[str, Any]] | None = None,
        hyperparameters: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        policy_step: int | None = None,
        max_steps_off_policy: int | None = None,
        idempotency_key: str | None = None,
        method: str | None = None,
        examples: Sequence[Mapping[str, Any]] | None = None,
        dataset: Mapping[str, Any] | None = None,
        pairs: Sequence[Mapping[str, Any]] | None = None,
    ) -> m.TrainingJob:
        """Submit one training step. RL (`method` left out, or `"rl"`): trajectories, a
        NAT `collection` or ART-style `groups`. `method="sft"`: chat `examples`
        (`{"messages": [...]}`; the assistant turns are the targets) or a `dataset`
        split (`{"id": "ds_…", "split": "train"}`). `method="dpo"`: preference `pairs`
        (`{"prompt": [...], "chosen": "…", "rejected": "…"}`) or a NAT `collection` of
        DPO items. `hyperparameters`: the model's backend's keywords for that method
        (`GET /v1/backends`). Sent with an Idempotency-Key (`idempotency_key`, else one
        made for this call) that every retry repeats: a retried submit never makes a
        second job, and submitting again with the same key and body returns the same job."""
        return await self._send(
            calls.training_jobs_create(
                model=model,
                collection=collection,
                groups=groups,
                hyperparameters=hyperparameters,
                metadata=metadata,
                policy_step=policy_step,
                max_steps_off_policy=max_steps_off_policy,
                idempotency_key=idempotency_key,
                method=method,
                examples=examples,
                dataset=dataset,
                pairs=pairs,
            )
        )

    @operation("training_jobs-trajectories")
    async def trajectories(self, job_id: str, *, shape: str | None = None) -> dict[str, Any]:
        """What the job was given: `{"groups": [...]}`, or with `shape="nat"` a NAT
        `TrajectoryCollection`."""
        call = calls.jobs_trajectories(self.kind, job_id, shape=shape)
        return cast(dict[str, Any], await self._send(call))


class RolloutJobs(_Jobs[m.RolloutJob]):
    kind: JobKind = "rollout"

    @operation("rollout_jobs-create")
    async def create(
        self,
        *,
        model: str,
        examples: Sequence[Mapping[str, Any]],
        num_generations: int | None = None,
        sampling: Mapping[str, Any] | None = None,
        grader: Mapping[str, Any] | None = None,
        agent: Mapping[str, Any] | None = None,
        concurrency: int | None = None,
        train: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> m.RolloutJob:
        """Sample and grade answers for `examples` (or call an `agent`), optionally train on
        them. Sent with an Idempotency-Key (`idempotency_key`, else one made for this call)
        that every retry repeats: a retried submit never makes a second job."""
        return await self._send(
            calls.rollout_jobs_create(
                model=model,
                examples=examples,
                num_generations=num_generations,
                sampling=sampling,
                grader=grader,
                agent=agent,
                concurrency=concurrency,
                train=train,
                metadata=metadata,
                idempotency_key=idempotency_key,
            )
        )

    @operation("rollout_jobs-trajectories")
    async def trajectories(self, job_id: str) -> dict[str, Any]:
        """The groups it built, as a NAT `TrajectoryCollection`."""
        return cast(dict[str, Any], await self._send(calls.jobs_trajectories(self.kind, job_id)))


class EvaluationJobs(_Jobs[m.EvaluationJob]):
    """Evaluation jobs: a step of a model sampled on examples and each answer scored."""

    kind: JobKind = "evaluation"

    @operation("evaluation_jobs-create")
    async def create(
        self,
        *,
        model: str,
        grader: Mapping[str, Any],
        dataset: Mapping[str, Any] | None = None,
        examples: Sequence[Mapping[str, Any]] | None = None,
        samples_per_example: int | None = None,
        sampling: Mapping[str, Any] | None = None,
        concurrency: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> m.EvaluationJob:
        """Evaluate `model` (`name`, `name@N` or `name@alias`: the step it names now) on a
        `dataset` split (`{"name": "…", "split": "validation"}` or `{"id": …}`) or inline
        `examples`, scoring each answer with `grader`. Sent with an Idempotency-Key
        (`idempotency_key`, else one made for this call) that every retry repeats."""
        return await self._send(
            calls.evaluation_jobs_create(
                model=model,
                grader=grader,
                dataset=dataset,
                examples=examples,
                samples_per_example=samples_per_example,
                sampling=sampling,
                concurrency=concurrency,
                metadata=metadata,
                idempotency_key=idempotency_key,
            )
        )

    @operation("evaluation_jobs-list_results")
    async def results(
        self, job_id: str, *, after: str | None = None, limit: int | None = None
    ) -> m.Page[m.EvaluationResult]:
        """One page of the job's answers, by example then sample, each with its score or
        its error."""
        return await self._send(calls.evaluation_jobs_results(job_id, after=after, limit=limit))

    @operation("evaluation_jobs-summary")
    async def summary(self, job_id: str) -> m.EvaluationReport:
        """The job's scores summed up, overall and per example (min, max, mean, stddev)."""
        return await self._send(calls.evaluation_jobs_summary(job_id))

    @operation("evaluation_jobs-compare")
    async def compare(self, a: str, b: str) -> m.EvaluationComparison:
        """Job `b` against job `a` on the same examples: per-example deltas (`b - a`), their
        mean, wins, losses and ties. ConflictError unless both succeeded on the same
        examples."""
        return await self._send(calls.evaluation_jobs_compare(a, b))


class Runs(_Followed[m.Run]):
    """Training runs: the loop (sample, grade, train, validate) over a dataset, as one job."""

    kind: JobKind = "run"

    @operation("runs-create")
    async def create(
        self,
        *,
        model: str,
        recipe: Mapping[str, Any],
        schedule: Mapping[str, Any],
        dataset: Mapping[str, Any] | None = None,
        examples: Sequence[Mapping[str, Any]] | None = None,
        hyperparameters: Mapping[str, Any] | None = None,
        learning_rate_schedule: Mapping[str, Any] | None = None,
        validation: Mapping[str, Any] | None = None,
        checkpoints: Mapping[str, Any] | None = None,
        early_stopping: Mapping[str, Any] | None = None,
        curriculum: Mapping[str, Any] | None = None,
        max_steps_off_policy: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        warmup: Mapping[str, Any] | None = None,
    ) -> m.Run:
        """Start a run on `dataset` (`{"id": ...}`) or inline `examples`; `warmup`
        (`{"examples": [chats], "hyperparameters": {...}}`): an SFT step before RL. Sent
        with an Idempotency-Key, as a training-job submit is: a retry never starts a
        second run."""
        return await self._send(
            calls.runs_create(
                model=model,
                recipe=recipe,
                schedule=schedule,
                dataset=dataset,
                examples=examples,
                hyperparameters=hyperparameters,
                learning_rate_schedule=learning_rate_schedule,
                validation=validation,
                checkpoints=checkpoints,
                early_stopping=early_stopping,
                curriculum=curriculum,
                max_steps_off_policy=max_steps_off_policy,
                metadata=metadata,
                idempotency_key=idempotency_key,
                warmup=warmup,
            )
        )

    @operation("runs-estimate")
    async def estimate(
        self,
        *,
        model: str,
        recipe: Mapping[str, Any],
        schedule: Mapping[str, Any],
        **more: Any,
    ) -> m.RunEstimate:
        """A dry run of `create` (its arguments but `idempotency_key`): the run checked as
        it would be, and its estimated usage and cost; nothing is stored."""
        return await self._send(
            calls.runs_estimate(model=model, recipe=recipe, schedule=schedule, **more)
        )

    @operation("runs-list")
    async def list(
        self,
        *,
        status: str | None = None,
        model: str | None = None,
        after: str | None = None,
        limit: int | None = None,
    ) -> m.Page[m.Run]:
        call = calls.runs_list(status=status, model=model, after=after, limit=limit)
        return await self._send(call)

    def iterate(
        self, *, status: str | None = None, model: str | None = None, limit: int | None = None
    ) -> AsyncIterator[m.Run]:
        return _pages(lambda after: self.list(status=status, model=model, after=after, limit=limit))

    @operation("runs-pause")
    async def pause(self, run_id: str) -> m.Run:
        """The child job under way finishes; no new one starts until `resume`."""
        return await self._send(calls.runs_pause(run_id, paused=True))

    @operation("runs-resume")
    async def resume(self, run_id: str) -> m.Run:
        return await self._send(calls.runs_pause(run_id, paused=False))

    @operation("runs-metrics")
    async def metrics(
        self,
        run_id: str,
        *,
        kind: str | None = None,
        after: int | None = None,
        limit: int | None = None,
    ) -> m.Page[m.RunMetric]:
        """The run's curve: a row per step (`kind="step"`) and per validation."""
        return await self._send(calls.runs_metrics(run_id, kind=kind, after=after, limit=limit))

    @operation("runs-settings")
    async def settings(self, run_id: str) -> m.RunSettings:
        """What the run was asked to do: recipe, schedule, hyper-parameters, validation."""
        return await self._send(calls.runs_settings(run_id))


class Datasets(_Resource):
    """Examples for runs, uploaded as JSON Lines in named splits."""

    @operation("datasets-upload")
    async def upload(
        self, name: str, examples: str | bytes | Iterable[Mapping[str, Any]]
    ) -> m.Dataset:
        """Upload examples (dicts, one a line, each with its `split`; or JSON Lines text).
        The same bytes under the same name again return the dataset stored first."""
        return await self._send(calls.datasets_upload(name, examples))

    @operation("datasets-list")
    async def list(
        self, *, name: str | None = None, after: str | None = None, limit: int | None = None
    ) -> m.Page[m.Dataset]:
        return await self._send(calls.datasets_list(name=name, after=after, limit=limit))

    @operation("datasets-get_dataset")
    async def get(self, dataset_id: str) -> m.Dataset:
        return await self._send(calls.datasets_get(dataset_id))

    @operation("datasets-delete_dataset")
    async def delete(self, dataset_id: str) -> None:
        """ConflictError while an active run reads it."""
        await self._send(calls.datasets_delete(dataset_id))


class Webhooks(_Resource):
    """Endpoints that receive signed events (Standard Webhooks), and their delivery logs."""

    @operation("webhooks-create")
    async def create(
        self, *, url: str, event_types: Sequence[str], description: str = "", enabled: bool = True
    ) -> m.WebhookEndpointCreated:
        """Register `url` for `event_types`; the answer's `secret` is shown only here."""
        body = {
            "url": url,
            "event_types": list(event_types),
            "description": description,
            "enabled": enabled,
        }
        return await self._send(calls.webhooks_create(body))

    @operation("webhooks-list")
    async def list(
        self, *, after: str | None = None, limit: int | None = None
    ) -> m.Page[m.WebhookEndpoint]:
        return await self._send(calls.webhooks_list(after=after, limit=limit))

    @operation("webhooks-get")
    async def get(self, endpoint_id: str) -> m.WebhookEndpoint:
        return await self._send(calls.webhooks_get(endpoint_id))

    @operation("webhooks-update")
    async def update(
        self,
        endpoint_id: str,
        *,
        url: str | None = None,
        event_types: Sequence[str] | None = None,
        enabled: bool | None = None,
        description: str | None = None,
    ) -> m.WebhookEndpoint:
        """Change what is given; pending deliveries go to a new `url` from their next try."""
        changes = {
            "url": url,
            "event_types": None if event_types is None else list(event_types),
            "enabled": enabled,
            "description": description,
        }
        body = {key: value for key, value in changes.items() if value is not None}
        return await self._send(calls.webhooks_update(endpoint_id, body))

    @operation("webhooks-rotate_secret")
    async def rotate_secret(
        self, endpoint_id: str, *, if_match: int | None = None
    ) -> m.WebhookEndpointCreated:
        """A new secret, in this answer only, with its `secret_version`; the previous one
        keeps signing deliveries too until `previous_secret_expires_at` (the server's grace
        period). With `if_match` (a `secret_version`), a 409 if it was rotated meanwhile."""
        return await self._send(calls.webhooks_rotate_secret(endpoint_id, if_match=if_match))

    @operation("webhooks-delete")
    async def delete(self, endpoint_id: str) -> None:
        await self._send(calls.webhooks_delete(endpoint_id))

    @operation("webhooks-deliveries")
    async def deliveries(
        self, endpoint_id: str, *, after: int | None = None, limit: int | None = None
    ) -> m.Page[m.WebhookDelivery]:
        """Its deliveries, newest first, each with its attempts."""
        return await self._send(calls.webhooks_deliveries(endpoint_id, after=after, limit=limit))

    @operation("webhooks-test")
    async def test(self, endpoint_id: str) -> m.WebhookDelivery:
        """Queue a `webhook.test` message for it; a worker sends it."""
        return await self._send(calls.webhooks_test(endpoint_id))


class Projects(_Resource):
    """Projects and their keys (an admin key; a project's key may read its own project)."""

    @operation("projects-create")
    async def create(self, *, name: str) -> m.Project:
        return await self._send(calls.projects_create(name))

    @operation("projects-list")
    async def list(
        self, *, after: str | None = None, limit: int | None = None
    ) -> m.Page[m.Project]:
        return await self._send(calls.projects_list(after=after, limit=limit))

    @operation("projects-get")
    async def get(self, project_id: str) -> m.Project:
        return await self._send(calls.projects_get(project_id))

    @operation("projects-get_quotas")
    async def get_quotas(self, project_id: str) -> m.ProjectQuotas:
        """The project's quotas, and what it uses of each now."""
        return await self._send(calls.projects_get_quotas(project_id))

    @operation("projects-set_quotas")
    async def set_quotas(
        self,
        project_id: str,
        *,
        running_jobs: int | None = None,
        queued_jobs: int | None = None,
        submissions_per_minute: int | None = None,
        trainer_seconds_per_day: int | None = None,
    ) -> m.ProjectQuotas:
        """Set every quota of the project (an admin key); one left None: no limit. Over
        `running_jobs`, jobs wait queued; over the others a submission raises
        `RateLimitedError` (429) naming the quota."""
        body = {
            "running_jobs": running_jobs,
            "queued_jobs": queued_jobs,
            "submissions_per_minute": submissions_per_minute,
            "trainer_seconds_per_day": trainer_seconds_per_day,
        }
        return await self._send(calls.projects_set_quotas(project_id, body))

    @operation("projects-create_key")
    async def create_key(
        self,
        project_id: str,
        *,
        name: str,
        scopes: Sequence[str],
        expires_at: datetime | None = None,
    ) -> m.ApiKeyCreated:
        """A key of the project with these scopes (`admin`, `write`, `read`, `sample`); the
        answer's `secret` is shown only here."""
        body: dict[str, Any] = {"name": name, "scopes": builtins.list(scopes)}
        if expires_at is not None:
            body["expires_at"] = expires_at.isoformat()
        return await self._send(calls.projects_create_key(project_id, body))

    @operation("projects-list_keys")
    async def list_keys(
        self, project_id: str, *, after: str | None = None, limit: int | None = None
    ) -> m.Page[m.ApiKey]:
        return await self._send(calls.projects_list_keys(project_id, after=after, limit=limit))

    @operation("projects-revoke_key")
    async def revoke_key(self, project_id: str, key_id: str) -> None:
        """Refused on every replica within the server's key cache time."""
        await self._send(calls.projects_revoke_key(project_id, key_id))


class AuditEvents(_Resource):
    """The audit log (an admin key): every request that could change something."""

    @operation("audit-list")
    async def list(
        self,
        *,
        after: str | None = None,
        limit: int | None = None,
        key_id: str | None = None,
        project_id: str | None = None,
        route: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> m.Page[m.AuditEvent]:
        """Newest first."""
        return await self._send(
            calls.audit_list(
                after=after,
                limit=limit,
                key_id=key_id,
                project_id=project_id,
                route=route,
                since=since,
                until=until,
            )
        )


class UsageLedger(_Resource):
    """What a project's jobs used, and its estimated cost."""

    @operation("usage-get")
    async def get(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        group_by: str | None = None,
        project_id: str | None = None,
    ) -> m.Usage:
        """Trainer and rollout seconds of the jobs that started in [since, until), grouped
        by `day`, `model`, `run` or `kind`, priced by the server's price table."""
        return await self._send(
            calls.usage_get(since=since, until=until, group_by=group_by, project_id=project_id)
        )


class Workers(_Resource):
    @operation("workers-list")
    async def list(self) -> builtins.list[m.Worker]:
        """Live workers: pool, backends, labels, the jobs each runs, draining."""
        return await self._send(calls.workers_list())

    @operation("workers-drain")
    async def drain(self, worker_id: str) -> m.Worker:
        """Ask a worker to drain: it stops claiming, finishes or hands back what it runs,
        and exits."""
        return await self._send(calls.workers_drain(worker_id))


class Gateway(_Resource):
    """The OpenAI-compatible gateway, for a quick call; for anything more, point an OpenAI
    client at `client.openai_base_url`."""

    @operation("gateway-chat_completions")
    async def chat_completions(
        self, *, model: str, messages: Sequence[Mapping[str, Any]], **params: Any
    ) -> dict[str, Any]:
        if params.get("stream"):
            raise ValueError("stream through an OpenAI client at `openai_base_url`")
        body = {"model": model, "messages": list(messages), **params}
        return await self._send(calls.chat_completions(body))

    @operation("gateway-models")
    async def models(self) -> dict[str, Any]:
        return await self._send(calls.gateway_models())


async def _pages(fetch: Callable[[str | None], Awaitable[m.Page[T]]]) -> AsyncIterator[T]:
    after: str | None = None
    while True:
        page = await fetch(after)
        for item in page.data:
            yield item
        if not page.has_more or not page.next_cursor:
            return
        after = page.next_cursor
