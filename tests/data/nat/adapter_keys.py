"""Drives the NAT trainer adapter against a live Trainyard at argv[1] that has API keys,
argv[2] among them, from the NAT environment (run by tests/test_nat_finetune.py): the key
given in the adapter's config, in TRAINYARD_API_KEY, in a config NAT's YAML loader fills
in from the environment, and not at all. Prints `ok`."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from nat.data_models.finetuning import FinetuneConfig, TrainingStatusEnum, TrajectoryCollection
from nat.utils.io.yaml_tools import yaml_loads

from trainyard_client import AsyncTrainyard, AuthenticationError
from trainyard_client.nat import TrainyardTrainerAdapter, TrainyardTrainerAdapterConfig


def answer(text: str, reward: float, token: int, logprob: float) -> dict[str, object]:
    return {
        "episode": [
            {"role": "user", "content": "2+2?"},
            {
                "role": "assistant",
                "content": text,
                "logprobs": {"content": [{"token": f"token_id:{token}", "logprob": logprob}]},
            },
        ],
        "reward": reward,
    }


COLLECTION = TrajectoryCollection.model_validate(
    {
        "run_id": "art_run_keys",
        "trajectories": [[answer("4", 1.0, 19, -0.1), answer("5", 0.0, 20, -2.3)]],
    }
)
BLOCK = """
trainer_adapters:
  trainyard:
    _type: trainyard_trainer_adapter
    url: {url}
    model: keyed
    api_key: ${{TRAINYARD_API_KEY}}
"""


def environment(key: str | None) -> None:
    if key is None:
        os.environ.pop("TRAINYARD_API_KEY", None)
    else:
        os.environ["TRAINYARD_API_KEY"] = key


async def trains(config: TrainyardTrainerAdapterConfig, out: Path) -> int:
    """One submit, followed to its end; the step it made."""
    adapter = TrainyardTrainerAdapter(config)
    adapter.run_config = FinetuneConfig(output_dir=out)
    ref = await adapter.submit(COLLECTION)
    done = await adapter.wait_until_complete(ref)
    assert done.status == TrainingStatusEnum.COMPLETED, done
    assert (await adapter.status(ref)) == done
    assert done.metadata is not None
    return int(done.metadata["final_step"])


async def main(url: str, key: str, out: Path) -> None:
    environment(None)
    async with AsyncTrainyard(url, api_key=key) as client:
        await client.models.create(
            name="keyed",
            project="nat",
            base_model="Qwen/Qwen2.5-0.5B-Instruct",
            backend="dry-run",
            config={"seconds_per_step": 0.01},
        )
    base = TrainyardTrainerAdapterConfig(url=url, model="keyed")
    with_key = TrainyardTrainerAdapterConfig(url=url, model="keyed", api_key=key)
    steps = []

    environment(None)  # the config's key, and no variable
    steps.append(await trains(with_key, out))
    environment("stale")  # the config's key goes first
    steps.append(await trains(with_key, out))
    environment(key)  # no key in the config: the variable's
    steps.append(await trains(base, out))

    # `api_key: ${TRAINYARD_API_KEY}` as NAT's YAML loader reads it: filled in from the
    # environment, and null when it is unset (the variable's, if set later, is sent).
    loaded = yaml_loads(BLOCK.format(url=url), Path.cwd())
    filled = TrainyardTrainerAdapterConfig.model_validate(loaded["trainer_adapters"]["trainyard"])
    assert filled.api_key is not None and filled.api_key.get_secret_value() == key
    environment(None)
    steps.append(await trains(filled, out))
    unset = yaml_loads(BLOCK.format(url=url), Path.cwd())["trainer_adapters"]["trainyard"]
    empty = TrainyardTrainerAdapterConfig.model_validate(unset)
    assert empty.api_key is None  # NAT reads the empty value as null
    environment(key)
    steps.append(await trains(empty, out))
    assert steps == [1, 2, 3, 4, 5], steps

    environment(None)  # no key anywhere: refused, and nothing submitted
    try:
        await trains(base, out)
        raise AssertionError("a submit without a key was accepted")
    except AuthenticationError as exc:
        assert exc.status == 401, exc
    async with AsyncTrainyard(url, api_key=key) as client:
        assert (await client.models.get("keyed")).current_step == 5
    print("ok")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
