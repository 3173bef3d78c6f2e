"""Every API operation as a `Call`: what to send and how to read the answer, shared by the
sync and the async client (which only send them).

`OPERATIONS` names each operation by its `operationId` in `openapi.json`, with its method
and path; the repository's tests check the table against the document.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter

from trainyard_client import models as m

T = TypeVar("T")
JobKind = Literal["training", "rollout", "evaluation", "run"]

OPERATIONS: dict[str, tuple[str, str]] = {
    "health-healthz": ("GET", "/healthz"),
    "health-readyz": ("GET", "/readyz"),
    "health-metrics": ("GET", "/metrics"),
    "backends-list": ("GET", "/v1/backends"),
    "models-create": ("POST", "/v1/models"),
    "models-list": ("GET", "/v1/models"),
    "models-get": ("GET", "/v1/models/{name}"),
    "models-tinker_metrics": ("GET", "/v1/models/{name}/tinker-metrics"),
    "checkpoints-list": ("GET", "/v1/models/{name}/checkpoints"),
    "checkpoints-get": ("GET", "/v1/models/{name}/checkpoints/{step}"),
    "checkpoints-delete": ("DELETE", "/v1/models/{name}/checkpoints/{step}"),
    "checkpoints-export": ("GET", "/v1/models/{name}/checkpoints/{step}/export"),
    "checkpoints-list_aliases": ("GET", "/v1/models/{name}/aliases"),
    "checkpoints-set_alias": ("PUT", "/v1/models/{name}/aliases/{alias}"),
    "checkpoints-delete_alias": ("DELETE", "/v1/models/{name}/aliases/{alias}"),
    "checkpoints-get_retention": ("GET", "/v1/models/{name}/retention"),
    "checkpoints-set_retention": ("PUT", "/v1/models/{name}/retention"),
    "checkpoints-delete_retention": ("DELETE", "/v1/models/{name}/retention"),
    "checkpoints-apply_retention": ("POST", "/v1/models/{name}/retention/apply"),
    "training_jobs-create": ("POST", "/v1/training-jobs"),
    "training_jobs-list": ("GET", "/v1/training-jobs"),
    "training_jobs-get": ("GET", "/v1/training-jobs/{job_id}"),
    "training_jobs-cancel": ("POST", "/v1/training-jobs/{job_id}/cancel"),
    "training_jobs-trajectories": ("GET", "/v1/training-jobs/{job_id}/trajectories"),
    "training_jobs-events": ("GET", "/v1/training-jobs/{job_id}/events"),
    "training_jobs-stream": ("GET", "/v1/training-jobs/{job_id}/events/stream"),
    "rollout_jobs-create": ("POST", "/v1/rollout-jobs"),
    "rollout_jobs-list": ("GET", "/v1/rollout-jobs"),
    "rollout_jobs-get": ("GET", "/v1/rollout-jobs/{job_id}"),
    "rollout_jobs-cancel": ("POST", "/v1/rollout-jobs/{job_id}/cancel"),
    "rollout_jobs-trajectories": ("GET", "/v1/rollout-jobs/{job_id}/trajectories"),
    "rollout_jobs-events": ("GET", "/v1/rollout-jobs/{job_id}/events"),
    "rollout_jobs-stream": ("GET", "/v1/rollout-jobs/{job_id}/events/stream"),
    "evaluation_jobs-create": ("POST", "/v1/evaluation-jobs"),
    "evaluation_jobs-list": ("GET", "/v1/evaluation-jobs"),
    "evaluation_jobs-compare": ("GET", "/v1/evaluation-jobs/compare"),
    "evaluation_jobs-get": ("GET", "/v1/evaluation-jobs/{job_id}"),
    "evaluation_jobs-list_results": ("GET", "/v1/evaluation-jobs/{job_id}/results"),
    "evaluation_jobs-summary": ("GET", "/v1/evaluation-jobs/{job_id}/summary"),
    "evaluation_jobs-cancel": ("POST", "/v1/evaluation-jobs/{job_id}/cancel"),
    "evaluation_jobs-events": ("GET", "/v1/evaluation-jobs/{job_id}/events"),
    "evaluation_jobs-stream": ("GET", "/v1/evaluation-jobs/{job_id}/events/stream"),
    "runs-create": ("POST", "/v1/runs"),
    "runs-estimate": ("POST", "/v1/run-estimates"),
    "runs-list": ("GET", "/v1/runs"),
    "runs-get": ("GET", "/v1/runs/{run_id}"),
    "runs-pause": ("POST", "/v1/runs/{run_id}/pause"),
    "runs-resume": ("POST", "/v1/runs/{run_id}/resume"),
    "runs-cancel": ("POST", "/v1/runs/{run_id}/cancel"),
    "runs-metrics": ("GET", "/v1/runs/{run_id}/metrics"),
    "runs-settings": ("GET", "/v1/runs/{run_id}/settings"),
    "runs-events": ("GET", "/v1/runs/{job_id}/events"),
    "runs-stream": ("GET", "/v1/runs/{job_id}/events/stream"),
    "datasets-upload": ("POST", "/v1/datasets"),
    "datasets-list": ("GET", "/v1/datasets"),
    "datasets-get_dataset": ("GET", "/v1/datasets/{dataset_id}"),
    "datasets-delete_dataset": ("DELETE", "/v1/datasets/{dataset_id}"),
    "webhooks-create": ("POST", "/v1/webhooks"),
    "webhooks-list": ("GET", "/v1/webhooks"),
    "webhooks-get": ("GET", "/v1/webhooks/{endpoint_id}"),
    "webhooks-update": ("PATCH", "/v1/webhooks/{endpoint_id}"),
    "webhooks-delete": ("DELETE", "/v1/webhooks/{endpoint_id}"),
    "webhooks-deliveries": ("GET", "/v1/webhooks/{endpoint_id}/deliveries"),
    "webhooks-test": ("POST", "/v1/webhooks/{endpoint_id}/test"),
    "webhooks-rotate_secret": ("POST", "/v1/webhooks/{endpoint_id}/rotate-secret"),
    "workers-list": ("GET", "/v1/workers"),
    "workers-drain": ("POST", "/v1/workers/{worker_id}/drain"),
    "projects-create": ("POST", "/v1/projects"),
    "projects-list": ("GET", "/v1/projects"),
    "projects-get": ("GET", "/v1/projects/{project_id}"),
    "projects-get_quotas": ("GET", "/v1/projects/{project_id}/quotas"),
    "projects-set_quotas": ("PUT", "/v1/projects/{project_id}/quotas"),
    "projects-create_key": ("POST", "/v1/projects/{project_id}/keys"),
    "projects-list_keys": ("GET", "/v1/projects/{project_id}/keys"),
    "projects-revoke_key": ("DELETE", "/v1/projects/{project_id}/keys/{key_id}"),
    "audit-list": ("GET", "/v1/audit-events"),
    "usage-get": ("GET", "/v1/usage"),
    "gateway-chat_completions": ("POST", "/openai/v1/chat/completions"),
    "gateway-models": ("GET", "/openai/v1/models"),
}

# Read a job's event stream with this read timeout: the server sends a comment every 15 s
# on an idle stream, so a silence this long is a dead connection.
STREAM_READ_SECONDS = 45.0


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request to send (again, on a retry: the very same one, Idempotency-Key included)
    and how to read a successful answer."""

    operation: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: Sequence[tuple[str, str]] = ()
    json: Any = None
    content: bytes | None = None
    """A body that is not JSON (a dataset's JSON Lines), with its Content-Type in headers."""
    headers: Mapping[str, str] = field(default_factory=dict)
    resend: bool = True
    """Whether the request may be sent again when it may have reached the server (a broken
    connection, a 502): true where a second copy changes nothing (reads, PUT, DELETE, a
    submit with an Idempotency-Key). A request that never left (refused connection) and a
    429 or 503 are retried either way."""
    already_done: frozenset[int] = frozenset()
    """Error statuses that, after a doubtful copy (see `Attempts.doubtful`), mean that copy
    did the work: a DELETE resent after its answer was lost finds nothing left (404)."""
    accept: frozenset[int] = frozenset()
    """Error statuses that are an answer to parse, not an error to raise or retry (/readyz's
    503, which carries the failing checks)."""

    @property
    def method(self) -> str:
        return OPERATIONS[self.operation][0]

    @property
    def idempotency_key(self) -> str | None:
        return self.headers.get("Idempotency-Key")


def _path(operation: str, **values: str | int) -> str:
    template = OPERATIONS[operation][1]
    return template.format(**{k: quote(str(v), safe="") for k, v in values.items()})


def _call(operation: str, parse: Callable[[httpx.Response], T], /, **path: Any) -> Call[T]:
    return Call(operation, _path(operation, **path), parse)


def _job_call(operation: str, parse: Callable[[httpx.Response], T], job_id: str) -> Call[T]:
    """A call on one job, whatever its route names the id (`job_id`, `run_id`)."""
    template = OPERATIONS[operation][1]
    name = template[template.index("{") + 1 : template.index("}")]
    return _call(operation, parse, **{name: job_id})


def _json(type_: Any) -> Callable[[httpx.Response], Any]:
    adapter: TypeAdapter[Any] = TypeAdapter(type_)
    return lambda response: adapter.validate_json(response.content)


def _raw_json(response: httpx.Response) -> Any:
    return response.json()


def _nothing(response: httpx.Response) -> None:
    return None


def _params(**values: Any) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = str(value).lower()
        out.append((key, str(value)))
    return tuple(out)


def _body(**values: Any) -> dict[str, Any]:
    """A request body of the values given (None: left out, the server's default applies)."""
    return {k: v for k, v in values.items() if v is not None}


def _replace(call: Call[T], **changes: Any) -> Call[T]:
    return Call(**{**call.__dict__, **changes})


# --------------------------------------------------------------------------- health


def healthz() -> Call[m.Liveness]:
    return _call("health-healthz", _json(m.Liveness))


def _readiness(response: httpx.Response) -> m.Readiness:
    if response.status_code == 503:
        # Not ready: a problem whose `checks` say which check failed.
        body = response.json()
        return m.Readiness(status="unavailable", checks=body.get("checks") or {})
    return m.Readiness.model_validate_json(response.content)


def readyz() -> Call[m.Readiness]:
    return _replace(_call("health-readyz", _readiness), accept=frozenset({503}))


def metrics() -> Call[str]:
    return _call("health-metrics", lambda response: response.text)


def backends_list() -> Call[list[m.Backend]]:
    return _call("backends-list", _json(list[m.Backend]))


# --------------------------------------------------------------------------- models


def models_create(
    *,
    name: str,
    base_model: str,
    backend: str,
    project: str | None = None,
    config: Mapping[str, Any] | None = None,
    pool: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> Call[m.Model]:
    body = _body(name=name, project=project, base_model=base_model, backend=backend, pool=pool)
    if config is not None:
        body["config"] = dict(config)
    if labels is not None:
        body["labels"] = dict(labels)
    # The same model again is a 200 with it: a second copy changes nothing.
    return _replace(_call("models-create", _json(m.Model)), json=body)


def models_list(*, after: str | None = None, limit: int | None = None) -> Call[m.Page[m.Model]]:
    call = _call("models-list", _json(m.Page[m.Model]))
    return _replace(call, params=_params(after=after, limit=limit))


def models_get(name: str) -> Call[m.Model]:
    return _call("models-get", _json(m.Model), name=name)


def models_tinker_metrics(
    name: str, *, after: int | None = None, limit: int | None = None
) -> Call[m.Page[m.TinkerStep]]:
    call = _call("models-tinker_metrics", _json(m.Page[m.TinkerStep]), name=name)
    return _replace(call, params=_params(after=after, limit=limit))


# --------------------------------------------------------------------------- checkpoints


def checkpoints_list(
    model: str, *, after: str | None = None, limit: int | None = None
) -> Call[m.Page[m.Checkpoint]]:
    call = _call("checkpoints-list", _json(m.Page[m.Checkpoint]), name=model)
    return _replace(call, params=_params(after=after, limit=limit))


def checkpoints_get(model: str, step: int) -> Call[m.Checkpoint]:
    return _call("checkpoints-get", _json(m.Checkpoint), name=model, step=step)


_GONE = frozenset({404})


def checkpoints_delete(model: str, step: int) -> Call[None]:
    call = _call("checkpoints-delete", _nothing, name=model, step=step)
    return _replace(call, already_done=_GONE)


def checkpoints_export(model: str, step: int, *, format: str = "tar.gz") -> Call[None]:
    """Streamed by the client into a file; `parse` is not used."""
    call = _call("checkpoints-export", _nothing, name=model, step=step)
    return _replace(call, params=_params(format=format))


def aliases_list(
    model: str, *, after: str | None = None, limit: int | None = None
) -> Call[m.Page[m.Alias]]:
    call = _call("checkpoints-list_aliases", _json(m.Page[m.Alias]), name=model)
    return _replace(call, params=_params(after=after, limit=limit))


def aliases_set(model: str, alias: str, *, step: int) -> Call[m.Alias]:
    call = _call("checkpoints-set_alias", _json(m.Alias), name=model, alias=alias)
    return _replace(call, json={"step": step})


def aliases_delete(model: str, alias: str) -> Call[None]:
    call = _call("checkpoints-delete_alias", _nothing, name=model, alias=alias)
    return _replace(call, already_done=_GONE)


def retention_get(model: str) -> Call[m.RetentionPolicy]:
    return _call("checkpoints-get_retention", _json(m.RetentionPolicy), name=model)


def retention_set(
    model: str,
    *,
    keep_last: int,
    keep_best_by: str | None = None,
    higher_is_better: bool | None = None,
) -> Call[m.RetentionPolicy]:
    call = _call("checkpoints-set_retention", _json(m.RetentionPolicy), name=model)
    body = _body(keep_last=keep_last, keep_best_by=keep_best_by, higher_is_better=higher_is_better)
    return _replace(call, json=body)


def retention_delete(model: str) -> Call[None]:
    call = _call("checkpoints-delete_retention", _nothing, name=model)
    return _replace(call, already_done=_GONE)


def retention_apply(model: str) -> Call[m.RetentionRun]:
    # Applying a policy twice deletes nothing more the second time.
    return _call("checkpoints-apply_retention", _json(m.RetentionRun), name=model)


# --------------------------------------------------------------------------- jobs


def new_idempotency_key() -> str:
    return f"tyc-{uuid.uuid4().hex}"


def training_jobs_create(
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
) -> Call[m.TrainingJob]:
    body = _body(
        model=model,
        method=method,
        examples=list(examples) if examples is not None else None,
        dataset=dataset,
        pairs=list(pairs) if pairs is not None else None,
        collection=collection,
        groups=list(groups) if groups is not None else None,
        hyperparameters=hyperparameters,
        metadata=metadata,
        policy_step=policy_step,
        max_steps_off_policy=max_steps_off_policy,
    )
    # One key per logical submit, made here once: every retry of this call sends it again,
    # so a submit whose answer was lost is answered with the job it created.
    key = idempotency_key if idempotency_key is not None else new_idempotency_key()
    call = _call("training_jobs-create", _json(m.TrainingJob))
    return _replace(call, json=body, headers={"Idempotency-Key": key})


def rollout_jobs_create(
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
) -> Call[m.RolloutJob]:
    body = _body(
        model=model,
        examples=list(examples),
        num_generations=num_generations,
        sampling=sampling,
        grader=grader,
        agent=agent,
        concurrency=concurrency,
        train=train,
        metadata=metadata,
    )
    key = idempotency_key if idempotency_key is not None else new_idempotency_key()
    call = _call("rollout_jobs-create", _json(m.RolloutJob))
    return _replace(call, json=body, headers={"Idempotency-Key": key})


def evaluation_jobs_create(
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
) -> Call[m.EvaluationJob]:
    body = _body(
        model=model,
        dataset=dataset,
        examples=list(examples) if examples is not None else None,
        grader=grader,
        samples_per_example=samples_per_example,
        sampling=sampling,
        concurrency=concurrency,
        metadata=metadata,
    )
    key = idempotency_key if idempotency_key is not None else new_idempotency_key()
    call = _call("evaluation_jobs-create", _json(m.EvaluationJob))
    return _replace(call, json=body, headers={"Idempotency-Key": key})


def evaluation_jobs_results(
    job_id: str, *, after: str | None = None, limit: int | None = None
) -> Call[m.Page[m.EvaluationResult]]:
    call = _job_call("evaluation_jobs-list_results", _json(m.Page[m.EvaluationResult]), job_id)
    return _replace(call, params=_params(after=after, limit=limit))


def evaluation_jobs_summary(job_id: str) -> Call[m.EvaluationReport]:
    return _job_call("evaluation_jobs-summary", _json(m.EvaluationReport), job_id)


def evaluation_jobs_compare(a: str, b: str) -> Call[m.EvaluationComparison]:
    call = _call("evaluation_jobs-compare", _json(m.EvaluationComparison))
    return _replace(call, params=_params(a=a, b=b))


def _run_body(
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
    warmup: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    return _body(
        model=model,
        dataset=dataset,
        examples=list(examples) if examples is not None else None,
        recipe=recipe,
        schedule=schedule,
        hyperparameters=hyperparameters,
        learning_rate_schedule=learning_rate_schedule,
        validation=validation,
        checkpoints=checkpoints,
        early_stopping=early_stopping,
        curriculum=curriculum,
        max_steps_off_policy=max_steps_off_policy,
        metadata=metadata,
        warmup=warmup,
    )


def runs_create(*, idempotency_key: str | None = None, **fields: Any) -> Call[m.Run]:
    key = idempotency_key if idempotency_key is not None else new_idempotency_key()
    call = _call("runs-create", _json(m.Run))
    return _replace(call, json=_run_body(**fields), headers={"Idempotency-Key": key})


def runs_estimate(**fields: Any) -> Call[m.RunEstimate]:
    """A dry run of `runs_create`: checked and priced, nothing stored."""
    call = _call("runs-estimate", _json(m.RunEstimate))
    return _replace(call, json=_run_body(**fields))


def runs_list(
    *,
    status: str | None = None,
    model: str | None = None,
    after: str | None = None,
    limit: int | None = None,
) -> Call[m.Page[m.Run]]:
    call = _call("runs-list", _json(m.Page[m.Run]))
    return _replace(call, params=_params(status=status, model=model, after=after, limit=limit))


def runs_pause(run_id: str, *, paused: bool) -> Call[m.Run]:
    # Pausing (or resuming) twice leaves the run as once does.
    return _call("runs-pause" if paused else "runs-resume", _json(m.Run), run_id=run_id)


def runs_metrics(
    run_id: str, *, kind: str | None = None, after: int | None = None, limit: int | None = None
) -> Call[m.Page[m.RunMetric]]:
    call = _call("runs-metrics", _json(m.Page[m.RunMetric]), run_id=run_id)
    return _replace(call, params=_params(kind=kind, after=after, limit=limit))


def runs_settings(run_id: str) -> Call[m.RunSettings]:
    return _call("runs-settings", _json(m.RunSettings), run_id=run_id)


_JOB_TYPES: dict[JobKind, Any] = {
    "training": m.TrainingJob,
    "rollout": m.RolloutJob,
    "evaluation": m.EvaluationJob,
    "run": m.Run,
}
_PAGE_TYPES: dict[JobKind, Any] = {
    "training": m.Page[m.TrainingJob],
    "rollout": m.Page[m.RolloutJob],
    "evaluation": m.Page[m.EvaluationJob],
}


def _prefix(kind: JobKind) -> str:
    return "runs" if kind == "run" else f"{kind}_jobs"


def jobs_list(
    kind: JobKind,
    *,
    status: str | None = None,
    model: str | None = None,
    metadata: Mapping[str, str | int | float | bool] | None = None,
    after: str | None = None,
    limit: int | None = None,
) -> Call[Any]:
    labels = {f"metadata.{key}": value for key, value in (metadata or {}).items()}
    params = _params(status=status, model=model, after=after, limit=limit, **labels)
    call = _call(f"{_prefix(kind)}-list", _json(_PAGE_TYPES[kind]))
    return _replace(call, params=params)


def jobs_get(kind: JobKind, job_id: str) -> Call[Any]:
    return _job_call(f"{_prefix(kind)}-get", _json(_JOB_TYPES[kind]), job_id)


def jobs_cancel(kind: JobKind, job_id: str) -> Call[Any]:
    # Cancelling twice leaves one cancelled job; a resent cancel that finds the job already
    # cancelled (409) is answered with the job by the client.
    return _job_call(f"{_prefix(kind)}-cancel", _json(_JOB_TYPES[kind]), job_id)


def jobs_trajectories(kind: JobKind, job_id: str, *, shape: str | None = None) -> Call[Any]:
    call = _job_call(f"{_prefix(kind)}-trajectories", _raw_json, job_id)
    return _replace(call, params=_params(shape=shape))


def jobs_events(
    kind: JobKind, job_id: str, *, after: int | None = None, limit: int | None = None
) -> Call[m.Page[m.JobEvent]]:
    call = _job_call(f"{_prefix(kind)}-events", _json(m.Page[m.JobEvent]), job_id)
    return _replace(call, params=_params(after=after, limit=limit))


def jobs_stream(kind: JobKind, job_id: str, *, after: int) -> Call[None]:
    """The event stream from `after`: the first connection asks with `?after=`, a
    reconnection with `Last-Event-ID` (as an EventSource does); read by the client."""
    call = _job_call(f"{_prefix(kind)}-stream", _nothing, job_id)
    headers = {"Accept": "text/event-stream"}
    if after:
        headers["Last-Event-ID"] = str(after)
    return _replace(call, headers=headers)


# --------------------------------------------------------------------------- datasets


def _jsonl(examples: str | bytes | Iterable[Mapping[str, Any]]) -> bytes:
    if isinstance(examples, bytes):
        return examples
    if isinstance(examples, str):
        return examples.encode()
    lines = [json.dumps(example, ensure_ascii=False, allow_nan=False) for example in examples]
    return ("\n".join(lines) + "\n").encode()


def datasets_upload(
    name: str, examples: str | bytes | Iterable[Mapping[str, Any]]
) -> Call[m.Dataset]:
    # The same bytes under the same name again answer with the stored dataset: resendable.
    call = _call("datasets-upload", _json(m.Dataset))
    return _replace(
        call,
        params=_params(name=name),
        content=_jsonl(examples),
        headers={"Content-Type": "application/jsonl"},
    )


def datasets_list(
    *, name: str | None = None, after: str | None = None, limit: int | None = None
) -> Call[m.Page[m.Dataset]]:
    call = _call("datasets-list", _json(m.Page[m.Dataset]))
    return _replace(call, params=_params(name=name, after=after, limit=limit))


def datasets_get(dataset_id: str) -> Call[m.Dataset]:
    return _call("datasets-get_dataset", _json(m.Dataset), dataset_id=dataset_id)


def datasets_delete(dataset_id: str) -> Call[None]:
    call = _call("datasets-delete_dataset", _nothing, dataset_id=dataset_id)
    return _replace(call, already_done=_GONE)


# --------------------------------------------------------------------------- webhooks


def webhooks_create(body: Mapping[str, Any]) -> Call[m.WebhookEndpointCreated]:
    # A second copy registers a second endpoint (with another secret): never resent.
    call = _call("webhooks-create", _json(m.WebhookEndpointCreated))
    return _replace(call, json=dict(body), resend=False)


def webhooks_list(
    *, after: str | None = None, limit: int | None = None
) -> Call[m.Page[m.WebhookEndpoint]]:
    call = _call("webhooks-list", _json(m.Page[m.WebhookEndpoint]))
    return _replace(call, params=_params(after=after, limit=limit))


def webhooks_get(endpoint_id: str) -> Call[m.WebhookEndpoint]:
    return _call("webhooks-get", _json(m.WebhookEndpoint), endpoint_id=endpoint_id)


def webhooks_update(endpoint_id: str, body: Mapping[str, Any]) -> Call[m.WebhookEndpoint]:
    call = _call("webhooks-update", _json(m.WebhookEndpoint), endpoint_id=endpoint_id)
    return _replace(call, json=dict(body))


def webhooks_delete(endpoint_id: str) -> Call[None]:
    call = _call("webhooks-delete", _nothing, endpoint_id=endpoint_id)
    return _replace(call, already_done=_GONE)


def webhooks_deliveries(
    endpoint_id: str, *, after: int | None = None, limit: int | None = None
) -> Call[m.Page[m.WebhookDelivery]]:
    call = _call("webhooks-deliveries", _json(m.Page[m.WebhookDelivery]), endpoint_id=endpoint_id)
    return _replace(call, params=_params(after=after, limit=limit))


def webhooks_test(endpoint_id: str) -> Call[m.WebhookDelivery]:
    call = _call("webhooks-test", _json(m.WebhookDelivery), endpoint_id=endpoint_id)
    return _replace(call, resend=False)


def webhooks_rotate_secret(
    endpoint_id: str, *, if_match: int | None = None
) -> Call[m.WebhookEndpointCreated]:
    # A second rotation would lose the secret the first answer carried: never resent.
    call = _call("webhooks-rotate_secret", _json(m.WebhookEndpointCreated), endpoint_id=endpoint_id)
    headers = {} if if_match is None else {"If-Match": f'"{if_match}"'}
    return _replace(call, resend=False, headers=headers)


# --------------------------------------------------------------------------- projects


def projects_create(name: str) -> Call[m.Project]:
    # A second copy answers 409 (the name is taken): never resent.
    call = _call("projects-create", _json(m.Project))
    return _replace(call, json={"name": name}, resend=False)


def projects_list(*, after: str | None = None, limit: int | None = None) -> Call[m.Page[m.Project]]:
    call = _call("projects-list", _json(m.Page[m.Project]))
    return _replace(call, params=_params(after=after, limit=limit))


def projects_get(project_id: str) -> Call[m.Project]:
    return _call("projects-get", _json(m.Project), project_id=project_id)


def projects_get_quotas(project_id: str) -> Call[m.ProjectQuotas]:
    return _call("projects-get_quotas", _json(m.ProjectQuotas), project_id=project_id)


def projects_set_quotas(project_id: str, body: Mapping[str, Any]) -> Call[m.ProjectQuotas]:
    # A PUT: a second copy sets the same quotas.
    call = _call("projects-set_quotas", _json(m.ProjectQuotas), project_id=project_id)
    return _replace(call, json=dict(body))


def projects_create_key(project_id: str, body: Mapping[str, Any]) -> Call[m.ApiKeyCreated]:
    # A second copy would make a second key (its secret lost): never resent.
    call = _call("projects-create_key", _json(m.ApiKeyCreated), project_id=project_id)
    return _replace(call, json=dict(body), resend=False)


def projects_list_keys(
    project_id: str, *, after: str | None = None, limit: int | None = None
) -> Call[m.Page[m.ApiKey]]:
    call = _call("projects-list_keys", _json(m.Page[m.ApiKey]), project_id=project_id)
    return _replace(call, params=_params(after=after, limit=limit))


def projects_revoke_key(project_id: str, key_id: str) -> Call[None]:
    # Revoking twice changes nothing: safe to resend.
    return _call("projects-revoke_key", _nothing, project_id=project_id, key_id=key_id)


def audit_list(
    *,
    after: str | None = None,
    limit: int | None = None,
    key_id: str | None = None,
    project_id: str | None = None,
    route: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> Call[m.Page[m.AuditEvent]]:
    call = _call("audit-list", _json(m.Page[m.AuditEvent]))
    params = _params(
        after=after,
        limit=limit,
        key_id=key_id,
        project_id=project_id,
        route=route,
        since=None if since is None else since.isoformat(),
        until=None if until is None else until.isoformat(),
    )
    return _replace(call, params=params)


def usage_get(
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    group_by: str | None = None,
    project_id: str | None = None,
) -> Call[m.Usage]:
    params = _params(
        group_by=group_by,
        project_id=project_id,
        **{
            "from": None if since is None else since.isoformat(),
            "to": None if until is None else until.isoformat(),
        },
    )
    return _replace(_call("usage-get", _json(m.Usage)), params=params)


# --------------------------------------------------------------------------- workers


def workers_list() -> Call[list[m.Worker]]:
    return _call("workers-list", _json(list[m.Worker]))


def workers_drain(worker_id: str) -> Call[m.Worker]:
    # Asking twice changes nothing: resent like a read.
    return _call("workers-drain", _json(m.Worker), worker_id=worker_id)


# --------------------------------------------------------------------------- gateway


def chat_completions(body: Mapping[str, Any]) -> Call[dict[str, Any]]:
    """Sampling twice costs compute and changes nothing: resent like a read."""
    return _replace(_call("gateway-chat_completions", _raw_json), json=dict(body))


def gateway_models() -> Call[dict[str, Any]]:
    return _call("gateway-models", _raw_json)
