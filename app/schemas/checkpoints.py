"""Wire types of the checkpoint registry: checkpoints, aliases, retention policies."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.schemas.common import NO_NUL

MAX_STEP = 2**31 - 1
ALIAS_PATTERN = r"^[a-z][a-z0-9_-]{0,63}$"
"""User-defined alias names; `latest` and `best` are the built-in ones."""
BUILTIN_ALIASES = ("best", "latest")

ExportFormat = Literal["tar.gz", "zip", "peft", "merged"]
"""`peft` names the adapter folder PEFT loads, in a tar.gz: the same bytes as `tar.gz`."""
"""`tar.gz` and `zip`: the LoRA adapter for PEFT; `merged`: the base model with the adapter
merged in, a Hugging Face directory in a tar."""


class Checkpoint(BaseModel):
    """One of a model's checkpoints, as the backend keeps it on disk."""

    step: int = Field(description="The model step this checkpoint holds.")
    created_at: datetime = Field(description="When the checkpoint was written.")
    job_id: str | None = Field(
        description="The training job that made this step (none for step 0, or when the "
        "step was made outside Trainyard)."
    )
    metrics: dict[str, float | None] | None = Field(
        description="That job's training metrics (`result.metrics`)."
    )
    validation_metrics: dict[str, float | str | None] | None = Field(
        default=None,
        description="The latest run validation of this step: `score` (the run's validation "
        "metric), `run_id` and the validation's `job_id`; null if no run validated it.",
    )
    size_bytes: int = Field(description="Bytes on disk (every file of the checkpoint).")
    aliases: list[str] = Field(
        description="Names pointing at this step: `latest`, `best` (under the retention "
        "policy) and user-defined ones; each works as `name@alias` at the gateway."
    )


class AliasSet(BaseModel):
    """Point an alias at a step."""

    model_config = ConfigDict(
        extra="forbid", strict=True, json_schema_extra={"examples": [{"step": 3}]}
    )

    step: int = Field(ge=0, le=MAX_STEP, description="A step whose checkpoint is on disk.")


class Alias(BaseModel):
    """A name for one of a model's checkpoints."""

    alias: str
    step: int
    builtin: bool = Field(
        description="`latest` (the newest checkpoint) and `best` (the best by the retention "
        "policy's metric) are computed; the others are user-defined."
    )
    created_at: datetime | None = Field(default=None, description="User-defined ones only.")
    updated_at: datetime | None = Field(default=None, description="User-defined ones only.")


class RetentionPolicyIn(BaseModel):
    """Which checkpoints to keep. Never deleted whatever the policy: the latest step, a
    step an alias points at, the best step, a step a queued or running job was sampled
    from."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [{"keep_last": 3, "keep_best_by": "loss/train", "higher_is_better": False}]
        },
    )

    keep_last: int = Field(ge=1, le=MAX_STEP, description="Keep the newest N checkpoints.")
    keep_best_by: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=NO_NUL,
        description="Also keep the best checkpoint by this metric of its training job "
        "(`metrics`); it is the built-in alias `best`. Null: no best.",
    )
    higher_is_better: bool = Field(
        default=True, description="Whether a higher `keep_best_by` value is better."
    )


class RetentionPolicy(BaseModel):
    """A model's retention policy; a model without one keeps every checkpoint (`keep_last`
    and the times are null)."""

    model: str
    keep_last: int | None = Field(description="Null: every checkpoint is kept.")
    keep_best_by: str | None
    higher_is_better: bool
    best_step: int | None = Field(description="The step `best` names now, if any.")
    created_at: datetime | None
    updated_at: datetime | None


class RetentionRun(BaseModel):
    """What applying a retention policy did."""

    kept: list[int] = Field(description="Steps on disk after it, oldest first.")
    deleted: list[int] = Field(description="Steps it deleted, oldest first.")
