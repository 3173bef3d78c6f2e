"""Wire types of the training methods beside RL: supervised fine-tuning (`method: "sft"`)
and preference optimisation (`method: "dpo"`). Each is a training job like any other (one
kind, one lifecycle, one model step per job); the body's `method` says which shape it has.

- SFT: OpenAI-shaped chat examples, inline or from a dataset split; only assistant turns
  are trained on, and no reward or logprob is needed.
- DPO: preference pairs, plain (`{prompt, chosen, rejected}`) or as NeMo Agent Toolkit's
  DPO trajectory builder emits them (a `TrajectoryCollection` whose episodes hold
  `DPOItem`s: `{prompt, chosen_response, rejected_response}`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator, with_config
from typing_extensions import TypedDict

from app.schemas.common import NO_NUL, JsonObject, plain_json

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
"""The roles of an OpenAI chat message."""


@with_config(ConfigDict(extra="allow"))
class PromptMessage(TypedDict):
    """An OpenAI chat message of a prompt: its `role` checked (a bad one is refused at
    `…messages[j].role`), its `content` text, a list of content parts or null (anything else
    at `…messages[j].content`), the rest (`tool_calls`, `name`) kept as sent."""

    role: Role
    content: NotRequired[str | list[dict[str, Any]] | None]


@with_config(ConfigDict(extra="allow"))
class ChatMessage(TypedDict):
    """An OpenAI chat message to train on: its `role` checked, its `content` text (or null
    with `tool_calls`); other keys kept as sent."""

    role: Role
    content: NotRequired[str | None]


Method = Literal["rl", "sft", "dpo"]
METHODS: tuple[str, ...] = ("rl", "sft", "dpo")
"""What a training job does: `rl` (trajectory groups and rewards, the default), `sft`
(supervised: chat examples), `dpo` (preference pairs)."""

MAX_EXAMPLES = 10_000
"""Examples (or pairs) one SFT (or DPO) job trains on: one model step."""

Messages = Annotated[list[ChatMessage], AfterValidator(plain_json)]
"""Chat messages; a bad role or content is refused at its own path (`messages[j].role`)."""


class SftExample(BaseModel):
    """One chat to learn from: every assistant turn is a target, the rest is context."""

    model_config = ConfigDict(extra="forbid", strict=True)

    messages: Messages = Field(
        min_length=1,
        description="OpenAI-shaped chat messages, `{role, content}`; the assistant turns are "
        "what the model learns to say (the loss covers their tokens only).",
    )
    tools: Annotated[list[dict[str, Any]] | None, AfterValidator(plain_json)] = Field(
        default=None, description="OpenAI tool definitions offered in the chat, if any."
    )

    @model_validator(mode="after")
    def _a_target(self) -> SftExample:
        if not any(m.get("role") == "assistant" and m.get("content") for m in self.messages):
            raise ValueError("no assistant turn with content: nothing to learn from this example")
        return self


class DatasetSource(BaseModel):
    """Examples read from a stored dataset (`POST /v1/datasets`) at submission: the job
    keeps its own copy, so the dataset may change or go afterwards."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(pattern=NO_NUL, description="The dataset's id (`ds_…`).")
    split: str = Field(default="train", pattern=NO_NUL, description="The split to train on.")


class SftJobCreate(BaseModel):
    """Supervised fine-tuning: one model step on chat examples, inline or from a dataset."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "model": "agent-7b",
                    "method": "sft",
                    "examples": [
                        {
                            "messages": [
                                {"role": "user", "content": "2+2?"},
                                {"role": "assistant", "content": "4"},
                            ]
                        }
                    ],
                    "hyperparameters": {"learning_rate": 5e-5},
                }
            ]
        },
    )

    model: str = Field(pattern=NO_NUL, description="Name of a registered model.")
    method: Literal["sft"] = Field(description="`sft`: supervised fine-tuning.")
    examples: list[SftExample] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_EXAMPLES,
        description=f"Inline chat examples (at most {MAX_EXAMPLES}).",
    )
    dataset: DatasetSource | None = Field(
        default=None,
        description="A dataset split whose lines hold `messages` with assistant turns.",
    )
    hyperparameters: JsonObject = Field(
        default_factory=dict,
        description="The backend's SFT keywords (`GET /v1/backends`: `methods.sft`).",
    )
    metadata: JsonObject = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_source(self) -> SftJobCreate:
        if (self.examples is None) == (self.dataset is None):
            raise ValueError("give exactly one of `examples` or `dataset`")
        return self


class PreferencePair(BaseModel):
    """A prompt and two answers to it, the first preferred."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Messages = Field(min_length=1, description="OpenAI-shaped chat messages.")
    chosen: str = Field(min_length=1, pattern=NO_NUL, description="The preferred answer.")
    rejected: str = Field(min_length=1, pattern=NO_NUL, description="The other answer.")
    tools: Annotated[list[dict[str, Any]] | None, AfterValidator(plain_json)] = None

    @model_validator(mode="after")
    def _check(self) -> PreferencePair:
        if self.chosen == self.rejected:
            raise ValueError("`chosen` and `rejected` are the same answer: nothing to prefer")
        return self


class NatMessage(BaseModel):
    """NAT `OpenAIMessage`."""

    model_config = ConfigDict(strict=True)

    role: str
    content: str


class NatDpoItem(BaseModel):
    """NAT `DPOItem`, as `nat.data_models.finetuning` has it (unknown keys ignored)."""

    model_config = ConfigDict(strict=True)

    prompt: list[NatMessage] | str = Field(description="The prompt: messages or one text.")
    chosen_response: str = Field(min_length=1)
    rejected_response: str = Field(min_length=1)


class NatDpoTrajectory(BaseModel):
    """A NAT trajectory whose episode is DPO items (NAT's DPO trajectory builder)."""

    model_config = ConfigDict(strict=True)

    episode: list[NatDpoItem] = Field(description="Its preference pairs.")
    reward: float = Field(allow_inf_nan=False, description="Kept for compatibility; unused.")
    shaped_rewards: list[float] | None = None
    metadata: dict[str, Any] | None = None


class NatDpoCollection(BaseModel):
    """NAT `TrajectoryCollection` of DPO trajectories."""

    model_config = ConfigDict(strict=True)

    trajectories: list[list[NatDpoTrajectory]]
    run_id: str


class DpoJobCreate(BaseModel):
    """Preference optimisation (DPO): one model step on preference pairs."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "model": "agent-7b",
                    "method": "dpo",
                    "pairs": [
                        {
                            "prompt": [{"role": "user", "content": "2+2?"}],
                            "chosen": "4",
                            "rejected": "5",
                        }
                    ],
                    "hyperparameters": {"beta": 0.1},
                }
            ]
        },
    )

    model: str = Field(pattern=NO_NUL, description="Name of a registered model.")
    method: Literal["dpo"] = Field(description="`dpo`: direct preference optimisation.")
    pairs: list[PreferencePair] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_EXAMPLES,
        description=f"Preference pairs (at most {MAX_EXAMPLES}).",
    )
    collection: NatDpoCollection | None = Field(
        default=None,
        description="A NeMo Agent Toolkit `TrajectoryCollection` of DPO items, as NAT's DPO "
        "trajectory builder emits it.",
    )
    hyperparameters: JsonObject = Field(
        default_factory=dict,
        description="The backend's DPO keywords (`GET /v1/backends`: `methods.dpo`).",
    )
    metadata: JsonObject = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_source(self) -> DpoJobCreate:
        if (self.pairs is None) == (self.collection is None):
            raise ValueError("give exactly one of `pairs` or `collection`")
        return self


class SftSummary(BaseModel):
    """What an SFT job was given."""

    method: Literal["sft"] = "sft"
    num_examples: int = Field(description="Chat examples.")
    num_target_turns: int = Field(description="Assistant turns trained on, over all examples.")
    dataset: str | None = Field(default=None, description="The dataset they came from, if any.")


class DpoSummary(BaseModel):
    """What a DPO job was given."""

    method: Literal["dpo"] = "dpo"
    num_pairs: int = Field(description="Preference pairs.")
