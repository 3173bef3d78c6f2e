"""Wire types of rollout jobs: Trainyard samples the model, grades, groups, and can train."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, HttpUrl, model_validator

from app.models import JobStatus
from app.rollouts.graders import NEEDS_EXPECTED, Grader
from app.schemas.common import NO_NUL, JsonObject, plain_json
from app.schemas.jobs import JobError, JobProgress

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


class Example(BaseModel):
    """One prompt to sample answers for."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: Annotated[str, Field(pattern=NO_NUL)] | int = Field(
        description="Your id for the example; unique in the job."
    )
    messages: Annotated[list[dict[str, Any]], AfterValidator(plain_json)] = Field(
        min_length=1, description="OpenAI-shaped chat messages: the prompt."
    )
    expected: Annotated[Any, AfterValidator(plain_json)] = Field(
        default=None, description="The reference answer graders compare to."
    )
    metadata: JsonObject = Field(default_factory=dict)

    @model_validator(mode="after")
    def _roles(self) -> Example:
        for i, message in enumerate(self.messages):
            role = message.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise ValueError(f"messages[{i}].role must be one of {sorted(ROLES)}")
        return self


class Sampling(BaseModel):
    """Sampling parameters sent to the model's OpenAI-compatible endpoint."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=256, ge=1, le=32768)
    stop: str | list[str] | None = None
    tools: Annotated[list[dict[str, Any]] | None, AfterValidator(plain_json)] = Field(
        default=None, description="OpenAI tool specs."
    )


class Agent(BaseModel):
    """An agent service that runs its own episode per example and generation."""

    model_config = ConfigDict(extra="forbid", strict=True)

    url: HttpUrl = Field(
        description="Trainyard POSTs {example, generation, model: {base_url, api_key, name}} "
        "and expects {trajectory (NAT or ART format), reward?}."
    )
    timeout_s: float = Field(default=300, gt=0, le=3600)
    headers: dict[str, str] = Field(default_factory=dict)


class TrainAfter(BaseModel):
    """Enqueue a training job with the built groups when the rollout succeeds."""

    model_config = ConfigDict(extra="forbid", strict=True)

    hyperparameters: JsonObject = Field(default_factory=dict)


class RolloutJobCreate(BaseModel):
    """Sample `num_generations` answers per example, grade them, group them per example."""

    model_config = ConfigDict(
        extra="forbid",
        # A value of another JSON type than the schema gives is refused, not coerced: "4" is
        # no integer, 1 no boolean (the same in every request model).
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "model": "agent-7b",
                    "examples": [
                        {
                            "id": "q1",
                            "messages": [{"role": "user", "content": "What is 2+2?"}],
                            "expected": "4",
                        }
                    ],
                    "num_generations": 4,
                    "grader": {"type": "numeric"},
                    "train": {"hyperparameters": {"learning_rate": 1e-5}},
                }
            ]
        },
    )

    model: str = Field(pattern=NO_NUL, description="Name of a registered model that is served.")
    examples: list[Example] = Field(min_length=1, max_length=10_000)
    num_generations: int = Field(default=4, ge=1, le=64)
    sampling: Sampling = Field(default_factory=Sampling)
    grader: Grader | None = Field(default=None, description="How to score each answer.")
    agent: Agent | None = Field(
        default=None, description="Instead of sampling here, call this agent service."
    )
    concurrency: int = Field(default=8, ge=1, le=256, description="Requests in flight at once.")
    train: TrainAfter | None = Field(default=None, description="Then train on the groups.")
    metadata: JsonObject = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> RolloutJobCreate:
        if (self.grader is None) == (self.agent is None):
            raise ValueError("give exactly one of `grader` (sample here) or `agent`")
        ids = [e.id for e in self.examples]
        if len(set(map(str, ids))) != len(ids):
            raise ValueError("example ids must be unique")
        return self


class RolloutSummary(BaseModel):
    num_examples: int
    num_generations: int
    num_samples: int = Field(description="Answers requested: examples x generations.")
    num_graded: int = Field(default=0, description="Answers with a reward.")
    num_errors: int = Field(default=0, description="Samples or grades that failed (recorded).")
    mean_reward: float | None = None
    untrainable_groups: list[str | int] = Field(
        default_factory=list, description="Examples whose answers all got the same reward."
    )
    errors: list[str] = Field(
        default_factory=list, description="The first recorded sampling or grading errors."
    )


class RolloutJob(BaseModel):
    """A durable rollout job."""

    id: str
    model: str
    status: JobStatus
    summary: RolloutSummary
    progress: JobProgress = Field(description="Answers sampled and graded so far.")
    training_job_id: str | None = Field(description="The training job enqueued afterwards.")
    error: JobError | None
    metadata: dict[str, Any]
    attempts: int
    max_attempts: int
    cancel_requested: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


def missing_expected(body: RolloutJobCreate) -> list[dict[str, Any]]:
    """Errors for examples without the `expected` answer their grader needs."""
    if body.grader is None or body.grader.type not in NEEDS_EXPECTED:
        return []
    return [
        {
            "loc": ("examples", i, "expected"),
            "msg": f"the {body.grader.type} grader needs it",
            "type": "missing",
        }
        for i, example in enumerate(body.examples)
        if example.expected is None
    ]
