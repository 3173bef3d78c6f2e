"""What a job or a run used, and its estimated cost (issue 28 §4)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class JobUsage(BaseModel):
    """What a job used (a run: its children's sums). A count is null when it was not
    counted: a job of another kind, one that has not ended, or one from before it was."""

    prompt_tokens: int | None = Field(
        description="Prompt tokens sampled (rollout and evaluation jobs, run validations), "
        "as the endpoint's `usage` said."
    )
    completion_tokens: int | None = Field(description="Completion tokens sampled.")
    trained_tokens: int | None = Field(
        description="Tokens the trainer was handed (training jobs): every token of a sampled "
        "answer whose logprobs name its tokens, and the other text at 4 bytes a token."
    )
    trainer_seconds: float | None = Field(
        description="Seconds a training job ran: every attempt, each from its claim to its "
        "end (or now; an attempt sent back to the queue, to that write or its lease's end)."
    )
    rollout_seconds: float | None = Field(
        description="Seconds a rollout or evaluation job ran (sampling and grading), every "
        "attempt counted as for `trainer_seconds`."
    )


class JobCost(BaseModel):
    """`usage` priced by the price table (`TRAINYARD_PRICES`): an estimate."""

    currency: str = Field(description="`TRAINYARD_PRICE_CURRENCY`.")
    amount: float = Field(description="The sum of the parts below.")
    sampled: float = Field(description="Tokens sampled, per million (`sampled_mtok`).")
    trained: float = Field(description="Tokens trained, per million (`trained_mtok`).")
    trainer: float = Field(description="Trainer time, per hour (`trainer_hour`).")
    rollout: float = Field(description="Rollout time, per hour (`rollout_hour`).")
