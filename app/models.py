"""ORM rows. Wire models live in `app.schemas`; services convert between the two."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, JSONType, UTCDateTime, utcnow
from app.jobs.lifecycle import JobKind, JobStatus

DEFAULT_PROJECT_ID = "proj_default"
"""The project every row written before projects existed belongs to (migration 0014), and
the one a new row gets when its writer names none."""


def _project_id() -> Mapped[str]:
    # Migration 0014: NOT NULL, the default project's id as the server default.
    return mapped_column(String(40), server_default=DEFAULT_PROJECT_ID)


class ModelRow(Base):
    """A trainable model: a name on a trainer backend, and where it is served."""

    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    project: Mapped[str] = mapped_column(String(128))
    base_model: Mapped[str] = mapped_column(String(512))
    backend: Mapped[str] = mapped_column(String(64))
    config: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    current_step: Mapped[int] = mapped_column(Integer, default=0)
    # current_step is the backend's own, read since the model last trained: a claim can
    # record a job's start step from it (migration 0003).
    step_known: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    inference_base_url: Mapped[str | None] = mapped_column(String(1024))
    inference_model_name: Mapped[str | None] = mapped_column(String(256))
    # The key that endpoint takes for this model (the cpu backend's are per model), for a
    # gateway in another process (migration 0020). Never shown by any route.
    inference_api_key: Mapped[str | None] = mapped_column(String(256))
    # The pool whose workers run its jobs (NULL: `default`), and the labels such a worker
    # must have (NULL: none) (migration 0011).
    pool: Mapped[str | None] = mapped_column(String(64))
    labels: Mapped[dict[str, str] | None] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    project_id: Mapped[str] = _project_id()


class ModelAliasRow(Base):
    """A user-defined name for one of a model's checkpoints (`name@alias` at the gateway).
    The built-in aliases (`latest`, `best`) are computed, never stored (migration 0006)."""

    __tablename__ = "model_aliases"
    __table_args__ = (CheckConstraint("step >= 0", name="step_not_negative"),)

    model_name: Mapped[str] = mapped_column(
        ForeignKey("models.name", ondelete="CASCADE"), primary_key=True
    )
    alias: Mapped[str] = mapped_column(String(64), primary_key=True)
    step: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class RetentionPolicyRow(Base):
    """Which of a model's checkpoints to keep: the newest `keep_last`, and the best by a
    training metric (migration 0006). Without a row every checkpoint is kept."""

    __tablename__ = "retention_policies"
    __table_args__ = (CheckConstraint("keep_last >= 1", name="keep_last_positive"),)

    model_name: Mapped[str] = mapped_column(
        ForeignKey("models.name", ondelete="CASCADE"), primary_key=True
    )
    keep_last: Mapped[int] = mapped_column(Integer)
    keep_best_by: Mapped[str | None] = mapped_column(String(256))
    higher_is_better: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class JobRow(Base):
    """A unit of work for the workers, with its lease and its outcome."""

    __tablename__ = "jobs"
    __table_args__ = (
        # ART trains one step at a time per model: the database itself refuses a second
        # running job for a model, whatever the workers do.
        # A run (kind `run`) holds no slot: its children do (migration 0007).
        Index(
            "uq_jobs_running_model",
            "model_name",
            unique=True,
            sqlite_where=text("status = 'running' AND kind <> 'run'"),
            postgresql_where=text("status = 'running' AND kind <> 'run'"),
        ),
        # The runs a driver advances (migration 0007).
        Index(
            "ix_jobs_active_runs",
            "id",
            sqlite_where=text("kind = 'run' AND status IN ('queued', 'running')"),
            postgresql_where=text("kind = 'run' AND status IN ('queued', 'running')"),
        ),
        # Claims scan queued jobs in fair order: by their place in their project's share,
        # then by submission (migration 0015; was by submission alone, 0004).
        Index(
            "ix_jobs_queued_fair",
            "fair_seq",
            "id",
            sqlite_where=text("status = 'queued'"),
            postgresql_where=text("status = 'queued'"),
        ),
        # A project's queued jobs (its queued quota, the fair place of its next job) and
        # running ones (its running quota) (migration 0015).
        Index(
            "ix_jobs_project_queued",
            "project_id",
            "fair_seq",
            sqlite_where=text("status = 'queued'"),
            postgresql_where=text("status = 'queued'"),
        ),
        Index(
            "ix_jobs_project_running",
            "project_id",
            "fair_seq",
            sqlite_where=text("status = 'running' AND kind <> 'run'"),
            postgresql_where=text("status = 'running' AND kind <> 'run'"),
        ),
        # A project's submissions in the last minute and trainer time today (0015).
        Index("ix_jobs_project_created", "project_id", "created_at"),
        Index("ix_jobs_model_created", "model_name", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), default=JobKind.training.value)
    model_name: Mapped[str] = mapped_column(ForeignKey("models.name"))
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.queued.value)

    # The accepted request: trajectories (zstd-compressed JSON) and its parameters.
    # Deferred: reading a job (GET, lists, streams) never loads the trajectories.
    payload: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)
    payload_format: Mapped[str] = mapped_column(String(64))
    payload_bytes: Mapped[int] = mapped_column(Integer)
    hyperparameters: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSONType, default=dict)
    summary: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    request_hash: Mapped[str] = mapped_column(String(64))

    # Claiming and recovery.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer)
    lease_token: Mapped[str | None] = mapped_column(String(64))
    lease_owner: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    not_before: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)

    # Policy versions (migration 0005): the step the trajectories were sampled from, and
    # how far the model may have moved past it when the job is claimed (None: any).
    policy_step: Mapped[int | None] = mapped_column(Integer)
    max_steps_off_policy: Mapped[int | None] = mapped_column(Integer)

    # Progress and outcome.
    start_step: Mapped[int | None] = mapped_column(Integer)
    progress_step: Mapped[int] = mapped_column(Integer, default=0)
    progress_total: Mapped[int | None] = mapped_column(Integer)
    final_step: Mapped[int | None] = mapped_column(Integer)
    checkpoint_path: Mapped[str | None] = mapped_column(Text)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    recovered: Mapped[bool] = mapped_column(Boolean, default=False)
    # Whether the step changed the weights (False: no group was trainable).
    trained: Mapped[bool | None] = mapped_column(Boolean)
    # What a rollout job built (zstd JSON of ART-style groups), and the training job it
    # enqueued with them, if asked to.
    output: Mapped[bytes | None] = mapped_column(LargeBinary, deferred=True)
    output_bytes: Mapped[int | None] = mapped_column(Integer)
    next_job_id: Mapped[str | None] = mapped_column(String(40))
    last_event_seq: Mapped[int] = mapped_column(Integer, default=0)

    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    project_id: Mapped[str] = _project_id()
    # The job's place in the fair claim order (migration 0015): its project's previous
    # queued job's place + 1, or the place being served now if that is later
    # (`app.jobs.statements.fair_place`). Claims take the lowest first, so projects take turns.
    fair_seq: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    # Submitted through the API (migration 0015), not made by a run or a rollout: what a
    # project's submissions-per-minute quota counts.
    submitted: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # What the job used (migration 0016), written by its final write; None: not counted.
    # Tokens sampled (rollout and evaluation jobs, run validations: the endpoint's `usage`)
    # and trained (training jobs: what the trainer is handed, `app.training.tokens`).
    prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)
    completion_tokens: Mapped[int | None] = mapped_column(BigInteger)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger)
    # Seconds of the attempts that went back to the queue (migration 0018), each from its
    # claim to the write that sent it back (`statements.job_update` adds it), and `attempts`
    # as that write left it: until a claim raises `attempts` past it, the last attempt is
    # among them. A job's seconds are these and its last attempt's (`usage.seconds_of`).
    earlier_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default=text("0"))
    returned_at_attempt: Mapped[int | None] = mapped_column(Integer)
    # The API key that submitted it (migration 0016); None: a key from TRAINYARD_API_KEYS,
    # no key, or a job that a run or a rollout made.
    key_id: Mapped[str | None] = mapped_column(String(40))


class GatewayUsageRow(Base):
    """One answered gateway call whose tokens are known (migration 0016): append-only,
    written in batches off the request (`app.tenants.metering`)."""

    __tablename__ = "gateway_usage"
    __table_args__ = (
        Index("ix_gateway_usage_project_created", "project_id", "created_at"),
        Index("ix_gateway_usage_created", "created_at"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    project_id: Mapped[str] = mapped_column(String(40))
    key_id: Mapped[str | None] = mapped_column(String(40))
    model: Mapped[str] = mapped_column(String(512))
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)


class RunRow(Base):
    """A training run's schedule state, beside its `jobs` row (kind `run`): which step,
    epoch and phase it is in, its best validation, what it is waiting for. `version`
    guards every write: two drivers of one run never both advance it (migration 0007)."""

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, default=0)
    paused: Mapped[bool] = mapped_column(Boolean, default=False)
    state: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    # The child job the state waits on (None: none): what a driver's sweep joins on to find
    # the runs with something to do.
    waiting_on: Mapped[str | None] = mapped_column(String(40))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    project_id: Mapped[str] = _project_id()


class RunMetricRow(Base):
    """One row per training step and per validation of a run: what its curves plot."""

    __tablename__ = "run_metrics"

    run_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # "step" | "validation"
    step: Mapped[int] = mapped_column(Integer)
    data: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class DatasetRow(Base):
    """Examples uploaded once (JSONL), kept in named splits, zstd-compressed JSON."""

    __tablename__ = "datasets"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    sha256: Mapped[str] = mapped_column(String(64))
    num_examples: Mapped[int] = mapped_column(Integer)
    splits: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    payload: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)
    payload_bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    project_id: Mapped[str] = _project_id()


class JobEventRow(Base):
    """Append-only history of a job; `seq` counts from 1 per job and is the SSE event id."""

    __tablename__ = "job_events"
    __table_args__ = (UniqueConstraint("job_id", "seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    type: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class WorkerRow(Base):
    """A worker process; its heartbeat tells /readyz that jobs are being picked up, and
    what it can run (pool, backends, labels: migration 0011) which queued jobs wait for."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    stopped_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    pool: Mapped[str | None] = mapped_column(String(64))
    backends: Mapped[list[str] | None] = mapped_column(JSONType)
    labels: Mapped[dict[str, str] | None] = mapped_column(JSONType)
    version: Mapped[str | None] = mapped_column(String(64))
    # It stopped claiming and is finishing or handing back what it runs.
    draining: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # When a drain was asked of it (`POST /v1/workers/{id}/drain`, `trainyard worker
    # --drain`); the worker reads it with its heartbeat.
    drain_requested: Mapped[datetime | None] = mapped_column(UTCDateTime)


class WebhookEndpointRow(Base):
    """A URL that receives signed deliveries of the event types it subscribes to
    (migration 0008). `secret` (`whsec_...`) signs them; the API shows it once. After a
    rotation (migration 0009) `previous_secret` signs them too, until its expiry."""

    __tablename__ = "webhook_endpoints"
    # A project's endpoints (migration 0016).
    __table_args__ = (Index("ix_webhook_endpoints_project_id", "project_id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    url: Mapped[str] = mapped_column(String(2048))
    description: Mapped[str] = mapped_column(String(512), default="")
    secret: Mapped[str] = mapped_column(String(128))
    previous_secret: Mapped[str | None] = mapped_column(String(128))
    previous_secret_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    event_types: Mapped[list[str]] = mapped_column(JSONType, default=list)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    # Migration 0010. The URL's host: senders cap in-flight deliveries per host.
    host: Mapped[str] = mapped_column(String(255), default="", server_default="")
    # 1 at registration, one more at each rotation (the answer of a rotation says which).
    secret_version: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # When a sender last took one of its deliveries: the longest waiting is served first.
    last_claimed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Attempts in a row that timed out, and when it last answered.
    consecutive_timeouts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    answered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The circuit breaker: nothing is sent to it before this (None: closed).
    breaker_open_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    project_id: Mapped[str] = _project_id()


class WebhookSubscriptionRow(Base):
    """One event type an endpoint receives: what the outbox joins on, in the writing
    transaction, to know who gets a state change (the key leads with the type)."""

    __tablename__ = "webhook_subscriptions"

    event_type: Mapped[str] = mapped_column(String(32), primary_key=True)
    endpoint_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), primary_key=True
    )


class WebhookDeliveryRow(Base):
    """The outbox: one message to one endpoint, written in the transaction of the state
    change it reports; sent by workers, which claim it with a lease (`lease_token`, and
    `next_attempt_at` moved past the lease), until it succeeds or its retries run out."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        # One delivery per state change and endpoint, whatever writes it.
        UniqueConstraint("endpoint_id", "message_id"),
        # The senders' claim scans the pending deliveries by due time.
        Index(
            "ix_webhook_deliveries_due",
            "next_attempt_at",
            sqlite_where=text("status = 'pending'"),
            postgresql_where=text("status = 'pending'"),
        ),
        Index("ix_webhook_deliveries_endpoint", "endpoint_id", "id"),
        # The in-flight deliveries (leased) the senders' caps count (migration 0010).
        Index(
            "ix_webhook_deliveries_leased",
            "endpoint_id",
            sqlite_where=text("status = 'pending' AND lease_token IS NOT NULL"),
            postgresql_where=text("status = 'pending' AND lease_token IS NOT NULL"),
        ),
        # The senders' retention pass deletes ended deliveries by age (migration 0009).
        Index(
            "ix_webhook_deliveries_finished",
            "finished_at",
            sqlite_where=text("finished_at IS NOT NULL"),
            postgresql_where=text("finished_at IS NOT NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    # The `webhook-id` header: the same on every attempt (`msg_<job id>_<event seq>`).
    message_id: Mapped[str] = mapped_column(String(96))
    event_type: Mapped[str] = mapped_column(String(32))
    # The job event it reports (None: a test message); the body is built from it.
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    event_seq: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    lease_token: Mapped[str | None] = mapped_column(String(64))
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class WebhookAttemptRow(Base):
    """One attempt to send a delivery: its answer's status, or the error, and how long."""

    __tablename__ = "webhook_attempts"

    delivery_id: Mapped[int] = mapped_column(
        ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), primary_key=True
    )
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    duration_ms: Mapped[int] = mapped_column(Integer)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)


class TinkerOperationRow(Base):
    """One operation of a Tinker training run, written when it is accepted and again when it
    is done: the run's journal. A restarted process makes the run again from its registry
    model by doing its operations over, in `seq` order, and answers a retrieve of a future
    from its `result` (`app.tinker.journal`)."""

    __tablename__ = "tinker_operations"
    __table_args__ = (UniqueConstraint("model_name", "seq"),)

    request_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    model_name: Mapped[str] = mapped_column(String(128))  # the run's registry model
    model_id: Mapped[str] = mapped_column(String(128))  # the SDK's `<session>:train:<seq>`
    seq: Mapped[int] = mapped_column(Integer)  # the run's order of acceptance, from 1
    kind: Mapped[str] = mapped_column(String(32))
    body: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)  # as the SDK sent it
    result_type: Mapped[str | None] = mapped_column(String(8))  # proto | json | error
    result: Mapped[bytes | None] = mapped_column(LargeBinary, deferred=True)
    category: Mapped[str | None] = mapped_column(String(16))  # an error's: user | server
    step: Mapped[int | None] = mapped_column(Integer)  # a save's checkpoint step
    path: Mapped[str | None] = mapped_column(String(300))  # a save's tinker:// path
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    done_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class TinkerSamplerRow(Base):
    """A Tinker sampling session: what it samples from (a `tinker://` path, or a base model
    with no adapter), so that a restarted process samples from it again by its id."""

    __tablename__ = "tinker_samplers"

    sampler_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    base_model: Mapped[str] = mapped_column(Text)
    model_path: Mapped[str | None] = mapped_column(String(300))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Migration 0017: its run's project, or the project of the key that made a sampler of a
    # base model; NULL on rows from before (a registered base model's project, or none).
    project_id: Mapped[str | None] = mapped_column(String(40))


class TinkerSessionRow(Base):
    """A Tinker session (the SDK's `create_session`) and the project of the key that made
    it, so that a restarted process tells another project's key there is no such session."""

    __tablename__ = "tinker_sessions"

    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class EvaluationResultRow(Base):
    """One scored answer of an evaluation job: the `sample`-th answer to the `example`-th
    example it evaluates (`app.evaluations`). Its key is the answer's place, so a retried
    job writing an answer again adds nothing (the write ignores a row already there)."""

    __tablename__ = "evaluation_results"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    example: Mapped[int] = mapped_column(Integer, primary_key=True)  # index in the job's examples
    sample: Mapped[int] = mapped_column(Integer, primary_key=True)
    example_id: Mapped[str] = mapped_column(String(200))  # the example's own id, as text
    answer: Mapped[str | None] = mapped_column(Text)
    score: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ProjectRow(Base):
    """A project: what keys, and the rows they make, belong to (migration 0014)."""

    __tablename__ = "projects"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Quotas an admin sets (migration 0015; NULL: no limit): jobs running at once (over
    # it, jobs wait queued), jobs queued, submissions in any minute, and trainer-seconds
    # in a UTC day (over those, a submission is refused with 429).
    max_running_jobs: Mapped[int | None] = mapped_column(Integer)
    max_queued_jobs: Mapped[int | None] = mapped_column(Integer)
    max_submissions_per_minute: Mapped[int | None] = mapped_column(Integer)
    max_trainer_seconds_per_day: Mapped[int | None] = mapped_column(Integer)
    # Raised by each Postgres claim that starts jobs of this project while it has a running
    # quota (migration 0019): a claim whose snapshot read an older value passes the project
    # over (`app.jobs.statements.claim_query`).
    claim_seq: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))


class ApiKeyRow(Base):
    """A key of a project: only the SHA-256 of its secret is kept (hex), and the secret's
    first characters to tell keys apart (migration 0014)."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[str] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), index=True
    )
    name: Mapped[str] = mapped_column(String(128))
    scopes: Mapped[list[str]] = mapped_column(JSONType)
    secret_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class AuditEventRow(Base):
    """A request that changed something (or tried to): who, what route, its answer
    (migration 0014). Never a secret, never a body."""

    __tablename__ = "audit_events"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    key_id: Mapped[str | None] = mapped_column(String(40))
    project_id: Mapped[str | None] = mapped_column(String(40))
    method: Mapped[str] = mapped_column(String(8))
    route: Mapped[str] = mapped_column(String(256))
    resource_id: Mapped[str | None] = mapped_column(String(256))
    status: Mapped[int] = mapped_column(Integer)
    request_id: Mapped[str] = mapped_column(String(128))
