"""The `cpu` backend's model: a causal LM from a local directory with a LoRA adapter, how it
samples (with logprobs, tokens as `token_id:N`) and how it takes a policy-gradient step.

Everything here is synchronous torch code; `app.backends.cpu` runs it in threads, and one
lock per model keeps sampling and training from interleaving (ART's shared-GPU mode has
the same rule: no inference while a step trains). Different models run in threads at
once, so what the whole process shares is settled at import (huggingface_hub's package
checks) or taken under a lock (torch's random generator: `app.backends.seeding`).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from openai.types.chat.chat_completion import Choice
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from app.backends.admission import Abandoned
from app.backends.seeding import seeded

# A service's log is no place for loading progress bars.
transformers_logging.disable_progress_bar()


def _settle_huggingface_checks() -> None:
    """Answer huggingface_hub's "is X installed?" checks now, while this module's import
    lock keeps us alone. It answers each on first use and caches the answer in two steps:
    "N/A", then the version. A thread asking between the two is told X is missing: two
    adapters saved at once (two models training in one worker) failed with "ModelCard.
    from_template requires Jinja2", though Jinja2 was installed."""
    import huggingface_hub.utils as hub

    for name in dir(hub):
        if (
            name.startswith("is_")
            and name.endswith("_available")
            and name != "is_package_available"
        ):
            getattr(hub, name)()


_settle_huggingface_checks()

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# Message keys a chat template needs to render tool use: an assistant turn's calls, and a
# tool result's call id and name.
_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str


@dataclass
class Turn:
    """One trainable assistant turn: its prompt, the sampled tokens and their advantage."""

    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float] | None
    advantage: float


def _no_model_card(output_dir: str) -> None:
    return None


class Policy:
    """A base model plus a LoRA adapter, its optimizer, and the lock that guards them."""

    def __init__(
        self,
        base_model: str,
        *,
        rank: int,
        alpha: int,
        seed: int,
        device: str = "cpu",
        target_modules: Sequence[str] = TARGET_MODULES,
        threads: int | None = None,
    ) -> None:
        use_threads(threads)
        self.device = torch.device(resolve_device(device))
        self.tokenizer = AutoTokenizer.from_pretrained(base_model, local_files_only=True)
        base = AutoModelForCausalLM.from_pretrained(base_model, local_files_only=True)
        names = [n for n, _ in base.named_modules()]
        targets = [m for m in target_modules if any(n.endswith(m) for n in names)]
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
        with seeded(seed):  # the adapter's first weights (drawn on the CPU, on any device)
            self.model: PeftModel = get_peft_model(base, config)
        self.model.to(self.device)
        # peft writes a model card (README.md, rendered from a Jinja template) wherever it
        # saves: 8 of a save's 10 ms here, for a file nothing reads (the loader and the
        # export take the adapter's two files).
        self.model.create_or_update_model_card = _no_model_card  # type: ignore[method-assign]
        self.model.eval()
        self.optimizer: torch.optim.Optimizer | None = None
        self.lock = threading.Lock()
        self.loaded_step = 0  # the checkpoint step the adapter in memory comes from
        self.eos_id = self.tokenizer.eos_token_id

    # -- adapters on disk ---------------------------------------------------------------

    def save(self, path: Path, step: int) -> None:
        # The adapter alone: with `lm_head` among the targets (a Tinker run's train_unembed)
        # peft would also save the base model's whole output layer in every checkpoint.
        self.model.save_pretrained(str(path), save_embedding_layers=False)
        self.loaded_step = step
        if self.optimizer is not None:
            torch.save(self.optimizer.state_dict(), path / "optimizer.pt")

    def load(self, path: Path, step: int) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(self.model, load_file(str(path / "adapter_model.safetensors")))
        self.optimizer = None  # rebuilt (and its state restored) on the next step
        self._optimizer_state = path / "optimizer.pt"
        self.loaded_step = step

    # -- sampling -------------------------------------------------------------------------

    def render_prompt(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> str:
        """The chat template's text for `messages` (with their tool calls and results) and
        the `tools` offered, ready for the assistant's turn."""
        turns = [
            {
                "role": m.get("role", "user"),
                "content": m.get("content") or "",
                **{k: m[k] for k in _TOOL_KEYS if m.get(k) is not None},
            }
            for m in messages
        ]
        text = self.tokenizer.apply_chat_template(
            turns, tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=False
        )
        return str(text)

    def encode_prompt(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        text = self.render_prompt(messages, tools)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    @torch.no_grad()
    def sample(
        self,
        prompt_ids: list[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_logprobs: int,
        stop_ids: set[int],
        seed: int | None,
        abandoned: Callable[[], bool] = lambda: False,
        top_k: int = 0,
        stop_at_eos: bool = True,
    ) -> list[Sample]:
        """Sample `n` completions; logprobs are the model's own (before temperature), as
        vLLM reports them by default. `top_k` > 0 samples among the k likeliest tokens.
        `stop_at_eos` False: the end-of-sequence token stops nothing (Tinker's `stop=[]`).
        `abandoned` is asked before every token: once it says yes, sampling stops and raises
        `Abandoned` (its caller went away)."""
        generator = (
            torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        )
        input_ids = torch.tensor([prompt_ids] * n, device=self.device)
        past = None
        samples = [Sample([], [], [], "length") for _ in range(n)]
        active = list(range(n))
        for _ in range(max_tokens):
            if abandoned():
                raise Abandoned("the request was abandoned")
            out = self.model(input_ids=input_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            chosen = _choose(logits, temperature, top_p, generator, top_k)
            top = torch.topk(logprobs, k=top_logprobs) if top_logprobs else None
            for row in list(active):
                token = int(chosen[row])
                sample = samples[row]
                sample.token_ids.append(token)
                sample.logprobs.append(float(logprobs[row, token]))
                if top is not None:
                    sample.top_logprobs.append(
                        [
                            (int(i), float(v))
                            for v, i in zip(top.values[row], top.indices[row], strict=True)
                        ]
                    )
                else:
                    sample.top_logprobs.append([])
                if (stop_at_eos and token == self.eos_id) or token in stop_ids:
                    sample.finish_reason = "stop"
                    active.remove(row)
            if not active:
                break
            input_ids = chosen.unsqueeze(-1)
        return samples

    # -- training -------------------------------------------------------------------------

    def sequences(
        self, groups: Sequence[Any], *, scale_rewards: bool, allow_without_logprobs: bool
    ) -> list[list[Turn]]:
        """Turn trainable groups into token sequences with group-normalized advantages."""
        batches = []
        for group in groups:
            rewards = [t.reward for t in group.trajectories]
            if len(rewards) < 2 or len(set(rewards)) < 2:
                continue  # zero advantage everywhere: GRPO learns nothing from it
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
            batch = []
            for trajectory, reward in zip(group.trajectories, rewards, strict=True):
                advantage = (reward - mean) / (std + 1e-6) if scale_rewards else reward - mean
                if advantage != 0:
                    batch += self._turns(trajectory, advantage, allow_without_logprobs)
            if batch:
                batches.append(batch)
        return batches

    def _turns(self, trajectory: Any, advantage: float, allow_without_logprobs: bool) -> list[Turn]:
        # The prompt each turn was sampled from: its context and the tools offered.
        tools = getattr(trajectory, "tools", None)
        context: list[dict[str, Any]] = []
        turns = []
        for item in trajectory.messages_and_choices:
            if isinstance(item, Choice):
                content = item.message.content or ""
                if item.logprobs and item.logprobs.content:
                    ids = [self._token_id(t.token) for t in item.logprobs.content]
                    old = [t.logprob for t in item.logprobs.content]
                    turns.append(Turn(self.encode_prompt(context, tools), ids, old, advantage))
                elif allow_without_logprobs:
                    turns.append(self._retokenized(context, content, advantage, tools))
                calls = [c.model_dump() for c in item.message.tool_calls or []]
                context.append({"role": "assistant", "content": content, "tool_calls": calls})
            else:
                if item.get("role") == "assistant" and allow_without_logprobs:
                    content = item.get("content") or ""
                    turns.append(self._retokenized(context, content, advantage, tools))
                context.append(dict(item))
        return turns

    def _retokenized(
        self,
        context: list[dict[str, Any]],
        content: str,
        advantage: float,
        tools: Sequence[dict[str, Any]] | None,
    ) -> Turn:
        ids = [*self.tokenizer(content, add_special_tokens=False)["input_ids"], self.eos_id]
        return Turn(self.encode_prompt(context, tools), ids, None, advantage)

    def _token_id(self, token: str) -> int:
        if token.startswith("token_id:"):
            named = int(token.split(":", 1)[1])
            vocabulary = self.model.get_input_embeddings().weight.shape[0]
            if not 0 <= named < vocabulary:
                # A ValueError is the job's permanent error, named (not torch's IndexError).
                raise ValueError(
                    f"a logprob's token {token!r} is outside the model's vocabulary "
                    f"(0..{vocabulary - 1}): were these answers sampled from another model?"
                )
            return named
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        assert isinstance(token_id, int)
        return token_id

    def step(
        self,
        batch: list[Turn],
        *,
        learning_rate: float,
        epsilon: float,
        kl_penalty_coef: float,
        max_grad_norm: float,
    ) -> dict[str, float]:
        """One gradient step on one group's sequences (clipped importance-sampled PG)."""
        optimizer = self._optimizer(learning_rate)
        self.model.train()
        optimizer.zero_grad()
        losses, kls, ratios = [], [], []
        for seq in batch:
            new = self._completion_logprobs(seq)
            old = (
                torch.tensor(seq.old_logprobs, device=self.device)
                if seq.old_logprobs
                else new.detach()
            )
            ratio = torch.exp(new - old)
            clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
            loss = -torch.min(ratio * seq.advantage, clipped * seq.advantage)
            if kl_penalty_coef > 0:
                with self.model.disable_adapter(), torch.no_grad():
                    ref = self._completion_logprobs(seq)
                kl = torch.exp(ref - new) - (ref - new) - 1  # k3 estimator, >= 0
                loss = loss + kl_penalty_coef * kl
                kls.append(float(kl.mean()))
            (loss.mean() / len(batch)).backward()
            losses.append(float(loss.mean().detach()))
            ratios.append(float(ratio.mean().detach()))
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], max_grad_norm
        )
        optimizer.step()
        self.model.eval()
        metrics = {
            "loss/train": sum(losses) / len(losses),
            "loss/grad_norm": float(grad_norm),
            "loss/ratio": sum(ratios) / len(ratios),
            "loss/learning_rate": learning_rate,
        }
        if kls:
            metrics["loss/kl_policy_ref"] = sum(kls) / len(kls)
        return metrics

    # -- supervised and preference steps --------------------------------------------------

    def sft_turns(self, trajectory: Any, assistant_turns: str = "all") -> list[Turn]:
        """Each assistant turn of a chat as a target, after the context it answers (only its
        tokens, and the end-of-turn token, are trained on; the rest is masked out)."""
        tools = getattr(trajectory, "tools", None)
        context: list[dict[str, Any]] = []
        turns = []
        for item in trajectory.messages_and_choices:
            message = item.message.model_dump() if isinstance(item, Choice) else dict(item)
            if message.get("role") == "assistant" and message.get("content"):
                turns.append(self._retokenized(context, message["content"], 1.0, tools))
            context.append(message)
        return turns[-1:] if assistant_turns == "last" else turns

    def sft_step(
        self, turns: list[Turn], *, learning_rate: float, max_grad_norm: float
    ) -> dict[str, float]:
        """One gradient step of cross-entropy on the target tokens of `turns` (the mean over
        every target token of the batch)."""
        optimizer = self._optimizer(learning_rate)
        self.model.train()
        optimizer.zero_grad()
        tokens = sum(len(t.completion_ids) for t in turns)
        total = 0.0
        for turn in turns:
            logprobs = self._completion_logprobs(turn)
            loss = -logprobs.sum() / tokens
            loss.backward()
            total += float(loss.detach())
        grad_norm = self._clip(max_grad_norm)
        optimizer.step()
        self.model.eval()
        return {
            "loss/train": total,
            "loss/grad_norm": grad_norm,
            "loss/learning_rate": learning_rate,
            "data/step_trainer_tokens": float(tokens),
        }

    def pair_turns(self, pair: dict[str, Any]) -> tuple[Turn, Turn]:
        """A preference pair as two completions of one prompt: (chosen, rejected)."""
        prompt = list(pair["prompt"])
        tools = pair.get("tools")
        return (
            self._retokenized(prompt, pair["chosen"], 1.0, tools),
            self._retokenized(prompt, pair["rejected"], -1.0, tools),
        )

    @torch.no_grad()
    def pair_logprobs(
        self, pairs: list[tuple[Turn, Turn]], *, adapter: bool = True
    ) -> list[tuple[float, float]]:
        """The summed logprobs of each pair's (chosen, rejected) answers; `adapter=False`:
        under the base model alone."""
        with contextlib.nullcontext() if adapter else self.model.disable_adapter():
            return [
                (
                    float(self._completion_logprobs(chosen).sum()),
                    float(self._completion_logprobs(rejected).sum()),
                )
                for chosen, rejected in pairs
            ]

    def dpo_step(
        self,
        pairs: list[tuple[Turn, Turn]],
        references: list[tuple[float, float]],
        *,
        beta: float,
        learning_rate: float,
        max_grad_norm: float,
    ) -> dict[str, float]:
        """One gradient step of the DPO loss, -log sigmoid(beta * ((pi_c - ref_c) - (pi_r -
        ref_r))), averaged over the batch. Reports the loss, the reward margin (the mean of
        beta * that difference) and the accuracy (pairs whose chosen reward is higher)."""
        optimizer = self._optimizer(learning_rate)
        self.model.train()
        optimizer.zero_grad()
        losses, margins = [], []
        for (chosen, rejected), (ref_c, ref_r) in zip(pairs, references, strict=True):
            pi_c = self._completion_logprobs(chosen).sum()
            pi_r = self._completion_logprobs(rejected).sum()
            margin = beta * ((pi_c - ref_c) - (pi_r - ref_r))
            loss = -torch.nn.functional.logsigmoid(margin)
            (loss / len(pairs)).backward()
            losses.append(float(loss.detach()))
            margins.append(float(margin.detach()))
        grad_norm = self._clip(max_grad_norm)
        optimizer.step()
        self.model.eval()
        return {
            "loss/train": sum(losses) / len(losses),
            "loss/grad_norm": grad_norm,
            "loss/learning_rate": learning_rate,
            "dpo/reward_margin": sum(margins) / len(margins),
            "dpo/accuracy": sum(m > 0 for m in margins) / len(margins),
        }

    @torch.no_grad()
    def answer_logprob(
        self, messages: Sequence[dict[str, Any]], answer: str, tools: Any = None
    ) -> float:
        """The mean per-token logprob of `answer` (and its end-of-turn token) after
        `messages`: how likely the model is to say it."""
        turn = self._retokenized(list(messages), answer, 1.0, tools)
        return float(self._completion_logprobs(turn).mean())

    def _clip(self, max_grad_norm: float) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))

    def _completion_logprobs(self, seq: Turn) -> torch.Tensor:
        ids = torch.tensor([seq.prompt_ids + seq.completion_ids], device=self.device)
        logits = self.model(input_ids=ids).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = ids[0, 1:]
        picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return picked[len(seq.prompt_ids) - 1 :]

    def _optimizer(self, learning_rate: float) -> torch.optim.Optimizer:
        if self.optimizer is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
            state = getattr(self, "_optimizer_state", None)
            if state is not None and Path(state).exists():
                self.optimizer.load_state_dict(
                    torch.load(state, weights_only=True, map_location=self.device)
                )
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        return self.optimizer


def default_threads() -> int:
    """Torch's threads where `TRAINYARD_CPU_THREADS` is not set: every CPU this process may
    use but one, which the event loop, the database and the other processes keep."""
    return max(1, available_cpus() - 1)


def available_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may use: those it may run on, capped by its cgroup's CPU quota
    rounded up (a container's CPU limit: `docker run --cpus`, a pod's `limits.cpu`), which
    the CPU affinity does not show (a container sees every CPU of its node)."""
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_quota(cgroup)
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def _cgroup_quota(root: Path) -> float | None:
    """CPUs' worth of time a period the cgroup may use (v2 `cpu.max`, else v1's
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`); None where none is set or none is read."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        with contextlib.suppress(OSError, ValueError):
            quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
            period_us = int((v1 / "cpu.cfs_period_us").read_text())
            return None if quota_us <= 0 else quota_us / period_us
    return None


def use_threads(threads: int | None) -> None:
    """Set the process's torch intra-op threads (None: `default_threads`). Torch's default,
    a thread per core, makes each operator wait at a barrier for its slowest thread, and on
    a machine whose cores are busy with anything else (the server's own event loop
    answering a poll, a client beside it) that thread is often descheduled: on the 2-core
    machine, a Tinker `forward_backward` took 332 ms with two threads against 77 ms with
    one (`bench/README.md`). Process-wide; set again only when it changes."""
    wanted = threads or default_threads()
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


def resolve_device(device: str) -> str:
    """`auto`: the first CUDA device when torch sees one, else the CPU; `cpu`, `cuda` and
    `cuda:N` as given (a CUDA device asked for where there is none is an error here)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"TRAINYARD_CPU_DEVICE={device}, but torch sees no CUDA device")
    return device


def _choose(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    top_k: int = 0,
) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
