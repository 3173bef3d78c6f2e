"""Wire types of evaluation jobs: sample a fixed step of a model on examples, score each
answer with a grader, train nothing; the results paged, summed up, and two jobs compared."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.jobs.lifecycle import JobStatus
from app.schemas.common import NO_NUL, JsonObject
from app.schemas.graders import Grader
from app.schemas.jobs import WAITING_FOR, JobError, JobProgress
from app.schemas.pieces import EACH, Piece
from app.schemas.rollouts import Example
from app.schemas.usage import JobCost, JobUsage

SplitName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
MAX_SAMPLES_PER_EXAMPLE = 64


class EvaluationDataset(BaseModel):
    """A split of an uploaded dataset, named by the dataset's `id` or its `name` (the newest
    dataset of that name)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | None = Field(default=None, pattern=NO_NUL, max_length=40)
    name: str | None = Field(default=None, pattern=NO_NUL, max_length=128)
    split: SplitName = Field(default="validation", description="The split to evaluate.")

    @model_validator(mode="after")
    def _one(self) -> EvaluationDataset:
        if (self.id is None) == (self.name is None):
            raise ValueError("give exactly one of `id` or `name`")
        return self


class EvaluationSampling(BaseModel):
    """Sampling parameters sent to the step's OpenAI-compatible endpoint."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=256, ge=1, le=32768)
    stop: str | list[str] | None = None


class EvaluationJobCreate(BaseModel):
    """Score `samples_per_example` answers per example of one step of a model."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "model": "agent-7b@latest",
                    "examples": [
                        {
                            "id": "q1",
                            "messages": [{"role": "user", "content": "What is 2+2?"}],
                            "expected": "4",
                        }
                    ],
                    "grader": {"type": "numeric"},
                    "samples_per_example": 4,
                    "sampling": {"temperature": 0.7, "max_tokens": 64},
                }
            ]
        },
    )

    model: str = Field(
        pattern=NO_NUL,
        max_length=300,
        description="`name` (its latest step), `name@N` or `name@alias`: resolved to a step "
        "when the job is accepted, so a later training step changes nothing it evaluates.",
    )
    dataset: EvaluationDataset | None = Field(
        default=None, description="Evaluate a dataset's split (or give `examples`)."
    )
    examples: list[Example] | None = Field(
        default=None, min_length=1, max_length=10_000, description="Examples given inline."
    )
    grader: Grader = Field(description="How each answer is scored.")
    samples_per_example: int = Field(default=1, ge=1, le=MAX_SAMPLES_PER_EXAMPLE)
    sampling: EvaluationSampling = Field(default_factory=EvaluationSampling)
    concurrency: int = Field(default=8, ge=1, le=256, description="Requests in flight at once.")
    metadata: JsonObject = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> EvaluationJobCreate:
        if (self.dataset is None) == (self.examples is None):
            raise ValueError("give exactly one of `dataset` or `examples`")
        return self


EVALUATION_PIECES = (Piece(("examples", EACH), Example),)
"""How a large `EvaluationJobCreate` is validated: an example at a time."""


class EvaluationSummary(BaseModel):
    """What the job evaluates and, once it has succeeded, how the step scored."""

    model: str = Field(description="The model as given.")
    step: int = Field(description="The step evaluated: what `model` named when accepted.")
    dataset_id: str | None = None
    split: str | None = None
    examples_sha256: str = Field(
        description="The examples' digest: two jobs with the same one evaluated the same "
        "examples (what `compare` requires)."
    )
    num_examples: int
    samples_per_example: int
    num_samples: int = Field(description="Answers requested: examples x samples.")
    num_scored: int | None = Field(default=None, description="Answers with a score.")
    num_errors: int | None = Field(
        default=None, description="Answers not scored: a sampling or grading error, recorded."
    )
    mean_score: float | None = Field(default=None, description="Mean over scored answers.")
    pass_rate: float | None = Field(
        default=None,
        description="Share of scored answers that pass: a score above 0 (no grader has a "
        "threshold of its own; the local graders score 0 or 1).",
    )


class EvaluationJob(BaseModel):
    """A durable evaluation job."""

    id: str
    model: str = Field(description="The model's name.")
    status: JobStatus
    summary: EvaluationSummary
    progress: JobProgress = Field(description="Answers sampled and scored so far.")
    error: JobError | None
    metadata: dict[str, Any]
    attempts: int
    max_attempts: int
    cancel_requested: bool
    waiting_for: str | None = Field(default=None, description=WAITING_FOR)
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    usage: JobUsage = Field(description="What the job used (`GET /v1/usage` sums it).")
    cost: JobCost = Field(description="`usage` priced by `TRAINYARD_PRICES`: an estimate.")


class EvaluationResult(BaseModel):
    """One answer: the example it answers (its index in the job and its id), the sample's
    index, the answer, and its score, or the error that left it unscored."""

    example: int
    example_id: str
    sample: int
    answer: str | None
    score: float | None
    error: str | None
    created_at: datetime


class ExampleScores(BaseModel):
    """One example's scores over its samples (None where none was scored)."""

    example: int
    example_id: str
    num_scored: int
    num_errors: int
    mean: float | None
    min: float | None
    max: float | None
    stddev: float | None = Field(description="Population standard deviation.")


class EvaluationReport(BaseModel):
    """An evaluation's summary and its examples' scores, computed from its stored results."""

    job_id: str
    step: int
    num_examples: int
    num_scored: int
    num_errors: int
    mean_score: float | None
    pass_rate: float | None
    examples: list[ExampleScores]


class ExampleDelta(BaseModel):
    example: int
    example_id: str
    a: float | None = Field(description="The example's mean score in job `a`.")
    b: float | None
    delta: float | None = Field(description="`b - a`; None when either has no score.")


class EvaluationComparison(BaseModel):
    """Job `b` against job `a` on the same examples."""

    a: str
    b: str
    a_step: int
    b_step: int
    num_examples: int
    mean_delta: float | None = Field(description="Mean of the examples' deltas (`b - a`).")
    wins: int = Field(description="Examples where `b` scored higher.")
    losses: int = Field(description="Examples where `b` scored lower.")
    ties: int
    examples: list[ExampleDelta]
