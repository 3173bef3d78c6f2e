"""The API's response types, as `openapi.json` names and shapes them.

Each class mirrors the schema of the same name (the repository's tests check that their
fields, types and required fields stay in step with `openapi.json`). Unknown fields from a
newer server are kept, not refused, and enumerations are plain strings (the values known
today: `JobStatus`, `EventType`, and in the fields' comments): an older client keeps
working against a newer server.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


class JobStatus(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


FINAL_STATUSES = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})


class EventType(StrEnum):
    job_queued = "job_queued"
    job_claimed = "job_claimed"
    job_retrying = "job_retrying"
    job_released = "job_released"
    cancel_requested = "cancel_requested"
    job_cancelled = "job_cancelled"
    training_started = "training_started"
    gradient_step = "gradient_step"
    training_ended = "training_ended"
    training_failed = "training_failed"
    rollout_started = "rollout_started"
    rollout_progress = "rollout_progress"
    rollout_ended = "rollout_ended"
    rollout_failed = "rollout_failed"
    evaluation_started = "evaluation_started"
    evaluation_progress = "evaluation_progress"
    evaluation_ended = "evaluation_ended"
    evaluation_failed = "evaluation_failed"
    run_started = "run_started"
    run_step = "run_step"
    run_ended = "run_ended"
    run_failed = "run_failed"
    run_validated = "run_validated"
    run_paused = "run_paused"
    run_resumed = "run_resumed"


FINAL_EVENTS = frozenset(
    {
        EventType.job_cancelled,
        EventType.training_ended,
        EventType.training_failed,
        EventType.rollout_ended,
        EventType.rollout_failed,
        EventType.evaluation_ended,
        EventType.evaluation_failed,
        EventType.run_ended,
        EventType.run_failed,
    }
)
"""The event that ends a job's history: nothing follows it."""


class Liveness(_Wire):
    status: str = "ok"


class Check(_Wire):
    ok: bool
    detail: str


class Readiness(_Wire):
    status: str
    checks: dict[str, Check]


class FieldError(_Wire):
    location: str  # body, query, path, header, cookie
    path: str
    message: str
    type: str


class Problem(_Wire):
    """RFC 9457 problem details: the body of every error response."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    errors: list[FieldError] | None = None


class Page(_Wire, Generic[T]):
    """One page of a list; pass `next_cursor` as `after` for the next."""

    data: list[T]
    has_more: bool
    next_cursor: str | None = None


class Model(_Wire):
    name: str
    project: str
    base_model: str
    backend: str
    config: dict[str, Any]
    current_step: int
    pool: str = "default"
    labels: dict[str, str] = {}
    inference_base_url: str | None
    inference_model_name: str | None
    openai_base_url: str | None = None
    openai_model_names: list[str] = []
    created_at: datetime
    updated_at: datetime


class Worker(_Wire):
    id: str
    host: str
    pid: int
    pool: str
    backends: list[str]
    labels: dict[str, str]
    version: str | None
    started_at: datetime
    heartbeat_at: datetime
    jobs: list[str]
    draining: bool
    drain_requested_at: datetime | None


class Backend(_Wire):
    name: str
    description: str
    hyperparameters: dict[str, Any]
    config: dict[str, Any]
    methods: dict[str, dict[str, Any]] = {}


class Checkpoint(_Wire):
    step: int
    created_at: datetime
    job_id: str | None
    metrics: dict[str, float | None] | None
    validation_metrics: dict[str, float | str | None] | None = None
    size_bytes: int
    aliases: list[str]


class Alias(_Wire):
    alias: str
    step: int
    builtin: bool
    created_at: datetime | None = None
    updated_at: datetime | None = None


class RetentionPolicy(_Wire):
    model: str
    keep_last: int | None
    keep_best_by: str | None
    higher_is_better: bool
    best_step: int | None
    created_at: datetime | None
    updated_at: datetime | None


class RetentionRun(_Wire):
    kept: list[int]
    deleted: list[int]


class JobProgress(_Wire):
    step: int
    total: int | None
    percent: float | None


class JobResult(_Wire):
    start_step: int | None
    final_step: int | None
    checkpoint_path: str | None
    metrics: dict[str, Any] | None
    recovered: bool
    trained: bool | None
    reason: str | None


class JobError(_Wire):
    type: str
    message: str
    transient: bool


class TrajectorySummary(_Wire):
    num_groups: int
    num_trajectories: int
    num_trainable_groups: int
    untrainable_groups: list[int]


class JobUsage(_Wire):
    """What a job (or a run: its children) used; null: not counted."""

    prompt_tokens: int | None
    completion_tokens: int | None
    trained_tokens: int | None
    trainer_seconds: float | None
    rollout_seconds: float | None


class JobCost(_Wire):
    """`usage` priced by the server's price table: an estimate."""

    currency: str
    amount: float
    sampled: float
    trained: float
    trainer: float
    rollout: float


class _Ends(_Wire):
    """What every kind of job has: a status, and so an end."""

    id: str
    model: str
    status: str
    error: JobError | None
    metadata: dict[str, Any]
    cancel_requested: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    usage: JobUsage
    cost: JobCost

    @property
    def done(self) -> bool:
        """Whether the job has ended (succeeded, failed or cancelled)."""
        return self.status in FINAL_STATUSES


class _Job(_Ends):
    progress: JobProgress
    attempts: int
    max_attempts: int
    waiting_for: str | None = None


class SftSummary(_Wire):
    method: str = "sft"
    num_examples: int
    num_target_turns: int
    dataset: str | None = None


class DpoSummary(_Wire):
    method: str = "dpo"
    num_pairs: int


class TrainingJob(_Job):
    method: str = "rl"
    summary: TrajectorySummary | SftSummary | DpoSummary
    hyperparameters: dict[str, Any]
    policy_step: int | None
    max_steps_off_policy: int | None
    result: JobResult | None


class RolloutSummary(_Wire):
    num_examples: int
    num_generations: int
    num_samples: int
    num_graded: int = 0
    num_errors: int = 0
    mean_reward: float | None = None
    untrainable_groups: list[str | int] = []
    errors: list[str] = []


class RolloutJob(_Job):
    summary: RolloutSummary
    training_job_id: str | None


class EvaluationSummary(_Wire):
    model: str
    step: int
    dataset_id: str | None = None
    split: str | None = None
    examples_sha256: str
    num_examples: int
    samples_per_example: int
    num_samples: int
    num_scored: int | None = None
    num_errors: int | None = None
    mean_score: float | None = None
    pass_rate: float | None = None


class EvaluationJob(_Job):
    summary: EvaluationSummary


class EvaluationResult(_Wire):
    example: int
    example_id: str
    sample: int
    answer: str | None
    score: float | None
    error: str | None
    created_at: datetime


class ExampleScores(_Wire):
    example: int
    example_id: str
    num_scored: int
    num_errors: int
    mean: float | None
    min: float | None
    max: float | None
    stddev: float | None


class EvaluationReport(_Wire):
    job_id: str
    step: int
    num_examples: int
    num_scored: int
    num_errors: int
    mean_score: float | None
    pass_rate: float | None
    examples: list[ExampleScores]


class ExampleDelta(_Wire):
    example: int
    example_id: str
    a: float | None
    b: float | None
    delta: float | None


class EvaluationComparison(_Wire):
    a: str
    b: str
    a_step: int
    b_step: int
    num_examples: int
    mean_delta: float | None
    wins: int
    losses: int
    ties: int
    examples: list[ExampleDelta]


class JobEvent(_Wire):
    seq: int
    type: str
    created_at: datetime
    data: dict[str, Any]


class RunProgress(_Wire):
    step: int
    total_steps: int
    epoch: int
    epochs: int | None
    percent: float
    phase: str  # queued, warmup, rollout, training, validation, paused, done
    eta_seconds: float | None


class BestCheckpoint(_Wire):
    step: int
    score: float


class Run(_Ends):
    """A training run: the RL loop (sample, grade, train, validate) as one durable job."""

    paused: bool
    progress: RunProgress
    best_checkpoint: BestCheckpoint | None
    stop_reason: str | None
    current_jobs: list[str]


class RunEstimate(_Wire):
    """What a run would use and cost (a dry run: nothing stored)."""

    dry_run: bool = True
    model: str
    total_steps: int
    samples: int
    validations: int
    usage: JobUsage
    cost: JobCost
    notes: list[str]


class RunSettings(_Wire):
    """A run's settings as it stores them (no examples, no grader or agent headers)."""

    dataset: dict[str, Any] | None
    num_train: int
    num_validation: int
    recipe: dict[str, Any]
    schedule: dict[str, Any]
    hyperparameters: dict[str, Any]
    learning_rate_schedule: dict[str, Any] | None
    validation: dict[str, Any] | None
    checkpoints: dict[str, Any]
    early_stopping: dict[str, Any] | None
    curriculum: dict[str, Any] | None
    max_steps_off_policy: int
    warmup: dict[str, Any] | None = None  # the SFT warm-up: hyperparameters, num_examples
    start_step: int | None  # the model's step when the run started: its step 0


class RunMetric(_Wire):
    seq: int
    kind: str  # step, validation
    step: int
    epoch: int | None = None
    data: dict[str, Any]
    created_at: datetime


class TinkerStep(_Wire):
    """An optimizer step of a Tinker training run, with the loss of the calls it applied."""

    step: int
    seq: int
    loss: float | None
    forward_backward: int
    learning_rate: float | None
    metrics: dict[str, float]
    created_at: datetime


class Dataset(_Wire):
    id: str
    name: str
    sha256: str
    num_examples: int
    splits: dict[str, int]
    created_at: datetime


class Project(_Wire):
    id: str
    name: str
    created_at: datetime


class Quotas(_Wire):
    """A project's quotas; None: no limit."""

    running_jobs: int | None = None
    queued_jobs: int | None = None
    submissions_per_minute: int | None = None
    trainer_seconds_per_day: int | None = None


class QuotaUsage(_Wire):
    running_jobs: int
    queued_jobs: int
    submissions_last_minute: int
    trainer_seconds_today: float


class ProjectQuotas(_Wire):
    project_id: str
    quotas: Quotas
    usage: QuotaUsage


class ApiKey(_Wire):
    id: str
    project_id: str
    name: str
    scopes: list[str]
    prefix: str
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None
    created_at: datetime


class ApiKeyCreated(ApiKey):
    secret: str
    tinker_api_key: str


class AuditEvent(_Wire):
    id: str
    at: datetime
    key_id: str | None
    project_id: str | None
    method: str
    route: str
    resource_id: str | None
    status: int
    request_id: str


class UsageRow(_Wire):
    group: str
    jobs: int = 0
    gateway_calls: int = 0
    trainer_seconds: float = 0.0
    rollout_seconds: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    trained_tokens: int = 0
    checkpoint_bytes: int | None = None
    cost: float = 0.0


class Usage(_Wire):
    since: datetime
    until: datetime
    group_by: str
    currency: str
    data: list[UsageRow]
    total: UsageRow


class WebhookEndpointHealth(_Wire):
    breaker: str
    consecutive_timeouts: int
    breaker_open_until: datetime | None
    answered_at: datetime | None


class WebhookEndpoint(_Wire):
    id: str
    url: str
    description: str
    event_types: list[str]
    enabled: bool
    secret_version: int
    health: WebhookEndpointHealth
    previous_secret_expires_at: datetime | None
    created_at: datetime
    updated_at: datetime


class WebhookEndpointCreated(WebhookEndpoint):
    secret: str


class WebhookAttempt(_Wire):
    attempt: int
    started_at: datetime
    duration_ms: int
    status_code: int | None
    error: str | None


class WebhookDelivery(_Wire):
    id: int
    message_id: str
    event_type: str
    job_id: str | None
    event_seq: int | None
    status: str
    attempts: list[WebhookAttempt]
    next_attempt_at: datetime | None
    created_at: datetime
    finished_at: datetime | None
