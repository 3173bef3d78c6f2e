"""Wire types of training jobs and their events."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.models import JobStatus
from app.schemas.common import NO_NUL, JsonObject
from app.schemas.trajectories import (
    NAT_COLLECTION_EXAMPLE,
    ArtTrajectoryGroup,
    TrajectoryCollection,
    TrajectorySummary,
)


class TrainingJobCreate(BaseModel):
    """Trajectories to train one step on: NAT's `collection` or ART-style `groups`, not both."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,  # "1.0" is no number here (see RolloutJobCreate)
        json_schema_extra={
            "examples": [
                {
                    "model": "agent-7b",
                    "collection": NAT_COLLECTION_EXAMPLE,
                    "hyperparameters": {"learning_rate": 1e-5},
                    "metadata": {"experiment": "baseline"},
                }
            ]
        },
    )

    model: str = Field(pattern=NO_NUL, description="Name of a registered model.")
    collection: TrajectoryCollection | None = Field(
        default=None,
        description="A NeMo Agent Toolkit `TrajectoryCollection`, as NAT serializes it.",
    )
    groups: list[ArtTrajectoryGroup] | None = Field(
        default=None,
        description="ART-style trajectory groups (OpenAI-shaped messages and choices).",
    )
    hyperparameters: JsonObject = Field(
        default_factory=dict,
        description="Training keywords the model's backend accepts (see `GET /v1/backends`); "
        "an unknown one is rejected.",
        examples=[{"learning_rate": 1e-5, "kl_penalty_coef": 0.1}],
    )
    metadata: JsonObject = Field(
        default_factory=dict, description="Free-form labels, returned with the job."
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> TrainingJobCreate:
        if (self.collection is None) == (self.groups is None):
            raise ValueError("give exactly one of `collection` or `groups`")
        return self


class JobProgress(BaseModel):
    """Where a job stands: gradient step `step` of `total` in the current training step."""

    step: int = Field(description="Gradient steps done.")
    total: int | None = Field(description="Gradient steps in this training step, once known.")
    percent: float | None = Field(description="100 * step / total, once total is known.")


class JobResult(BaseModel):
    """What a finished training job produced."""

    start_step: int | None = Field(description="Model step before this job trained.")
    final_step: int | None = Field(description="Model step after this job.")
    checkpoint_path: str | None = Field(description="Checkpoint the backend wrote, if it says.")
    metrics: dict[str, Any] | None = Field(description="Training metrics the backend reported.")
    recovered: bool = Field(
        description="The worker died after the step happened; the step was found and counted once."
    )


class JobError(BaseModel):
    type: str = Field(description="Error class, e.g. `BackendError`.")
    message: str
    transient: bool = Field(description="Whether it was worth retrying.")


class TrainingJob(BaseModel):
    """A durable training job."""

    id: str
    model: str
    status: JobStatus
    summary: TrajectorySummary
    hyperparameters: dict[str, Any]
    metadata: dict[str, Any]
    progress: JobProgress
    result: JobResult | None = Field(description="Set once the job succeeded.")
    error: JobError | None = Field(description="The last error, if any.")
    attempts: int = Field(description="Times a worker started this job.")
    max_attempts: int
    cancel_requested: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobEvent(BaseModel):
    """One entry of a job's append-only history."""

    seq: int = Field(description="Position in the job's history, from 1; also the SSE event id.")
    type: str = Field(
        description="job_queued, training_started, gradient_step, training_ended, "
        "training_failed, job_retrying, cancel_requested, job_cancelled, ..."
    )
    created_at: datetime
    data: dict[str, Any]
