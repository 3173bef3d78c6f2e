"""What a Tinker training run is made of, and what its requests must hold: no torch here
(an API process without a worker imports this module, not `trainer`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.tinker.wire import Datum

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
REQUIRED = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
LORA_ALPHA = 32


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
        targets = datum.inputs["target_tokens"].array
        if ((targets < 0) | (targets >= vocab)).any():
            raise UserError(
                f"{where}.loss_fn_inputs.target_tokens: a token is outside the vocabulary"
            )
