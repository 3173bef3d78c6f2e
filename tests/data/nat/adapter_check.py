"""Drives the NAT trainer adapter against a live Trainyard at argv[1], from the NAT
environment (run by tests/test_nat_finetune.py): statuses and their mapping, refs read
again, one job per submit under NAT's one run id, failures raised. Prints `ok`."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from nat.data_models.finetuning import (
    FinetuneConfig,
    TrainingJobRef,
    TrainingStatusEnum,
    TrajectoryCollection,
)

from trainyard_client import AsyncTrainyard
from trainyard_client.nat import TrainyardTrainerAdapter, TrainyardTrainerAdapterConfig
from trainyard_client.nat.adapter import TrainingJobFailed


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
        "run_id": "art_run_0123abcd",
        "trajectories": [[answer("4", 1.0, 19, -0.1), answer("5", 0.0, 20, -2.3)]],
    }
)


async def main(url: str, out: Path) -> None:
    async with AsyncTrainyard(url) as client:
        await client.models.create(
            name="agent",
            project="nat",
            base_model="Qwen/Qwen2.5-0.5B-Instruct",
            backend="dry-run",
            config={"seconds_per_step": 2.0},  # the second job waits: cancelled while queued
        )
        config = TrainyardTrainerAdapterConfig(
            url=url, model="agent", hyperparameters={"learning_rate": 1e-5}
        )
        run_config = FinetuneConfig(output_dir=out)
        adapter = TrainyardTrainerAdapter(config)

        # A dry-run model has no endpoint on the gateway: not healthy, so no start.
        assert not await adapter.is_healthy()
        try:
            await adapter.initialize(run_config)
            raise AssertionError("initialize accepted a model the gateway cannot serve")
        except RuntimeError as exc:
            assert "not healthy" in str(exc), exc
        bad = TrainyardTrainerAdapter(config.model_copy(update={"model": "nobody"}))
        try:
            await bad.initialize(run_config)
            raise AssertionError("initialize accepted a model that does not exist")
        except ValueError as exc:
            assert "no model `nobody`" in str(exc), exc
        adapter.run_config = run_config  # the rest goes on without the endpoint check

        # Two epochs of one NAT run: two jobs, the second queued behind the first.
        first = await adapter.submit(COLLECTION)
        second = await adapter.submit(COLLECTION)
        assert first.run_id == second.run_id == COLLECTION.run_id and first.backend == "trainyard"
        assert first.metadata and second.metadata
        assert first.metadata["job_id"] != second.metadata["job_id"]
        assert first.metadata["idempotency_key"] != second.metadata["idempotency_key"]
        pending = await adapter.status(second)
        assert pending.status == TrainingStatusEnum.PENDING and pending.progress == 0.0, pending
        await client.training_jobs.cancel(second.metadata["job_id"])  # still queued

        done = await adapter.wait_until_complete(first)
        assert done.status == TrainingStatusEnum.COMPLETED and done.progress == 100.0, done
        assert done.metadata and done.metadata["final_step"] == 1, done
        again = await adapter.status(first)  # status is not destructive
        assert again.status == TrainingStatusEnum.COMPLETED and again == done, again

        # Cancelled: NAT's `canceled`, and the wait raises.
        cancelled = await adapter.status(second)
        assert cancelled.status == TrainingStatusEnum.CANCELED, cancelled
        try:
            await adapter.wait_until_complete(second)
            raise AssertionError("a cancelled job did not raise")
        except TrainingJobFailed as exc:
            assert "cancelled" in str(exc), exc

        # Failed: sampled from step 0, the model is at 1 and the job allows no staleness.
        stale = await client.training_jobs.create(
            model="agent",
            collection=COLLECTION.model_dump(mode="json"),
            policy_step=0,
            max_steps_off_policy=0,
        )
        ref = TrainingJobRef(run_id="elsewhere", backend="trainyard", metadata={"job_id": stale.id})
        try:
            await adapter.wait_until_complete(ref)
            raise AssertionError("a failed job did not raise")
        except TrainingJobFailed as exc:
            assert "failed: StalePolicy" in str(exc), exc
        failed = await adapter.status(ref)
        assert failed.status == TrainingStatusEnum.FAILED, failed

    lines = list((out / "trainyard").glob("trainer_adapter_*.jsonl"))
    assert len(lines) == 2, lines  # the run's, and the ref from elsewhere
    print("ok")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
