"""A training thread whose job is given up stops before its next write.

A job's task is cancelled when its worker stops past its grace, its lease is lost, or it is
cancelled; the job may then be trained by another worker. The cpu backend trains in a
thread, which a cancelled task does not stop: the backend tells it to stop before its next
gradient step or save, waits for it before the cancellation goes on, and puts the adapter
in memory back to the newest step on disk (half a step is no step). Time is controlled: the
thread is held inside its first gradient step until the test lets it go.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from app.backends.tiny_model import make_tiny_model

pytestmark = pytest.mark.torch

PAIR = {"prompt": [{"role": "user", "content": "say yes"}], "chosen": "yes", "rejected": "no"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def _weights(policy: Any) -> dict[str, Any]:
    return {
        name: tensor.detach().clone()
        for name, tensor in policy.model.named_parameters()
        if "lora" in name
    }


async def test_a_given_up_step_writes_nothing_and_leaves_the_adapter_as_on_disk(
    tmp_path: Path, tiny_model: Path
) -> None:
    import art

    from app.backends.cpu import CpuBackend

    backend = CpuBackend(tmp_path / "cpu", model_roots=[tiny_model.parent])
    model = art.TrainableModel(name="given-up", project="tests", base_model=str(tiny_model))
    await backend.register(model)
    _, policy = backend._policies[model.name]
    before = _weights(policy)
    entered, release = threading.Event(), threading.Event()
    steps: list[int] = []
    step = policy.dpo_step

    def held_step(*args: Any, **kwargs: Any) -> Any:
        steps.append(1)
        metrics = step(*args, **kwargs)  # the weights move: half the job's steps
        entered.set()
        release.wait(timeout=600)
        return metrics

    policy.dpo_step = held_step
    training = asyncio.create_task(
        backend.train_dpo(model, [PAIR] * 3, batch_size=1, learning_rate=0.5)
    )
    try:
        assert await asyncio.to_thread(entered.wait, 600)
        training.cancel()
        for _ in range(20):  # the cancellation waits for the thread, held inside its step
            await asyncio.sleep(0)
        assert not training.done()
    finally:
        release.set()
    with pytest.raises(asyncio.CancelledError):
        await training
    assert steps == [1]  # stopped before its second gradient step
    assert backend.step_on_disk(model) == 0  # and before its save
    after = _weights(policy)
    assert all(after[name].equal(before[name]) for name in before)
    assert policy.loaded_step == 0

    # The next job on this process starts from step 0 and lands step 1.
    policy.dpo_step = step
    result = await backend.train_dpo(model, [PAIR] * 2, batch_size=1, learning_rate=0.5)
    assert result.step == 1 and backend.step_on_disk(model) == 1
