"""Wire types of training jobs and their events."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.jobs.lifecycle import EventType, JobStatus
from app.schemas.common import NO_NUL, JsonObject
from app.schemas.pieces import EACH, Piece
from app.schemas.supervised import DpoSummary, Method, SftSummary
from app.schemas.trajectories import (
    NAT_COLLECTION_EXAMPLE,
    ArtTrajectory,
    ArtTrajectoryGroup,
    NatTrajectory,
    TrajectoryCollection,
    TrajectorySummary,
)
from app.schemas.usage import JobCost, JobUsage

WAITING_FOR = (
    'Queued, and no live worker can run it: why, e.g. "no live worker in pool `gpu` runs '
    'backend `art-local`". It starts as soon as a worker that can registers. Null otherwise.'
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
    method: Literal["rl"] = Field(
        default="rl",
        description="`rl` (this shape, the default): a step on rewarded trajectory groups. "
        "`sft` and `dpo` take other shapes (`SftJobCreate`, `DpoJobCreate`).",
    )
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
    policy_step: int | None = Field(
        default=None,
        ge=0,
        le=2**31 - 1,
        description="The model step the trajectories were sampled from (its policy "
        "version). Rollout jobs set it on the training job they enqueue.",
    )
    max_steps_off_policy: int | None = Field(
        default=None,
        ge=0,
        le=2**31 - 1,
        description="How many steps the model may have moved past `policy_step` when a "
        "worker takes the job; staler data fails the job (`StalePolicy`) instead of "
        "training. 0: strictly on-policy. Null: any. Needs `policy_step`.",
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> TrainingJobCreate:
        if (self.collection is None) == (self.groups is None):
            raise ValueError("give exactly one of `collection` or `groups`")
        if self.max_steps_off_policy is not None and self.policy_step is None:
            raise ValueError("`max_steps_off_policy` needs `policy_step`")
        return self


TrajectoryShape = Literal["art", "nat"]


class TrainingTrajectories(BaseModel):
    """A training job's trajectories in ART's shape."""

    groups: list[ArtTrajectoryGroup]


TRAINING_PIECES = (
    Piece(("groups", EACH, "trajectories", EACH), ArtTrajectory),
    Piece(("groups", EACH), ArtTrajectoryGroup),
    Piece(("collection", "trajectories", EACH, EACH), NatTrajectory),
    Piece(("collection", "trajectories", EACH), list[NatTrajectory]),
)
"""How a large `TrainingJobCreate` is validated: a trajectory, then a group, at a time."""


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
    trained: bool | None = Field(
        description="Whether the step changed the weights. False: the step counted (as in ART) "
        "but nothing was learned; `reason` says why. Null: not known (a recovered step)."
    )
    reason: str | None = Field(description="Why nothing was trained, when `trained` is false.")


class JobError(BaseModel):
    type: str = Field(description="Error class, e.g. `BackendError`.")
    message: str
    transient: bool = Field(description="Whether it was worth retrying.")


class TrainingJob(BaseModel):
    """A durable training job."""

    id: str
    model: str
    status: JobStatus
    method: Method = Field(
        default="rl", description="`rl`, `sft` (supervised) or `dpo` (preference pairs)."
    )
    summary: TrajectorySummary | SftSummary | DpoSummary = Field(
        description="What the job was given: trajectory counts (rl), examples (sft), pairs (dpo)."
    )
    hyperparameters: dict[str, Any]
    metadata: dict[str, Any]
    policy_step: int | None = Field(description="The model step the trajectories came from.")
    max_steps_off_policy: int | None
    progress: JobProgress
    result: JobResult | None = Field(description="Set once the job succeeded.")
    error: JobError | None = Field(description="The last error, if any.")
    attempts: int = Field(description="Times a worker started this job.")
    max_attempts: int
    cancel_requested: bool
    waiting_for: str | None = Field(default=None, description=WAITING_FOR)
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    usage: JobUsage = Field(description="What the job used (`GET /v1/usage` sums it).")
    cost: JobCost = Field(description="`usage` priced by `TRAINYARD_PRICES`: an estimate.")


class JobEvent(BaseModel):
    """One entry of a job's append-only history."""

    seq: int = Field(description="Position in the job's history, from 1; also the SSE event id.")
    type: EventType = Field(
        description="What happened. Any job: `job_queued`, `job_claimed`, `job_retrying`, "
        "`job_released`, `cancel_requested`, `job_cancelled`. Training jobs: "
        "`training_started`, `gradient_step`, `training_ended`, `training_failed`. Rollout "
        "jobs: `rollout_started`, `rollout_progress`, `rollout_ended`, `rollout_failed`. "
        "Evaluation jobs: `evaluation_started`, `evaluation_progress`, `evaluation_ended`, "
        "`evaluation_failed`."
    )
    created_at: datetime
    data: dict[str, Any]
