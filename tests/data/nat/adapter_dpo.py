"""Drives the NAT trainer adapter with DPO items, as NAT's DPO trajectory builder emits
them (`DPOItem`s in a `TrajectoryCollection`), against a live Trainyard at argv[1] whose
`demo` model is on the cpu backend (run by tests/test_nat_finetune.py): the adapter checks
its DPO keywords at start, sends the collection as a DPO job, and the job trains a step.
Prints `ok`."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from nat.data_models.finetuning import (
    DPOItem,
    FinetuneConfig,
    OpenAIMessage,
    TrainingStatusEnum,
    Trajectory,
    TrajectoryCollection,
)

from trainyard_client import AsyncTrainyard
from trainyard_client.nat import TrainyardTrainerAdapter, TrainyardTrainerAdapterConfig


def pair(prompt: str, as_messages: bool) -> Trajectory:
    item = DPOItem(
        prompt=[OpenAIMessage(role="user", content=prompt)] if as_messages else prompt,
        chosen_response="yes",
        rejected_response="no",
    )
    return Trajectory(episode=[item], reward=0.5)


COLLECTION = TrajectoryCollection(
    run_id="nemo_dpo_0123abcd",
    trajectories=[
        [pair(f"say yes {w}", i % 2 == 0) for i, w in enumerate(["one", "two", "three"])]
    ],
)


async def main(url: str, out: Path) -> None:
    config = TrainyardTrainerAdapterConfig(
        url=url, model="demo", method="dpo", hyperparameters={"beta": 0.1, "learning_rate": 0.02}
    )
    adapter = TrainyardTrainerAdapter(config)
    await adapter.initialize(FinetuneConfig(output_dir=out))
    ref = await adapter.submit(COLLECTION)
    done = await adapter.wait_until_complete(ref)
    assert done.status == TrainingStatusEnum.COMPLETED, done
    assert done.metadata and done.metadata["method"] == "dpo", done
    assert done.metadata["num_pairs"] == 3 and done.metadata["final_step"] == 1, done
    assert done.metadata["metrics"]["dpo/accuracy"] >= 0, done

    # RL keywords where DPO ones are due are refused before any rollout.
    wrong = config.model_copy(update={"hyperparameters": {"epsilon": 0.2}})
    try:
        await TrainyardTrainerAdapter(wrong).initialize(FinetuneConfig(output_dir=out))
        raise AssertionError("DPO accepted an RL keyword")
    except ValueError as exc:
        assert "epsilon" in str(exc), exc
    async with AsyncTrainyard(url) as client:
        (job,) = (await client.training_jobs.list(model="demo")).data
        assert job.method == "dpo" and job.hyperparameters == config.hyperparameters, job
    print("ok")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
