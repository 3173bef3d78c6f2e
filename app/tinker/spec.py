"""What a Tinker training run is made of, and what its requests must hold: no torch here
(an API process without a worker imports this module, not `trainer`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.tinker.wire import Datum

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
REQUIRED = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}
CONTEXT = 2048
"""The most tokens a datum, or a prompt and its samples, may hold: what the server's
capabilities announce (`max_context_length`)."""
ADAM_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "learning_rate": (lambda v: 0 <= v <= 1, "from 0 to 1"),
    "beta1": (lambda v: 0 <= v < 1, "from 0, below 1"),
    "beta2": (lambda v: 0 <= v < 1, "from 0, below 1"),
    "eps": (lambda v: 0 < v <= 1, "above 0, at most 1"),
    "weight_decay": (lambda v: 0 <= v <= 1, "from 0 to 1"),
    "grad_clip_norm": (lambda v: v >= 0, "from 0 (0: no clipping)"),
}
"""AdamW's parameters (`AdamParams`), each a finite number in its range."""
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
LORA_ALPHA = 32
DEFAULT_ADAM = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}
"""Tinker's AdamW defaults (no weight decay unless asked)."""


class UserError(ValueError):
    """A request the model cannot run as asked (the SDK's `RequestFailedError`, user)."""


@dataclass(frozen=True)
class Lora:
    rank: int
    seed: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    @property
    def targets(self) -> list[str]:
        return (
            (ATTENTION if self.train_attn else [])
            + (MLP if self.train_mlp else [])
            + (["lm_head"] if self.train_unembed else [])
        )


def check_config(config: dict[str, float]) -> None:
    """The loss's settings (`loss_fn_config`, the clip thresholds): finite numbers."""
    for key, value in sorted(config.items()):
        if not math.isfinite(value):
            raise UserError(f"loss_fn_config.{key}: a value is NaN or infinite")


def check_adam(given: Any) -> dict[str, float]:
    """`adam_params` over the defaults, each checked (`ADAM_RANGES`)."""
    if given is not None and not isinstance(given, dict):
        raise UserError("adam_params: an object")
    params = {**DEFAULT_ADAM, **(given or {})}
    for key, value in params.items():
        if key not in ADAM_RANGES:
            raise UserError(f"adam_params.{key}: not a parameter of AdamW here")
        within, words = ADAM_RANGES[key]
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or not within(value):
            raise UserError(f"adam_params.{key}: must be a number {words}")
    return {key: float(value) for key, value in params.items()}


def check_data(vocab: int, loss_fn: str, data: Sequence[Datum]) -> None:
    """Refuse, before anything runs, what the loss cannot take: a user error naming the datum."""
    if loss_fn not in LOSSES:
        raise UserError(
            f"loss_fn {loss_fn!r} is not supported here; supported: {', '.join(LOSSES)}"
        )
    for i, datum in enumerate(data):
        where = f"data[{i}]"
        if not datum.tokens:
            raise UserError(f"{where}.model_input is empty")
        if len(datum.tokens) > CONTEXT:
            raise UserError(
                f"{where}.model_input has {len(datum.tokens)} tokens; the context holds at "
                f"most {CONTEXT}"
            )
        bad = [t for t in datum.tokens if not 0 <= t < vocab]
        if bad:
            raise UserError(
                f"{where}.model_input: token {bad[0]} is outside the vocabulary (0..{vocab - 1})"
            )
        for key in REQUIRED[loss_fn]:
            tensor = datum.inputs.get(key)
            if tensor is None:
                raise UserError(f"{where}.loss_fn_inputs.{key} is required by {loss_fn}")
            if tensor.array.size != len(datum.tokens):
                raise UserError(
                    f"{where}.loss_fn_inputs.{key} has {tensor.array.size} values for "
                    f"{len(datum.tokens)} input tokens"
                )
        for key, tensor in sorted(datum.inputs.items()):
            if tensor.array.dtype.kind == "f" and not np.isfinite(tensor.array).all():
                # A NaN or an infinity would train into the adapter and break every
                # sample after it: refused here, before anything runs.
                raise UserError(f"{where}.loss_fn_inputs.{key}: a value is NaN or infinite")
        targets = datum.inputs["target_tokens"].array
        if ((targets < 0) | (targets >= vocab)).any():
            raise UserError(
                f"{where}.loss_fn_inputs.target_tokens: a token is outside the vocabulary"
            )
