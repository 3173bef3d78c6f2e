"""Tinker's operations on the cpu backend's policy, called directly on a tiny model: the
losses' values and gradients, gradients summed across calls until the optimizer step,
AdamW as torch's with the request's parameters, the LoRA config honoured, sampling from a
saved copy of the weights. Also the futures' long poll."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import NEEDS_TORCH

# The module is Tinker's math on torch tensors from top to bottom: where torch is absent
# (the Python 3.12 environment) it is skipped whole, with the reason.
torch = pytest.importorskip("torch", reason=NEEDS_TORCH)

from app.backends.tiny_model import make_tiny_model  # noqa: E402
from app.tinker import sampling, spec, trainer  # noqa: E402
from app.tinker.futures import Futures, Result  # noqa: E402
from app.tinker.spec import DEFAULT_ADAM  # noqa: E402
from app.tinker.wire import Datum, Tensor  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.any_database]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


def policy(tiny: str, **lora: object) -> trainer.Policy:
    config = {"rank": 4, "seed": 3, **lora}
    return trainer.load_policy(tiny, spec.Lora(**config), "cpu")  # type: ignore[arg-type]


def datum(tokens: list[int], targets: list[int], **inputs: list[float]) -> Datum:
    tensors = {"target_tokens": Tensor(np.array(targets, np.int64), [len(targets)])}
    tensors |= {k: Tensor(np.array(v, np.float32), [len(v)]) for k, v in inputs.items()}
    return Datum(tokens, tensors)


def grads(p: trainer.Policy) -> dict[str, torch.Tensor]:
    return {
        name: param.grad.clone()
        for name, param in p.model.named_parameters()
        if param.requires_grad and param.grad is not None
    }


def lora_weights(p: trainer.Policy) -> dict[str, torch.Tensor]:
    return {n: w.detach().clone() for n, w in p.model.named_parameters() if w.requires_grad}


def test_rank_seed_and_targets_are_honoured(tiny: str) -> None:
    one, again, other = policy(tiny), policy(tiny), policy(tiny, seed=4)
    assert all(torch.equal(w, lora_weights(again)[n]) for n, w in lora_weights(one).items())
    assert any(not torch.equal(w, lora_weights(other)[n]) for n, w in lora_weights(one).items())
    shapes = {n: w.shape for n, w in lora_weights(one).items()}
    assert all(4 in shape for shape in shapes.values())
    assert any("lm_head" in n for n in shapes) and any("q_proj" in n for n in shapes)
    narrow = lora_weights(policy(tiny, train_unembed=False, train_attn=False))
    assert narrow and not any("lm_head" in n or "q_proj" in n for n in narrow)
    assert any("up_proj" in n for n in narrow)


def test_cross_entropy_is_the_weighted_negative_logprob(tiny: str) -> None:
    p = policy(tiny)
    d = datum([5, 6, 7], [6, 7, 8], weights=[0.0, 1.0, 0.5])
    outputs, metrics = trainer.forward_backward(p, [d], "cross_entropy", {}, backward=False)
    lp = outputs[0]["logprobs"]
    assert np.all(lp < 0)
    assert outputs[0]["elementwise_loss"] == pytest.approx(-np.array([0.0, 1.0, 0.5]) * lp)
    assert metrics["loss:sum"] == pytest.approx(float(-(lp[1] + 0.5 * lp[2])), rel=1e-5)
    assert grads(p) == {}  # forward only: no gradient


def test_gradients_add_up_across_calls_until_the_step(tiny: str) -> None:
    a = datum([5, 6, 7], [6, 7, 8], weights=[1.0, 1.0, 1.0])
    b = datum([9, 10], [10, 11], weights=[0.5, 1.0])
    together, apart = policy(tiny), policy(tiny)
    trainer.forward_backward(together, [a, b], "cross_entropy", {}, backward=True)
    trainer.forward_backward(apart, [a], "cross_entropy", {}, backward=True)
    trainer.forward_backward(apart, [b], "cross_entropy", {}, backward=True)
    summed, split = grads(together), grads(apart)
    assert summed.keys() == split.keys() and summed
    for name, grad in summed.items():
        assert torch.allclose(grad, split[name], atol=1e-6), name
    trainer.optim_step(apart, DEFAULT_ADAM)
    assert grads(apart) == {}  # cleared by the step


def test_the_step_is_torchs_adamw_with_the_requests_parameters(tiny: str) -> None:
    ours, reference = policy(tiny), policy(tiny)
    d = datum([5, 6, 7], [6, 7, 8], weights=[1.0, 1.0, 1.0])
    adam = {**DEFAULT_ADAM, "learning_rate": 0.01, "beta2": 0.99, "weight_decay": 0.1}
    params = [w for w in reference.model.parameters() if w.requires_grad]
    torch_adamw = torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.99), eps=1e-12, weight_decay=0.1)
    for _ in range(3):
        trainer.forward_backward(ours, [d], "cross_entropy", {}, backward=True)
        metrics = trainer.optim_step(ours, adam)
        trainer.forward_backward(reference, [d], "cross_entropy", {}, backward=True)
        torch_adamw.step()
        torch_adamw.zero_grad()
    assert metrics == {"learning_rate": 0.01}
    mine, theirs = lora_weights(ours), lora_weights(reference)
    assert all(torch.allclose(w, theirs[n], atol=1e-6) for n, w in mine.items())
    assert any(not torch.equal(w, lora_weights(policy(tiny))[n]) for n, w in mine.items())


def test_importance_sampling_and_ppo(tiny: str) -> None:
    p = policy(tiny)
    probe = datum([5, 6], [6, 7], weights=[1.0, 1.0])
    lp = trainer.forward_backward(p, [probe], "cross_entropy", {}, backward=False)[0][0]["logprobs"]
    # Sampled with logprobs 0.5 below the model's: every ratio is e^0.5 ≈ 1.65.
    old = (lp - 0.5).tolist()
    d = datum([5, 6], [6, 7], logprobs=old, advantages=[1.0, -2.0])
    ratio = np.exp(0.5)
    out, _ = trainer.forward_backward(p, [d], "importance_sampling", {}, backward=False)
    assert out[0]["elementwise_loss"] == pytest.approx([-ratio, 2 * ratio], rel=1e-5)
    out, _ = trainer.forward_backward(p, [d], "ppo", {}, backward=False)
    # A > 0: the ratio clipped at 1.2; A < 0: min(r A, clip(r) A) keeps the unclipped r A.
    assert out[0]["elementwise_loss"] == pytest.approx([-1.2, 2 * ratio], rel=1e-5)
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}
    out, _ = trainer.forward_backward(p, [d], "ppo", config, backward=False)
    assert out[0]["elementwise_loss"] == pytest.approx([-1.5, 2 * ratio], rel=1e-5)
    # CISPO: the clipped ratio (1.2) times A weighs each token's logprob, with no gradient
    # through the ratio: its gradient is cross_entropy's with weights -(-1.2 A).
    out, _ = trainer.forward_backward(p, [d], "cispo", {}, backward=True)
    assert out[0]["elementwise_loss"] == pytest.approx(-1.2 * np.array([1.0, -2.0]) * lp, rel=1e-5)
    cispo = grads(p)
    q = policy(tiny)
    weighted = datum([5, 6], [6, 7], weights=[1.2, -2.4])
    trainer.forward_backward(q, [weighted], "cross_entropy", {}, backward=True)
    assert all(torch.allclose(g, grads(q)[n], atol=1e-6) for n, g in cispo.items())


@pytest.mark.parametrize(
    ("loss_fn", "d", "message"),
    [
        ("dpo", datum([1], [2], weights=[1.0]), "loss_fn 'dpo' is not supported"),
        ("cross_entropy", datum([], [], weights=[]), "data[0].model_input is empty"),
        ("cross_entropy", datum([1, 500], [2, 3], weights=[1, 1]), "token 500 is outside"),
        ("cross_entropy", datum([1, 2], [2, 500], weights=[1, 1]), "target_tokens: a token"),
        ("cross_entropy", datum([1, 2], [2, 3], weights=[1.0]), "weights has 1 values for 2"),
        ("ppo", datum([1], [2], logprobs=[0.0]), "loss_fn_inputs.advantages is required by ppo"),
        (
            "ppo",
            datum([1], [2], logprobs=[0.0], advantages=[float("inf")]),
            "data[0].loss_fn_inputs.advantages: a value is NaN or infinite",
        ),
        (
            "cross_entropy",
            datum([1, 2], [2, 3], weights=[1.0, float("nan")]),
            "data[0].loss_fn_inputs.weights: a value is NaN or infinite",
        ),
        (
            "cross_entropy",
            datum([1] * 2049, [2] * 2049, weights=[1.0] * 2049),
            "data[0].model_input has 2049 tokens; the context holds at most 2048",
        ),
    ],
)
def test_what_a_loss_cannot_take_is_refused_naming_the_datum(
    loss_fn: str, d: Datum, message: str
) -> None:
    with pytest.raises(spec.UserError, match=re.escape(message)):
        spec.check_data(100, loss_fn, [d])


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"learning_rate": 2}, "adam_params.learning_rate: must be a number from 0 to 1"),
        ({"beta2": 1.0}, "adam_params.beta2: must be a number from 0, below 1"),
        ({"eps": 0}, "adam_params.eps: must be a number above 0, at most 1"),
        ({"weight_decay": float("nan")}, "adam_params.weight_decay: must be a number from 0 to 1"),
        ({"grad_clip_norm": -1}, "adam_params.grad_clip_norm: must be a number from 0"),
        ({"momentum": 0.9}, "adam_params.momentum: not a parameter of AdamW here"),
        ([], "adam_params: an object"),
    ],
)
def test_adams_parameters_out_of_range_are_refused_by_name(given: Any, message: str) -> None:
    with pytest.raises(spec.UserError, match=re.escape(message)):
        spec.check_adam(given)
    assert spec.check_adam({"learning_rate": 0.01}) == {**DEFAULT_ADAM, "learning_rate": 0.01}
    with pytest.raises(spec.UserError, match=re.escape("loss_fn_config.clip_low_threshold")):
        spec.check_config({"clip_low_threshold": float("nan")})


def test_a_sampler_keeps_the_weights_it_was_saved_with(tiny: str, tmp_path: Path) -> None:
    p = policy(tiny)
    saved = trainer.adapter_state(p)

    asked = sampling.read(
        {
            "prompt": {"chunks": [{"tokens": [5, 6]}]},
            "num_samples": 4,
            "sampling_params": {"max_tokens": 3, "temperature": 1.0, "top_p": 1.0, "seed": 1},
        }
    )

    def draw() -> list[list[int]]:
        return [s.tokens for s in trainer.sample(p, saved, asked, set())]

    before = draw()
    d = datum([5, 6], [6, 7], weights=[1.0, 1.0])
    for _ in range(3):
        trainer.forward_backward(p, [d], "cross_entropy", {}, backward=True)
        trainer.optim_step(p, {**DEFAULT_ADAM, "learning_rate": 0.05})
    trained = lora_weights(p)
    scored, _ = trainer.forward_backward(p, [d], "cross_entropy", {}, backward=False)
    assert draw() == before  # the old weights, loaded for the sample and left in ...
    assert draw() == before  # ... for the next sample (which loads nothing) ...
    # ... until the run's next operation, which puts the adapter's own weights back first.
    again_scored, _ = trainer.forward_backward(p, [d], "cross_entropy", {}, backward=False)
    assert np.array_equal(again_scored[0]["logprobs"], scored[0]["logprobs"])
    assert all(torch.equal(w, lora_weights(p)[n]) for n, w in trained.items())
    assert draw() == before
    trainer.training_weights(p)
    assert all(torch.equal(w, lora_weights(p)[n]) for n, w in trained.items())
    # The same weights read back from a checkpoint directory sample the same.
    p.save(tmp_path, 1)
    from_disk = trainer.read_adapter(tmp_path)
    again = trainer.sample(p, from_disk, asked, set())
    now = trainer.sample(p, trainer.adapter_state(p), asked, set())
    assert [s.tokens for s in again] == [s.tokens for s in now]


async def test_a_future_not_ready_in_time_is_none_then_its_result() -> None:
    futures = Futures()
    gate = asyncio.Event()

    async def work() -> Result:
        await gate.wait()
        return Result(json={"metrics": {}})

    async def broken() -> Result:
        raise RuntimeError("the trainer fell over")

    assert futures.submit("r1", work(), owner=None) == "r1"
    assert (
        futures.submit("r1", work(), owner=None) == "r1"
    )  # the same request again: the first future
    assert await futures.wait("r1", seconds=0.01) is None
    gate.set()
    assert await futures.wait("r1", seconds=5) == Result(json={"metrics": {}})
    futures.submit("r2", broken(), owner=None)
    failed = await futures.wait("r2", seconds=5)
    assert failed == Result(error="RuntimeError: the trainer fell over", category="server")
    assert not futures.known("r3")
    await futures.close()


def test_stop_given_as_an_empty_list_does_not_stop_at_the_end_token(tiny: str) -> None:
    """The SDK's `stop=[]`: no stop token at all, not even end-of-sequence (without `stop`,
    end-of-sequence stops a sequence)."""
    p = policy(tiny)

    def greedy(**params: Any) -> Any:
        params = {"max_tokens": 4, "temperature": 0.0, **params}
        body = {"prompt": {"chunks": [{"tokens": [5, 6]}]}, "sampling_params": params}
        return trainer.sample(p, None, sampling.read(body), set())[0]

    first = greedy().tokens[0]
    p.eos_id = first  # the greedy first token now ends a sequence ...
    stopped = greedy()
    assert (stopped.tokens, stopped.stop_reason) == ([first], "stop")
    free = greedy(stop=[])  # ... unless nothing stops it
    assert (free.tokens[0], len(free.tokens), free.stop_reason) == (first, 4, "length")
