"""Tinker's training operations on the cpu backend's torch model (`cpu_policy.Policy`).

`forward_backward` adds each datum's loss gradient to the adapter's `.grad` (summed, as
Tinker does: no mean over datums); `optim_step` runs `torch.optim.AdamW` with the request's
`AdamParams` (Tinker's defaults: lr 1e-4, betas 0.9/0.95, eps 1e-12, no weight decay, no
clipping) and clears the gradients. Everything here is synchronous torch code, run in a
thread under the policy's lock.

Losses (per target token t, `lp` the model's logprob of the target, summed over tokens):
- `cross_entropy`: -weights_t * lp_t
- `importance_sampling`: -exp(lp_t - logprobs_t) * advantages_t
- `ppo`: -min(r_t * A_t, clip(r_t, clip_low_threshold, clip_high_threshold) * A_t),
  r_t = exp(lp_t - logprobs_t); thresholds from `loss_fn_config` (default 0.8 and 1.2).
- `cispo`: -stop_gradient(clip(r_t, low, high)) * A_t * lp_t (same thresholds).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.backends.cpu_policy import Policy
from app.tinker.sampling import Asked
from app.tinker.spec import LORA_ALPHA, Lora
from app.tinker.wire import MASK_LOGPROB, Datum, OutTensor, SampleAnswer, TopK
from app.tinker.wire import Sequence as Sampled


def load_policy(base_dir: str, lora: Lora, device: str, threads: int | None = None) -> Policy:
    return Policy(
        base_dir,
        rank=lora.rank,
        alpha=LORA_ALPHA,
        seed=lora.seed,
        device=device,
        target_modules=lora.targets,
        threads=threads,
    )


def _loss(
    loss_fn: str, lp: torch.Tensor, datum: Datum, config: dict[str, float], device: torch.device
) -> torch.Tensor:
    def given(key: str) -> torch.Tensor:
        return torch.from_numpy(np.array(datum.inputs[key].array, dtype=np.float32)).to(device)

    if loss_fn == "cross_entropy":
        return -given("weights") * lp
    ratio = torch.exp(lp - given("logprobs"))
    advantages = given("advantages")
    if loss_fn == "importance_sampling":
        return -ratio * advantages
    clipped = torch.clamp(
        ratio, config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    )
    if loss_fn == "cispo":  # the clipped ratio weighs the logprob's gradient; none through it
        return -clipped.detach() * advantages * lp
    return -torch.min(ratio * advantages, clipped * advantages)


def forward_backward(
    policy: Policy,
    data: Sequence[Datum],
    loss_fn: str,
    config: dict[str, float],
    *,
    backward: bool,
) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
    """Each datum's target logprobs and elementwise loss; with `backward`, its gradient is
    added to the adapter's. Call with `policy.lock` held."""
    training_weights(policy)
    outputs: list[dict[str, np.ndarray]] = []
    total = 0.0
    model = policy.model
    model.train(backward)
    try:
        for datum in data:
            ids = torch.tensor([datum.tokens], device=policy.device)
            targets = torch.from_numpy(
                np.array(datum.inputs["target_tokens"].array, dtype=np.int64)
            ).to(policy.device)
            with torch.set_grad_enabled(backward):
                logits = model(input_ids=ids).logits[0].float()
                lp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
                loss = _loss(loss_fn, lp, datum, config, policy.device)
                if backward:
                    loss.sum().backward()
            total += float(loss.sum().detach())
            outputs.append(
                {
                    "logprobs": lp.detach().cpu().numpy().astype(np.float32),
                    "elementwise_loss": loss.detach().cpu().numpy().astype(np.float32),
                }
            )
    finally:
        model.eval()
    return outputs, {"loss:sum": total}


def optim_step(policy: Policy, adam: dict[str, Any]) -> dict[str, float]:
    """One AdamW step on the accumulated gradients, then clear them."""
    training_weights(policy)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    lr, betas = float(adam["learning_rate"]), (float(adam["beta1"]), float(adam["beta2"]))
    if policy.optimizer is None:
        policy.optimizer = torch.optim.AdamW(
            params,
            lr=lr,
            betas=betas,
            eps=float(adam["eps"]),
            weight_decay=float(adam["weight_decay"]),
        )
    for group in policy.optimizer.param_groups:
        group.update(
            lr=lr, betas=betas, eps=float(adam["eps"]), weight_decay=float(adam["weight_decay"])
        )
    metrics: dict[str, float] = {"learning_rate": lr}
    if float(adam["grad_clip_norm"]) > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, float(adam["grad_clip_norm"]))
        metrics["grad_norm"] = float(norm)
    policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    return metrics


def adapter_state(policy: Policy) -> dict[str, torch.Tensor]:
    """A copy of the adapter's weights: what a sampler made now keeps sampling from."""
    training_weights(policy)
    return _state(policy)


def _state(policy: Policy) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(policy.model, save_embedding_layers=False)
    return {k: v.detach().clone() for k, v in state.items()}


@dataclass
class _Swapped:
    """A sampler's weights left in the adapter after it sampled (`loaded`), and the
    adapter's own weights (`live`) to put back before anything else uses the adapter (None:
    `loaded` equals them, nothing to put back)."""

    live: dict[str, torch.Tensor] | None
    loaded: dict[str, torch.Tensor]


# Policies whose adapter holds a sampler's weights, not their own (see `weights_of`).
_SWAPPED: weakref.WeakKeyDictionary[Policy, _Swapped] = weakref.WeakKeyDictionary()


def training_weights(policy: Policy) -> None:
    """Put the adapter's own weights back if a sampler's are in it: called first by every
    operation that trains, saves, loads or reads the adapter. Call with `policy.lock` held."""
    swapped = _SWAPPED.pop(policy, None)
    if swapped is not None and swapped.live is not None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(policy.model, swapped.live)


@contextmanager
def weights_of(policy: Policy, weights: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """The model with `weights` as its adapter (None: the base model, adapter off). Call
    with `policy.lock` held. The weights stay in the adapter afterwards, so that a sampler
    that samples again (an RL step's many `sample` calls) loads nothing; the adapter's own
    weights are kept aside and put back by `training_weights` before the run's next
    operation. A sampler whose weights are the adapter's own loads nothing either."""
    from peft import set_peft_model_state_dict

    if weights is None:
        with policy.model.disable_adapter():
            yield
        return
    swapped = _SWAPPED.get(policy)
    if swapped is not None and swapped.loaded is weights:
        yield
        return
    if swapped is not None and swapped.live is None:  # the adapter's own weights are in it
        swapped.live = _state(policy)
    if swapped is None:
        live = _state(policy)
        if all(
            k in live and live[k].device == v.device and torch.equal(live[k], v)
            for k, v in weights.items()
        ):
            _SWAPPED[policy] = _Swapped(None, weights)
            yield
            return
        swapped = _SWAPPED[policy] = _Swapped(live, weights)
    set_peft_model_state_dict(policy.model, weights)
    swapped.loaded = weights
    yield


def sample(
    policy: Policy, weights: dict[str, torch.Tensor] | None, asked: Asked, stop_ids: set[int]
) -> list[Sampled]:
    """`asked.num_samples` sequences from `weights` (see `weights_of`), with the k likeliest
    tokens at each sampled position when `topk_sample_logprobs` asks (their logprobs the
    model's own, before temperature, as the sampled tokens' are). Call with `policy.lock`
    held."""
    with weights_of(policy, weights):
        samples = policy.sample(
            asked.prompt,
            n=asked.num_samples,
            max_tokens=asked.max_tokens,
            temperature=asked.temperature,
            top_p=asked.top_p,
            top_logprobs=min(asked.topk_sample, vocab_of(policy)),
            stop_ids=stop_ids,
            seed=asked.seed,
            top_k=asked.top_k,
            stop_at_eos=asked.stop_at_eos,
        )
    return [
        Sampled(
            s.token_ids,
            s.logprobs,
            "stop" if s.finish_reason == "stop" else "length",
            _topk_rows(s.top_logprobs) if asked.topk_sample else None,
        )
        for s in samples
    ]


def vocab_of(policy: Policy) -> int:
    return int(policy.model.get_input_embeddings().weight.shape[0])


def _topk_rows(rows: list[list[tuple[int, float]]]) -> TopK:
    return TopK(
        np.array([[t for t, _ in row] for row in rows], dtype=np.int32),
        np.array([[lp for _, lp in row] for row in rows], dtype=np.float32),
    )


@torch.no_grad()
def score_prompt(
    policy: Policy, weights: dict[str, torch.Tensor] | None, asked: Asked
) -> SampleAnswer:
    """What `asked` wants of its prompt, from one forward pass over it (the sequences are
    left to `sample`). Row i of the table is the distribution of prompt token i + 1 given
    those before it:
    - `prompt_logprobs`: each prompt token's logprob; NaN (the SDK's None) for the first,
      and for those before the last `last_n`;
    - `topk_prompt_logprobs`: the k likeliest tokens at each position, likeliest first, and
      their logprobs (the same positions masked);
    - `target_prompt_logprobs`: each asked cell's logprob (0.0 for a -1 cell);
    - `prompt_alt_tokens_k`: k draws at each position after the first, with replacement, at
      the request's temperature (greedy at 0; seeded by its seed), with the model's own
      logprobs of them (before temperature, as the sampled tokens' are).
    Call with `policy.lock` held."""
    prompt = asked.prompt
    with weights_of(policy, weights):
        ids = torch.tensor([prompt], device=policy.device)
        logits = policy.model(input_ids=ids).logits[0, :-1].float()
    table = torch.log_softmax(logits, dim=-1)
    picked = table.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    scores = [math.nan, *picked.cpu().tolist()]
    unscored = 1 if asked.last_n is None else len(prompt) - asked.last_n
    scores[:unscored] = [math.nan] * unscored
    answer = SampleAnswer([], scores if asked.prompt_logprobs else None)
    if asked.topk_prompt:
        answer.topk_prompt_logprobs = _prompt_topk(table, asked.topk_prompt, unscored)
    if asked.targets is not None:
        cells = asked.targets
        rows = torch.from_numpy(cells.rows).to(policy.device)
        wanted = torch.from_numpy(cells.ids).to(policy.device)
        found = table[rows, wanted.clamp(min=0)].masked_fill(wanted < 0, 0.0)
        answer.target_prompt_logprobs = cells.answer(found.cpu().numpy())
    if asked.alt_k:
        answer.prompt_alt_tokens = _alt_tokens(policy, logits, table, asked)
    return answer


def _prompt_topk(table: torch.Tensor, top_k: int, unscored: int) -> TopK:
    k = min(top_k, table.shape[-1])
    best = torch.topk(table, k, dim=-1)  # sorted: likeliest first
    length = table.shape[0] + 1
    token_ids = np.zeros((length, k), dtype=np.int32)
    logprobs = np.full((length, k), MASK_LOGPROB, dtype=np.float32)
    token_ids[1:] = best.indices.cpu().numpy()
    logprobs[1:] = best.values.cpu().numpy()
    token_ids[:unscored], logprobs[:unscored] = 0, MASK_LOGPROB
    return TopK(token_ids, logprobs)


def _alt_tokens(
    policy: Policy, logits: torch.Tensor, table: torch.Tensor, asked: Asked
) -> tuple[OutTensor, OutTensor]:
    rows, k = table.shape[0], asked.alt_k
    if rows == 0:
        drawn = torch.zeros((0, k), dtype=torch.int64, device=logits.device)
    elif asked.temperature <= 0:
        drawn = logits.argmax(dim=-1, keepdim=True).expand(rows, k)
    else:
        generator = None
        if asked.seed is not None:
            generator = torch.Generator(device=policy.device).manual_seed(asked.seed)
        probs = torch.softmax(logits / asked.temperature, dim=-1)
        drawn = torch.multinomial(probs, k, replacement=True, generator=generator)
    chosen = table.gather(-1, drawn)
    return (
        OutTensor(drawn.cpu().numpy().astype(np.int64).reshape(-1), [rows, k]),
        OutTensor(chosen.cpu().numpy().astype(np.float32).reshape(-1), [rows, k]),
    )


def read_adapter(directory: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The adapter weights a checkpoint directory holds, as `adapter_state` gives them."""
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"), device=str(device))


def load_state(policy: Policy, directory: Path, *, with_optimizer: bool) -> None:
    """The adapter saved in `directory` (and, `with_optimizer`, AdamW's moments), with no
    gradient pending. Without the optimizer's state the next step starts a fresh AdamW."""
    from peft import set_peft_model_state_dict

    training_weights(policy)
    set_peft_model_state_dict(policy.model, read_adapter(directory, policy.device))
    policy.model.zero_grad(set_to_none=True)
    policy.optimizer = None
    saved = directory / "optimizer.pt"
    if with_optimizer and saved.exists():
        params = [p for p in policy.model.parameters() if p.requires_grad]
        policy.optimizer = torch.optim.AdamW(params)
        policy.optimizer.load_state_dict(
            torch.load(saved, weights_only=True, map_location=policy.device)
        )
