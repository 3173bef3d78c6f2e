"""Recovery after a burst of abandoned chat requests.

measured: `trainyard serve` with its worker, the cpu backend's tiny model; a burst of
BURST gateway requests (`n: 64`, `max_tokens: 1024`), each abandoned by its client after
ABANDON_S; then the time from the burst's end until a short completion (`max_tokens: 2`)
answers 200 (429s retried at once), and the server's resident memory (VmRSS) before the
burst and once the work is drained. Twice: with the default admission bound, and with a
bound so large that every request reaches the backend (cancellation alone).
Baseline: the same short completion on the idle server, same run.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from app.backends.tiny_model import make_tiny_model
from bench.common import report, server

BURST = 50
ABANDON_S = 0.5
GOAL_S = 2.0
SHORT = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _short(client: httpx.AsyncClient) -> float:
    """Seconds until a short completion answers 200 (429: asked again at once)."""
    start = time.perf_counter()
    while True:
        response = await client.post("/openai/v1/chat/completions", json=SHORT)
        if response.status_code == 200:
            return time.perf_counter() - start
        if response.status_code != 429:
            raise RuntimeError(f"short completion: {response.status_code} {response.text}")
        await asyncio.sleep(0.01)


async def _abandoned(url: str) -> int:
    """One big request given up after ABANDON_S; its status, or 0 when abandoned."""
    big = {**SHORT, "n": 64, "max_tokens": 1024, "temperature": 1.0}
    async with httpx.AsyncClient(base_url=url, timeout=ABANDON_S) as client:
        try:
            return (await client.post("/openai/v1/chat/completions", json=big)).status_code
        except httpx.TimeoutException:
            return 0


async def _in_flight(client: httpx.AsyncClient) -> float:
    total = 0.0
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("trainyard_serving_tokens{") and 'model="bench"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _measure(url: str, pid: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for _ in range(3):  # warm: the model loaded, the first answers' allocations made
            await _short(client)
        idle = min([await _short(client) for _ in range(5)])
        before = rss_mib(pid)
        statuses = await asyncio.gather(*(_abandoned(url) for _ in range(BURST)))
        recovery = await _short(client)
        drained_start = time.perf_counter()
        while await _in_flight(client) > 0 and time.perf_counter() - drained_start < 600:
            await asyncio.sleep(0.1)
        drained = time.perf_counter() - drained_start
        await asyncio.sleep(1.0)
        after = rss_mib(pid)
    return {
        "idle": idle,
        "recovery": recovery,
        "drained": drained,
        "before": before,
        "after": after,
        "abandoned": statuses.count(0),
        "refused": statuses.count(429),
    }


def _phase(root: Path, base: Path, bound: int | None) -> dict[str, float]:
    env = {
        "TRAINYARD_DATABASE_URL": f"sqlite+aiosqlite:///{root / f'bench-{bound}.db'}",
        "TRAINYARD_DATA_DIR": str(root / f"data-{bound}"),
        "TRAINYARD_MODEL_ROOTS": str(base.parent),
    }
    if bound is not None:
        env["TRAINYARD_SERVING_MAX_TOKENS"] = str(bound)
    with server(env, worker=True) as (url, process):
        body = {"name": "bench", "project": "bench", "base_model": str(base), "backend": "cpu"}
        assert httpx.post(f"{url}/v1/models", json=body, timeout=60).status_code == 201
        return asyncio.run(_measure(url, process.pid))


def run() -> dict[str, float]:
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_tiny_model(root / "models" / "tiny")
        for label, bound in (("default bound", None), ("unbounded: cancellation alone", 10**9)):
            f = _phase(root, base, bound)
            report(
                f"abandoned requests: {BURST} x (n 64, max_tokens 1024) given up after "
                f"{ABANDON_S} s, cpu backend (tiny model), {label}",
                [
                    ("baseline: short completion, idle", f"{f['idle'] * 1000:.0f} ms"),
                    (
                        "after the burst: short completion answers in",
                        f"{f['recovery']:.2f} s (goal <= {GOAL_S:g} s; "
                        f"{f['recovery'] / f['idle']:.0f}x idle)",
                    ),
                    ("then admitted work drained in", f"{f['drained']:.2f} s"),
                    (
                        "burst: abandoned / refused 429",
                        f"{f['abandoned']:.0f} / {f['refused']:.0f}",
                    ),
                    (
                        "server RSS before / after",
                        f"{f['before']:.0f} MiB / {f['after']:.0f} MiB "
                        f"({f['after'] - f['before']:+.0f} MiB)",
                    ),
                ],
            )
            figures[f"recovery_{'default' if bound is None else 'unbounded'}_s"] = f["recovery"]
    return figures


if __name__ == "__main__":
    run()
