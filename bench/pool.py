"""The gateway through a serving pool against the pool called directly.

measured: chat completions (`max_tokens: 8`) of a model's step served by a serving pool
(`trainyard serve-pool`, the cpu backend's tiny model, the step's adapter loaded by the
gateway on its first request) through the gateway of `trainyard serve` (API only,
`TRAINYARD_SERVING_POOLS`), keys off: the latency of each request, C concurrent clients
each sending its next request when its answer is in, for ROUND_S.
Baseline: the same requests sent straight to the pool (`model` = `name@N`), same run;
ROUNDS rounds alternating the two, the medians of their p50s compared.
Goal: gateway / direct <= 1.15 at C=16.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from app.backends.tiny_model import make_tiny_model
from bench.common import TRAINYARD, free_port, report, server

CONCURRENCY = 16
ROUND_S = float(os.environ.get("BENCH_POOL_ROUND_S", "4"))
ROUNDS = int(os.environ.get("BENCH_POOL_ROUNDS", "3"))
GOAL = 1.15
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 1.0}


def _step_zero(data_dir: Path, tiny: Path) -> None:
    """Step 0 of `bench/bench` on the cpu backend's layout: a real adapter of the model."""
    from app.backends.cpu_policy import Policy

    path = data_dir / "cpu" / "bench" / "models" / "bench" / "checkpoints" / "0000"
    path.mkdir(parents=True)
    Policy(str(tiny), rank=8, alpha=16, seed=0).save(path, 0)


async def _round(url: str, model: str) -> list[float]:
    latencies: list[float] = []
    end = time.perf_counter() + ROUND_S
    async with httpx.AsyncClient(
        base_url=url, timeout=120, limits=httpx.Limits(max_connections=CONCURRENCY)
    ) as client:

        async def one_client() -> None:
            while time.perf_counter() < end:
                start = time.perf_counter()
                response = await client.post("/chat/completions", json={**BODY, "model": model})
                if response.status_code != 200:
                    raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(one_client() for _ in range(CONCURRENCY)))
    return latencies


async def _measure(gateway: str, pool: str) -> dict[str, list[float]]:
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(3):  # the adapter loaded in the pool, both paths warm
            answer = await client.post(
                f"{gateway}/chat/completions", json={**BODY, "model": "bench"}
            )
            assert answer.status_code == 200, answer.text
            await client.post(f"{pool}/chat/completions", json={**BODY, "model": "bench@0"})
    found: dict[str, list[float]] = {"direct": [], "gateway": []}
    for _ in range(ROUNDS):
        for kind, url, model in (("direct", pool, "bench@0"), ("gateway", gateway, "bench")):
            latencies = await _round(url, model)
            found[kind].append(statistics.median(latencies))
            found[kind + " requests"] = [*found.get(kind + " requests", []), len(latencies)]
    return found


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def _once(pinned: bool) -> dict[str, list[float]]:
    """One measurement: `pinned`, the pool on the first CPU and the gateway and the load on
    the others (as on separate hosts); else every process anywhere."""
    cpus = sorted(os.sched_getaffinity(0))
    pool_cpus, rest = {cpus[0]}, set(cpus[1:])
    with tempfile.TemporaryDirectory(prefix="bench-pool-") as tmp:
        root = Path(tmp)
        tiny = make_tiny_model(root / "models" / "tiny")
        data_dir = root / "data"
        _step_zero(data_dir, tiny)
        port = free_port()
        env = {
            **os.environ,
            "TRAINYARD_DATA_DIR": str(data_dir),
            "TRAINYARD_MODEL_ROOTS": str(tiny.parent),
            "TRAINYARD_LOG_LEVEL": "warning",
        }
        pool_process = subprocess.Popen(
            [TRAINYARD, "serve-pool", "--base-model", str(tiny), "--port", str(port)],
            env=env,
            # From its start, so torch sizes its thread pool to the CPUs it has.
            preexec_fn=(lambda: os.sched_setaffinity(0, pool_cpus)) if pinned else None,
        )
        pool = f"http://127.0.0.1:{port}/v1"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{pool}/models", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if pool_process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the pool did not start")
                time.sleep(0.1)
            pools = f'{{"{tiny}": ["{pool}"]}}'
            settings = {
                "TRAINYARD_DATA_DIR": str(data_dir),
                "TRAINYARD_MODEL_ROOTS": str(tiny.parent),
                "TRAINYARD_SERVING_POOLS": pools,
                "TRAINYARD_SERVING_MAX_TOKENS": str(10**9),
            }
            with server(settings) as (url, process):
                body = {
                    "name": "bench",
                    "project": "bench",
                    "base_model": str(tiny),
                    "backend": "cpu",
                }
                registered = httpx.post(f"{url}/v1/models", json=body, timeout=30)
                assert registered.status_code == 201, registered.text
                if pinned:
                    _pin(process.pid, rest)
                    _pin(os.getpid(), rest)
                try:
                    return asyncio.run(_measure(f"{url}/openai/v1", pool))
                finally:
                    _pin(os.getpid(), set(cpus))
        finally:
            pool_process.terminate()
            pool_process.wait(30)


def run() -> None:
    layouts = [("shared CPUs", False)]
    if len(os.sched_getaffinity(0)) >= 2:
        layouts.append(("pool on its own CPU", True))
    rows = []
    for label, pinned in layouts:
        found = _once(pinned)
        ratio = statistics.median(found["gateway"]) / statistics.median(found["direct"])
        rows += [
            (f"{label}: direct p50", ", ".join(f"{x * 1000:.0f} ms" for x in found["direct"])),
            (f"{label}: gateway p50", ", ".join(f"{x * 1000:.0f} ms" for x in found["gateway"])),
            (
                f"{label}: requests",
                f"direct {found['direct requests']}, gateway {found['gateway requests']}",
            ),
            (
                f"{label}: ratio",
                f"{ratio:.3f} (goal <= {GOAL}: {'met' if ratio <= GOAL else 'MISSED'})",
            ),
        ]
    report(f"pool (gateway through a serving pool vs the pool direct, C={CONCURRENCY})", rows)


if __name__ == "__main__":
    run()
