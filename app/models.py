"""ORM rows. Wire models live in `app.schemas`; services convert between the two."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Boolean,
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


class JobStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in FINAL_STATUSES


FINAL_STATUSES = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})


class JobKind(enum.StrEnum):
    training = "training"
    rollout = "rollout"


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
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class JobRow(Base):
    """A unit of work for the workers, with its lease and its outcome."""

    __tablename__ = "jobs"
    __table_args__ = (
        # ART trains one step at a time per model: the database itself refuses a second
        # running job for a model, whatever the workers do.
        Index(
            "uq_jobs_running_model",
            "model_name",
            unique=True,
            sqlite_where=text("status = 'running'"),
            postgresql_where=text("status = 'running'"),
        ),
        Index("ix_jobs_claim", "status", "not_before", "created_at"),
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

    # Progress and outcome.
    start_step: Mapped[int | None] = mapped_column(Integer)
    progress_step: Mapped[int] = mapped_column(Integer, default=0)
    progress_total: Mapped[int | None] = mapped_column(Integer)
    final_step: Mapped[int | None] = mapped_column(Integer)
    checkpoint_path: Mapped[str | None] = mapped_column(Text)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    recovered: Mapped[bool] = mapped_column(Boolean, default=False)
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
    """A worker process; its heartbeat tells /readyz that jobs are being picked up."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    stopped_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
