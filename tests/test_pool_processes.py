"""Worker pools with real `trainyard worker` processes: a job of a pool no worker serves
waits and says why, and starts once a fitting worker registers; a worker never claims a
job of another pool, backend or labels; a drain through the CLI, and SIGTERM, stop a
worker, as GET /v1/workers shows."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import pytest

from tests import factories as f
from tests.backends import wait_final
from tests.processes import TRAINYARD, environment, event_rows, stop, until

pytestmark = pytest.mark.slow


def worker(settings: Any, *args: str, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([TRAINYARD, "worker", *args], env=environment(settings, **env))


async def test_pools_claim_only_what_they_can_run_and_drain(serve) -> None:
    async with serve() as live:  # the API alone: the workers below run every job
        client, settings = live.client, live.app.state.settings

        async def model(name: str, **extra: Any) -> None:
            body = f.model_body(name) | extra
            assert (await client.post("/v1/models", json=body)).status_code == 201

        async def listed() -> dict[int, dict[str, Any]]:
            return {w["pid"]: w for w in (await client.get("/v1/workers")).json()}

        async def registered(process: subprocess.Popen[bytes]) -> dict[str, Any]:
            async def seen() -> dict[str, Any] | None:
                assert process.poll() is None, f"{process.args} exited"
                return (await listed()).get(process.pid)

            return await until(seen, timeout=180, what=f"worker {process.args} to register")

        async def waiting(job_id: str) -> str | None:
            job = (await client.get(f"/v1/training-jobs/{job_id}")).json()
            assert job["status"] == "queued"
            return job["waiting_for"]

        await model("cpu-model", pool="cpu")
        await model("gpu-model", pool="gpu", labels={"gpu": "h200"})
        gpu_job = (await f.submit(client, model="gpu-model")).json()["id"]
        assert await waiting(gpu_job) == "no live worker in pool `gpu`"

        processes: list[subprocess.Popen[bytes]] = []
        try:
            cpu = worker(settings, "--pool", "cpu", "--backends", "dry-run")
            a100 = worker(
                settings, "--pool", "gpu", "--backends", "dry-run", "--labels", "gpu=a100"
            )
            processes += [cpu, a100]
            cpu_row, a100_row = await registered(cpu), await registered(a100)
            assert (cpu_row["pool"], cpu_row["backends"], cpu_row["labels"]) == (
                "cpu",
                ["dry-run"],
                {},
            )
            assert (a100_row["pool"], a100_row["labels"]) == ("gpu", {"gpu": "a100"})
            cpu_jobs = [(await f.submit(client, model="cpu-model")).json()["id"] for _ in range(3)]
            for job_id in cpu_jobs:
                assert (await wait_final(client, job_id))["status"] == "succeeded"
            assert await waiting(gpu_job) == (
                "no live worker in pool `gpu` that runs backend `dry-run` has the labels `gpu=h200`"
            )

            # A fitting worker, told by its settings this time: the job starts.
            h200 = worker(
                settings,
                TRAINYARD_WORKER_POOL="gpu",
                TRAINYARD_WORKER_BACKENDS="dry-run",
                TRAINYARD_WORKER_LABELS="gpu=h200,zone=a",
            )
            processes.append(h200)
            h200_row = await registered(h200)
            assert (await wait_final(client, gpu_job))["status"] == "succeeded"

            claims = {
                row.job_id: row.data["worker"]
                for row in await event_rows(live.app.state.sessions)
                if row.type == "job_claimed"
            }
            assert claims == {gpu_job: h200_row["id"]} | {j: cpu_row["id"] for j in cpu_jobs}

            # Drained through the CLI: it stops claiming, exits, and is gone from the list.
            asked = subprocess.run(
                [TRAINYARD, "worker", "--drain", cpu_row["id"]],
                env=environment(settings),
                capture_output=True,
                timeout=120,
            )
            assert asked.returncode == 0, asked.stderr
            assert cpu_row["id"] in asked.stdout.decode()
            assert await asyncio.to_thread(cpu.wait, 120) == 0
            missing = subprocess.run(
                [TRAINYARD, "worker", "--drain", cpu_row["id"]],
                env=environment(settings),
                capture_output=True,
                timeout=120,
            )
            assert missing.returncode == 1 and b"no live worker" in missing.stderr
            # SIGTERM: the same shutdown.
            stop(a100)
            assert a100.returncode == 0
            assert set(await listed()) == {h200.pid}
            late = (await f.submit(client, model="cpu-model")).json()["id"]
            assert await waiting(late) == "no live worker in pool `cpu`"
            metrics = (await client.get("/metrics")).text
            assert 'trainyard_pool_queue_depth{backend="dry-run",pool="cpu"} 1.0' in metrics
            assert 'trainyard_live_workers{backend="dry-run",pool="gpu"} 1.0' in metrics
        finally:
            for process in processes:
                stop(process)
