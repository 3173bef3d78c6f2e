"""The training keywords each kind of ART backend accepts, as strict pydantic models.

They mirror the keyword-only parameters of `train()` in openpipe-art 0.5.18
(`art.local.LocalBackend.train`, `art.ServerlessBackend.train`); a test reads ART's
installed source and fails when the two drift apart. 0.5.23's `train()` takes all of these
and more; the API offers only what both releases take (tests/test_backends.py names the
rest). Unknown keys are rejected rather than silently dropped, and `verbose` is left out:
it only changes ART's console output.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ImportanceSamplingLevel = Literal["token", "sequence", "average", "geometric_average"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _CommonRL(_Strict):
    learning_rate: float = Field(default=5e-6, gt=0, description="Optimizer learning rate.")
    epsilon: float | None = Field(default=None, ge=0, description="Lower clip range of the ratio.")
    epsilon_high: float | None = Field(default=None, ge=0, description="Upper clip range.")
    advantage_balance: float = Field(
        default=0.0, ge=-1, le=1, description="Balance of positive vs negative advantages."
    )
    scale_rewards: bool = Field(default=True, description="Divide advantages by the group's std.")
    importance_sampling_level: ImportanceSamplingLevel = "token"
    max_negative_advantage_importance_sampling_weight: float | None = None
    mask_prob_ratio: bool = False
    kimi_k2_tau: float | None = None
    precalculate_logprobs: bool = Field(
        default=False, description="Recompute the sampling policy's logprobs in the trainer."
    )


class ArtLocalHyperparameters(_CommonRL):
    """`LocalBackend.train` keywords (ART on a local GPU; also what `dry-run` accepts)."""

    loss_fn: Literal["cispo", "ppo"] = "cispo"
    loss_fn_config: None = Field(default=None, description="Must be null on LocalBackend.")
    normalize_advantages: bool = True
    adam_params: None = Field(default=None, description="Must be null on LocalBackend.")
    kl_penalty_coef: float = Field(default=0.0, ge=0, description="Weight of the KL penalty.")
    kl_penalty_reference_step: int | None = Field(
        default=None, ge=0, description="Checkpoint step used as the KL reference."
    )
    kl_ref_adapter_path: str | None = None
    allow_training_without_logprobs: bool = Field(
        default=False,
        description="Train assistant turns that carry no logprobs (ART re-tokenizes them).",
    )
    plot_tensors: bool = False
    truncated_importance_sampling: float | None = None
    scale_learning_rate_by_reward_std_dev: bool = False
    logprob_calculation_chunk_size: int = Field(default=1024, gt=0)
    packed_sequence_length: int | None = Field(default=None, gt=0)
    num_trajectories_learning_rate_multiplier_power: float = 0.0
    save_checkpoint: bool = True


class ArtServerlessHyperparameters(_CommonRL):
    """`ServerlessBackend.train` keywords (W&B serverless training)."""

    ppo: bool = False


class SftHyperparameters(_Strict):
    """Supervised fine-tuning keywords: ART's `TrainSFTConfig` (0.5.18 and 0.5.23), for
    every backend that trains SFT."""

    learning_rate: float = Field(default=5e-5, gt=0, le=1, description="Optimizer learning rate.")
    batch_size: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Examples per gradient step; null: the backend's choice (ART's `auto`).",
    )
    assistant_turns: Literal["all", "last"] = Field(
        default="all",
        description="Which assistant turns of each chat are trained on (`last`: openpipe-art "
        "0.5.23 and the cpu backend).",
    )
