"""Wire types of rollout jobs: Trainyard samples the model, grades, groups, and can train."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from app.egress import EgressPolicy
from app.jobs.lifecycle import JobStatus
from app.schemas.common import NO_NUL, JsonObject, plain_json
from app.schemas.graders import (
    NEEDS_EXPECTED,
    Grader,
    OutboundHeaders,
    OutboundUrl,
    WebhookGrader,
)
from app.schemas.jobs import WAITING_FOR, JobError, JobProgress
from app.schemas.pieces import EACH, Piece
from app.schemas.supervised import PromptMessage
from app.schemas.usage import JobCost, JobUsage

MAX_ID_CHARS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
PROMPT_ROLES = ("system", "developer", "user")
"""Roles one of which an example's messages must have: a prompt a rollout can answer."""


class Example(BaseModel):
    """One prompt to sample answers for, wherever examples come (a rollout's, an
    evaluation's, a run's, a dataset's line): its `id` is checked, and its messages hold a
    user, system or developer turn."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | int = Field(
        description=f"Your id for the example, unique in the job: 1-{MAX_ID_CHARS} "
        "characters without control characters, or a signed 64-bit integer."
    )
    messages: Annotated[list[PromptMessage], AfterValidator(plain_json)] = Field(
        min_length=1, description="OpenAI-shaped chat messages: the prompt."
    )
    expected: Annotated[Any, AfterValidator(plain_json)] = Field(
        default=None, description="The reference answer graders compare to."
    )
    metadata: JsonObject = Field(default_factory=dict)

    @field_validator("id")
    @classmethod
    def _an_id(cls, value: str | int) -> str | int:
        if isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise ValueError("an integer id is a signed 64-bit integer")
        elif not 1 <= len(value) <= MAX_ID_CHARS:
            raise ValueError(f"an id has 1-{MAX_ID_CHARS} characters, not {len(value)}")
        elif _CONTROL.search(value):
            raise ValueError("an id has no control characters (U+0000-U+001F, U+007F)")
        return value

    @field_validator("messages")
    @classmethod
    def _a_prompt(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not any(m.get("role") in PROMPT_ROLES for m in messages):
            raise ValueError("no user, system or developer turn: a rollout has no prompt to answer")
        return messages


def duplicate_ids(examples: Sequence[Example], *, what: str) -> list[dict[str, Any]]:
    """An error at each example whose id (as text: 1 and "1" are one) an earlier one has."""
    return _repeated([str(example.id) for example in examples], what)


def raw_duplicate_ids(data: Any, *, what: str) -> list[dict[str, Any]]:
    """`duplicate_ids` of a parsed body that has not passed validation (`Reading.also`):
    among its examples whose id is a string or an integer."""
    examples = data.get("examples") if isinstance(data, dict) else None
    if not isinstance(examples, list):
        return []
    ids = [
        str(e["id"]) if isinstance(e, dict) and type(e.get("id")) in (str, int) else None
        for e in examples
    ]
    return _repeated(ids, what)


def _repeated(ids: Sequence[str | None], what: str) -> list[dict[str, Any]]:
    errors: list[dict[str, Any]] = []
    first_at: dict[str, int] = {}
    for i, ident in enumerate(ids):
        if ident is None:
            continue
        first = first_at.setdefault(ident, i)
        if first != i:
            msg = f"the id of examples[{first}] again; ids are unique in {what}"
            errors.append({"loc": ("examples", i, "id"), "msg": msg, "type": "duplicate_id"})
    return errors


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

    url: OutboundUrl = Field(
        description="Trainyard POSTs {example, generation, model: {base_url, api_key, name}} "
        "and expects {trajectory (NAT or ART format), reward?}. Subject to the egress policy "
        "(`TRAINYARD_EGRESS_ALLOW`, `TRAINYARD_EGRESS_DENY`); redirects are not followed."
    )
    timeout_s: float = Field(
        default=300,
        gt=0,
        le=3600,
        description="Seconds one call may take in all, from connecting to the answer's last byte.",
    )
    headers: OutboundHeaders = Field(
        default_factory=dict,
        description="Extra request headers, e.g. `Authorization`. Write-only: sent with "
        "each call, never shown by any route.",
    )


class TrainAfter(BaseModel):
    """Enqueue a training job with the built groups when the rollout succeeds."""

    model_config = ConfigDict(extra="forbid", strict=True)

    hyperparameters: JsonObject = Field(default_factory=dict)
    max_steps_off_policy: int | None = Field(
        default=None,
        ge=0,
        le=2**31 - 1,
        description="The training job's `max_steps_off_policy`; its `policy_step` is the "
        "step this rollout sampled.",
    )


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
        return self


ROLLOUT_PIECES = (Piece(("examples", EACH), Example),)
"""How a large `RolloutJobCreate` is validated: an example at a time."""


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
        default_factory=list,
        description="The first recorded errors of answers left out (sampling, grading, an "
        "agent's call, an answer training would refuse). They name a status and a length, "
        "never what a remote service answered.",
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
    waiting_for: str | None = Field(default=None, description=WAITING_FOR)
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    usage: JobUsage = Field(description="What the job used (`GET /v1/usage` sums it).")
    cost: JobCost = Field(description="`usage` priced by `TRAINYARD_PRICES`: an estimate.")


def refused_destinations(
    agent: Agent | None, grader: Grader | None, policy: EgressPolicy, *, at: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Errors for an agent or webhook URL the egress policy refuses before resolving it
    (an address literal, a denied name); every call is checked again when it is made.
    `at`: where the request holds `agent` and `grader`."""
    targets: list[tuple[tuple[str, ...], str]] = []
    if agent is not None:
        targets.append(((*at, "agent", "url"), str(agent.url)))
    if isinstance(grader, WebhookGrader):
        targets.append(((*at, "grader", "webhook", "url"), str(grader.url)))
    errors = []
    for loc, url in targets:
        refused = policy.refuse_url(url)
        if refused is not None:
            errors.append(
                {"loc": loc, "msg": f"refused by the egress policy: {refused}", "type": "egress"}
            )
    return errors


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
