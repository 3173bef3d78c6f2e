"""Wire types of trainable models."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from app.schemas.common import NO_NUL, JsonObject
from app.settings import DEFAULT_POOL, LABEL_KEY, LABEL_VALUE, MAX_LABELS, POOL_PATTERN

LabelKey = Annotated[str, StringConstraints(pattern=LABEL_KEY.pattern)]
LabelValue = Annotated[str, StringConstraints(pattern=LABEL_VALUE.pattern)]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class ModelCreate(BaseModel):
    """A trainable model to register on a trainer backend."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "name": "agent-7b",
                    "project": "support-bot",
                    "base_model": "Qwen/Qwen2.5-7B-Instruct",
                    "backend": "art-local",
                    "config": {"init_args": {"max_seq_length": 8192}},
                }
            ]
        },
    )

    name: str = Field(
        pattern=NAME_PATTERN, description="Unique model name; ART serves it as `name@step`."
    )
    project: str = Field(default="default", pattern=NAME_PATTERN, description="ART project name.")
    base_model: str = Field(
        min_length=1, max_length=512, pattern=NO_NUL, description="Base model id or local path."
    )
    backend: str = Field(description="Trainer backend name (see `GET /v1/backends`).")
    config: JsonObject = Field(
        default_factory=dict,
        description="Backend configuration (see `GET /v1/backends` for its schema).",
    )
    pool: str | None = Field(
        default=None,
        pattern=POOL_PATTERN,
        description="Worker pool that runs its jobs (`trainyard worker --pool`); omitted: "
        "`default`. Only workers of this pool that run its backend claim its jobs.",
    )
    labels: dict[LabelKey, LabelValue] | None = Field(
        default=None,
        max_length=MAX_LABELS,
        description="Labels a worker must have to run its jobs (`trainyard worker --labels`), "
        'e.g. `{"gpu": "h200"}`; omitted: none.',
    )


class Model(BaseModel):
    """A registered trainable model."""

    name: str
    project: str
    base_model: str
    backend: str
    config: dict[str, Any]
    current_step: int = Field(description="Latest trained step the backend reported.")
    pool: str = Field(default=DEFAULT_POOL, description="Worker pool that runs its jobs.")
    labels: dict[str, str] = Field(
        default_factory=dict, description="Labels a worker must have to run its jobs."
    )
    inference_base_url: str | None = Field(
        description="OpenAI-compatible endpoint serving the model while a worker serves it "
        "(null otherwise): the gateway, behind the API's keys, as `openai_base_url`. Where "
        "the backend itself serves the model is not handed out."
    )
    inference_model_name: str | None = Field(
        description="Model name to request there while it is served: `name@step`, the current step."
    )
    openai_base_url: str | None = Field(
        default=None,
        description="Trainyard's OpenAI-compatible gateway, behind the API's keys: a stable "
        "base URL for every served model and step (`/openai/v1` on the API).",
    )
    openai_model_names: list[str] = Field(
        default_factory=list,
        description="Names the gateway accepts for this model now: `name` (the latest step), "
        "`name@latest`, `name@N` (N: any step whose checkpoint is kept).",
    )
    created_at: datetime
    updated_at: datetime


class TinkerStep(BaseModel):
    """A point of a Tinker training run's curves: one `optim_step` and the
    `forward_backward` calls whose gradients it applied (those done since the step before)."""

    step: int = Field(description="The run's optimizer step, from 1 (its done `optim_step`s).")
    seq: int = Field(description="The `optim_step`'s place in the run's journal.")
    loss: float | None = Field(
        description="The sum of `loss:sum` over the step's `forward_backward` results (summed "
        "over tokens and datums, as Tinker reports it); null when none preceded the step."
    )
    forward_backward: int = Field(description="How many `forward_backward` calls it applied.")
    learning_rate: float | None = Field(description="The step's AdamW learning rate.")
    metrics: dict[str, float] = Field(
        description="What `optim_step` returned (`learning_rate`, `grad_norm` when clipped)."
    )
    created_at: datetime = Field(description="When the step was done.")
