"""Wire types of training runs (the whole RL loop as one resource) and of datasets."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.jobs.lifecycle import JobStatus
from app.schemas.common import NO_NUL, JsonObject
from app.schemas.graders import Grader
from app.schemas.jobs import JobError
from app.schemas.pieces import EACH, Piece
from app.schemas.rollouts import Agent, Example, Sampling
from app.schemas.supervised import MAX_EXAMPLES, SftExample
from app.schemas.usage import JobCost, JobUsage

SplitName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""A name a client gives (a split's): 1-64 ASCII letters, digits, `_`, `.` and `-`,
starting with a letter or digit, so never `.`, `..`, `__proto__` or a path."""


class DatasetExample(Example):
    """An example of a dataset (one JSONL line), or of a run's inline `examples`: a
    rollout example (its `id` and messages checked as every example's) with the split it
    belongs to."""

    split: Annotated[str, Field(pattern=NAME_PATTERN)] = Field(
        default="train",
        description="The split it belongs to: 1-64 ASCII letters, digits, `_`, `.` and `-`, "
        "starting with a letter or digit.",
    )


class Dataset(BaseModel):
    id: str
    name: str
    sha256: str = Field(description="SHA-256 of the uploaded bytes.")
    num_examples: int
    splits: dict[str, int] = Field(description="Examples per split.")
    created_at: datetime


class DatasetRef(BaseModel):
    """Examples of an uploaded dataset."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(pattern=NO_NUL, max_length=40, description="The dataset's id.")
    train_split: SplitName = "train"
    validation_split: SplitName | None = Field(
        default=None,
        description="The split `validation` samples; its default is `validation` when the "
        "run validates.",
    )


class Recipe(BaseModel):
    """How each step's examples become trajectory groups: as a rollout job does it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    num_generations: int = Field(default=4, ge=2, le=64, description="Answers per example.")
    sampling: Sampling = Field(default_factory=Sampling)
    grader: Grader | None = Field(default=None, description="How to score each answer.")
    agent: Agent | None = Field(
        default=None, description="Instead of sampling here, call this agent service."
    )
    concurrency: int = Field(default=8, ge=1, le=256, description="Requests in flight at once.")

    @model_validator(mode="after")
    def _one(self) -> Recipe:
        if (self.grader is None) == (self.agent is None):
            raise ValueError("give exactly one of `grader` (sample here) or `agent`")
        return self


class Schedule(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    epochs: int | None = Field(default=None, ge=1, le=10_000, description="Passes over `train`.")
    max_steps: int | None = Field(
        default=None, ge=1, le=100_000, description="Stop after this many steps."
    )
    examples_per_step: int = Field(default=8, ge=1, le=1024)
    shuffle_seed: int = Field(default=0, ge=0, le=2**63 - 1)

    @model_validator(mode="after")
    def _bounded(self) -> Schedule:
        if self.epochs is None and self.max_steps is None:
            raise ValueError("give `epochs`, `max_steps` or both")
        return self


class LearningRateSchedule(BaseModel):
    """The learning rate of step s (1-based) of `total` steps: `learning_rate` in
    `hyperparameters` times a factor that ramps up over `warmup_steps`, then stays
    (`constant`) or decays to `min_ratio` (`linear`, `cosine`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0, le=100_000)
    min_ratio: float = Field(default=0.0, ge=0, le=1)


class Validation(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    every_steps: int = Field(ge=1, le=100_000, description="Validate after every k steps.")
    num_generations: int = Field(default=4, ge=1, le=64)
    sampling: Sampling | None = Field(default=None, description="Default: the recipe's.")
    metric: Literal["mean_reward"] = "mean_reward"


class CheckpointPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    keep_best: bool = Field(default=True, description="Keep the best step by validation.")
    prune: bool = Field(
        default=True,
        description="Delete the run's other steps (through the checkpoint registry: an "
        "aliased or in-use step stays) after each validation and at the end.",
    )


class EarlyStopping(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    patience: int = Field(ge=1, le=10_000, description="Validations without improvement.")
    min_delta: float = Field(default=0.0, ge=0, description="Less is no improvement.")


class Curriculum(BaseModel):
    """Leave out of later epochs the examples whose groups were all solved or all failed
    (every answer the same reward) in each of the last `patience` epochs."""

    model_config = ConfigDict(extra="forbid", strict=True)

    patience: int = Field(default=1, ge=1, le=1000)
    min_examples: int = Field(
        default=1, ge=1, description="Never leave fewer examples than this in an epoch."
    )


class SftWarmup(BaseModel):
    """A run's supervised warm-up: one SFT step, as a training job with `method: sft`
    takes it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    examples: list[SftExample] = Field(
        min_length=1,
        max_length=MAX_EXAMPLES,
        description="OpenAI-shaped chats; their assistant turns are the targets.",
    )
    hyperparameters: JsonObject = Field(
        default_factory=dict,
        description="The backend's SFT keywords (`GET /v1/backends`: `methods.sft`).",
    )


class RunCreate(BaseModel):
    """Train a model on a dataset: sample, grade, group and train, step after step,
    validating and keeping the best checkpoint."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "model": "demo",
                    "examples": [
                        {
                            "id": "q1",
                            "messages": [{"role": "user", "content": "What is 2+2?"}],
                            "expected": "4",
                        },
                        {
                            "id": "v1",
                            "messages": [{"role": "user", "content": "What is 3+3?"}],
                            "expected": "6",
                            "split": "validation",
                        },
                    ],
                    "recipe": {"num_generations": 8, "grader": {"type": "numeric"}},
                    "schedule": {"epochs": 3, "examples_per_step": 4},
                    "validation": {"every_steps": 2},
                }
            ]
        },
    )

    model: str = Field(pattern=NO_NUL, description="Name of a registered model that is served.")
    dataset: DatasetRef | None = Field(default=None, description="Or `examples`.")
    examples: list[DatasetExample] | None = Field(
        default=None, min_length=1, max_length=10_000, description="Inline examples."
    )
    recipe: Recipe
    schedule: Schedule
    hyperparameters: JsonObject = Field(
        default_factory=dict, description="Each step's, as a training job takes them."
    )
    learning_rate_schedule: LearningRateSchedule | None = None
    validation: Validation | None = None
    checkpoints: CheckpointPolicy = Field(default_factory=CheckpointPolicy)
    early_stopping: EarlyStopping | None = None
    curriculum: Curriculum | None = None
    warmup: SftWarmup | None = Field(
        default=None,
        description="A supervised warm-up before RL: one SFT step on these chats (a "
        "training job of the run, `run_role: warmup`), before the first validation and "
        "the first rollout.",
    )
    max_steps_off_policy: int = Field(
        default=0,
        ge=0,
        le=1,
        description="0: each step samples the policy the previous step made. 1: step s+1's "
        "rollout starts as soon as step s's groups are built, so it samples the policy "
        "before step s; the policy-version guard refuses data more than one step old. A "
        "model runs one job at a time: sampling and training do not overlap yet.",
    )
    metadata: JsonObject = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> RunCreate:
        if (self.dataset is None) == (self.examples is None):
            raise ValueError("give exactly one of `dataset` or `examples`")
        if self.early_stopping is not None and self.validation is None:
            raise ValueError("`early_stopping` needs `validation`")
        if self.learning_rate_schedule is not None and "learning_rate" not in self.hyperparameters:
            raise ValueError("`learning_rate_schedule` needs `hyperparameters.learning_rate`")
        return self


RUN_PIECES = (Piece(("examples", EACH), DatasetExample),)


class RunProgress(BaseModel):
    step: int = Field(description="Steps trained so far.")
    total_steps: int
    epoch: int = Field(description="The epoch under way (1-based; 0 before the first).")
    epochs: int | None
    percent: float
    phase: Literal["queued", "warmup", "rollout", "training", "validation", "paused", "done"]
    eta_seconds: float | None = Field(description="Estimated time left, from the steps so far.")


class BestCheckpoint(BaseModel):
    step: int
    score: float = Field(description="Its validation metric.")


class Run(BaseModel):
    """A durable training run."""

    id: str
    model: str
    status: JobStatus
    paused: bool
    progress: RunProgress
    best_checkpoint: BestCheckpoint | None
    stop_reason: str | None = Field(
        description="`completed`, `early_stopping`, `cancelled` or `failed` once it ended."
    )
    current_jobs: list[str] = Field(description="The child jobs it waits on now.")
    error: JobError | None
    metadata: dict[str, Any]
    cancel_requested: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    usage: JobUsage = Field(description="What its child jobs used, summed.")
    cost: JobCost = Field(description="`usage` priced by `TRAINYARD_PRICES`: an estimate.")


class RunSettings(BaseModel):
    """What a run was asked to do, as it stores it: its request's settings with defaults
    filled in and hyper-parameters normalized for the model's backend; not its examples,
    and never a grader's or agent's `headers` (write-only) or its URL's query."""

    dataset: dict[str, Any] | None = Field(description="`dataset` (null: inline examples).")
    num_train: int = Field(description="Examples in the train split.")
    num_validation: int = Field(description="Examples validations sample (0: none).")
    recipe: dict[str, Any]
    schedule: dict[str, Any]
    hyperparameters: dict[str, Any]
    learning_rate_schedule: dict[str, Any] | None
    validation: dict[str, Any] | None
    checkpoints: dict[str, Any]
    early_stopping: dict[str, Any] | None
    curriculum: dict[str, Any] | None
    max_steps_off_policy: int
    warmup: dict[str, Any] | None = Field(
        default=None,
        description="The SFT warm-up (null: none): its `hyperparameters` and "
        "`num_examples`, never the examples.",
    )
    start_step: int | None = Field(
        description="The model's step when the run started (null until then): its step 0. "
        "A step's row in `/metrics` counts the run's steps, a validation's the model's."
    )


class RunMetric(BaseModel):
    """A point of a run's curves: a training step, or a validation of a checkpoint."""

    seq: int
    kind: Literal["step", "validation"]
    step: int = Field(description="The model step it trained (step) or sampled (validation).")
    epoch: int | None = None
    data: dict[str, Any] = Field(
        description="step: reward_mean, reward_std, trainable_share, loss and the trainer's "
        "metrics, tokens, sampling_s, training_s, learning_rate, job ids. validation: "
        "score, reward_mean, num_samples, job_id."
    )
    created_at: datetime


class RunEstimate(BaseModel):
    """What a run would use and cost (`POST /v1/run-estimates`): nothing is stored.
    Tokens are upper bounds (every answer at `max_tokens`, every step a full batch);
    seconds follow the model's own recent jobs. A figure that cannot be estimated is null,
    and `notes` says why."""

    dry_run: Literal[True] = True
    model: str
    total_steps: int = Field(description="Training steps, as far as known now.")
    samples: int = Field(description="Answers sampled: rollouts and validations.")
    validations: int = Field(description="Validations (the first one, of the start step, too).")
    usage: JobUsage
    cost: JobCost
    notes: list[str] = Field(description="How each figure was estimated, or why it is null.")
