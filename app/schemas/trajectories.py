"""Trajectory wire formats: NeMo Agent Toolkit's `TrajectoryCollection` and ART-style groups.

The NAT models mirror `nat.data_models.finetuning` field for field (nulls included, unknown
keys ignored), so a collection NAT serialised validates here unchanged. Rules that depend on
the job (whether assistant turns must carry logprobs) are not part of these models; see
`app.trajectories` for those checks and for the conversion to `art.TrajectoryGroup`.

Logprobs and messages stay opaque JSON here on purpose: a collection with hundreds of
thousands of token entries must validate in well under a second.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

MetadataValue = float | int | str | bool | None
MetricValue = float | int | bool

DPO_NOT_SUPPORTED = (
    "a DPO item in an RL job, whose episodes hold role/content items: submit DPO items as a "
    'DPO job (`"method": "dpo"`)'
)
_DPO_KEYS = frozenset({"prompt", "chosen_response", "rejected_response"})


class EpisodeItemRole(StrEnum):
    """Who produced an episode item (NAT `EpisodeItemRole`)."""

    USER = "user"
    ASSISTANT = "assistant"
    SYSTEM = "system"
    FUNCTION = "function"
    TOOL = "tool"
    ENVIRONMENT = "environment"
    OTHER = "other"


class EpisodeItem(BaseModel):
    """One turn of a NAT episode."""

    model_config = ConfigDict(strict=True)

    # Lax: in strict mode a role must be an `EpisodeItemRole` object, not its JSON string.
    role: EpisodeItemRole = Field(strict=False, description="Who produced this turn.")
    content: str = Field(description="The text of the turn.")
    logprobs: Any | None = Field(
        default=None,
        description="For assistant turns: OpenAI `ChoiceLogprobs` of the generated tokens, "
        '`{"content": [{"token": "token_id:N", "logprob": -0.1, ...}], "refusal": null}`. '
        "Required for assistant turns unless the job opted out of logprobs.",
    )
    metadata: dict[str, Any] | None = Field(
        default=None,
        description="Free-form per-turn data. Read keys: `tool_call_id` (tool turns), "
        "`tool_calls` and `finish_reason` (assistant turns), `name` (function turns).",
    )


def _reject_dpo_item(value: Any) -> Any:
    if isinstance(value, dict) and "role" not in value and _DPO_KEYS & value.keys():
        raise PydanticCustomError("dpo_not_supported", DPO_NOT_SUPPORTED)
    return value


NatEpisodeItem = Annotated[EpisodeItem, BeforeValidator(_reject_dpo_item)]


class NatTrajectory(BaseModel):
    """One NAT trajectory: an episode and its reward."""

    model_config = ConfigDict(strict=True)

    episode: list[NatEpisodeItem] = Field(description="The turns, in order.")
    reward: float = Field(allow_inf_nan=False, description="The total reward for the episode.")
    shaped_rewards: list[float] | None = Field(
        default=None, description="Per-step rewards. Accepted for compatibility and ignored."
    )
    metadata: dict[str, Any] | None = Field(
        default=None,
        description="Free-form trajectory data (NAT sets `id`, `run_id`, `generation`, "
        "`reasoning`). Scalars are kept on the ART trajectory; other values become JSON text.",
    )


NAT_COLLECTION_EXAMPLE: dict[str, Any] = {
    "run_id": "art_run_1a2b3c4d",
    "trajectories": [
        [
            {
                "episode": [
                    {
                        "role": "user",
                        "content": "2+2?",
                        "logprobs": None,
                        "metadata": None,
                    },
                    {
                        "role": "assistant",
                        "content": "4",
                        "logprobs": {
                            "content": [
                                {
                                    "token": "token_id:19",
                                    "logprob": -0.01,
                                    "bytes": [52],
                                    "top_logprobs": [],
                                }
                            ],
                            "refusal": None,
                        },
                        "metadata": None,
                    },
                ],
                "reward": 1.0,
                "shaped_rewards": None,
                "metadata": {"id": 1, "generation": 0},
            }
        ]
    ],
}
"""A NAT `TrajectoryCollection` with one group of one trajectory, as NAT serializes it."""


class TrajectoryCollection(BaseModel):
    """NAT `TrajectoryCollection`: groups of trajectories sampled for the same input."""

    model_config = ConfigDict(strict=True, json_schema_extra={"examples": [NAT_COLLECTION_EXAMPLE]})

    trajectories: list[list[NatTrajectory]] = Field(
        description="Outer list: groups (one per input example); inner list: the trajectories "
        "of that group. GRPO compares rewards within a group."
    )
    run_id: str = Field(
        description="NAT's run id. Not unique: NAT reuses it for every epoch of a run."
    )


class ArtTrajectory(BaseModel):
    """One ART trajectory: OpenAI chat messages and choices, plus its reward."""

    model_config = ConfigDict(strict=True)

    messages_and_choices: list[dict[str, Any]] = Field(
        description="The conversation in order. Each item is either an OpenAI chat message "
        "(`{role, content, tool_calls?, tool_call_id?, name?}`: context only) or an OpenAI "
        "`Choice` (`{finish_reason, index, message, logprobs}`: a trainable assistant turn)."
    )
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="OpenAI tool definitions offered to the model."
    )
    reward: float = Field(allow_inf_nan=False, description="The reward for this trajectory.")
    metrics: dict[str, MetricValue] = Field(
        default_factory=dict, description="Numeric metrics to log with the trajectory."
    )
    metadata: dict[str, MetadataValue] = Field(
        default_factory=dict, description="Scalar metadata to log with the trajectory."
    )
    logs: list[str] = Field(default_factory=list, description="Free-text log lines.")


class ArtTrajectoryGroup(BaseModel):
    """An ART trajectory group: trajectories for the same input, compared by reward."""

    model_config = ConfigDict(
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "trajectories": [
                        {
                            "messages_and_choices": [
                                {"role": "user", "content": "2+2?"},
                                {
                                    "finish_reason": "stop",
                                    "index": 0,
                                    "message": {"role": "assistant", "content": "4"},
                                    "logprobs": {
                                        "content": [
                                            {
                                                "token": "token_id:19",
                                                "logprob": -0.01,
                                                "bytes": [52],
                                                "top_logprobs": [],
                                            }
                                        ]
                                    },
                                },
                            ],
                            "reward": 1.0,
                        }
                    ],
                    "metadata": {"example_id": 1},
                }
            ]
        },
    )

    trajectories: list[ArtTrajectory] = Field(description="The trajectories of this group.")
    metadata: dict[str, MetadataValue] = Field(
        default_factory=dict, description="Scalar metadata to log with the group."
    )
    metrics: dict[str, MetricValue] = Field(
        default_factory=dict, description="Numeric metrics to log with the group."
    )
    logs: list[str] = Field(default_factory=list, description="Free-text log lines.")


class TrajectorySummary(BaseModel):
    """Counts of a submitted set of groups, and which of them GRPO can learn from."""

    num_groups: int = Field(description="Number of groups.")
    num_trajectories: int = Field(description="Number of trajectories over all groups.")
    num_trainable_groups: int = Field(
        description="Groups with at least two trajectories and two distinct rewards."
    )
    untrainable_groups: list[int] = Field(
        description="Indices of groups with fewer than two trajectories or fewer than two "
        "distinct rewards: every advantage in them is zero, so they contribute nothing."
    )
