"""Fan-out efficiency of the sampling client against an OpenAI-compatible server.

A fake `/v1/chat/completions` (FastAPI under uvicorn, in its own process on loopback)
answers every request after a fixed latency L with a small chat.completion carrying
logprobs. N `SamplingClient.chat` calls at concurrency C can take no less than N*L/C;
the figure is the measured wall time divided by that ideal, in the same run (goal <= 1.15).
Baseline: the raw round trip of one request at a time (median), whose excess over L is
the per-request overhead of the client, the server and loopback together.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request

from app.rollouts.sampling import SamplingClient
from bench.common import free_port, report

LATENCY = 0.050
REQUESTS = 400
CONCURRENCIES = (16, 64)
GOAL = 1.15
ROOT = Path(__file__).resolve().parent.parent

BODY = {
    "model": "bench",
    "messages": [{"role": "user", "content": "What is 6 x 7?"}],
    "max_tokens": 8,
    "logprobs": True,
}


def create_fake_app(latency: float) -> Any:
    """The fake OpenAI-compatible server: sleep `latency`, answer a chat.completion."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "bench", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        await asyncio.sleep(latency)
        tokens = ["4", "2"]
        return {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(tokens)},
                    "finish_reason": "stop",
                    "logprobs": {
                        "content": [
                            {
                                "token": f"token_id:{19 + i}",
                                "logprob": -0.01,
                                "bytes": list(t.encode()),
                                "top_logprobs": [],
                            }
                            for i, t in enumerate(tokens)
                        ]
                    },
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14},
        }

    return app


def serve(port: int, latency: float) -> None:
    """Entry point of the server process."""
    import uvicorn

    uvicorn.run(
        create_fake_app(latency),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
    )


@contextmanager
def fake_server(latency: float) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    code = f"from bench.fanout import serve; serve({port}, {latency!r})"
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fake server did not start")
            time.sleep(0.05)
        yield url, process
    finally:
        process.terminate()
        process.wait(30)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def round_trip(url: str, repeat: int = 40) -> float:
    """Median wall time of one request at a time over a kept-alive connection."""
    times = []
    async with httpx.AsyncClient() as client:
        for i in range(repeat + 3):
            start = time.perf_counter()
            response = await client.post(f"{url}/chat/completions", json=BODY)
            elapsed = time.perf_counter() - start
            response.raise_for_status()
            if i >= 3:  # the first requests open the connection and warm the server up
                times.append(elapsed)
    return statistics.median(times)


async def fan_out(url: str, pid: int, concurrency: int, requests: int) -> dict[str, float]:
    """Wall time of `requests` chat calls at `concurrency`, from a fresh client (cold pool:
    opening the connections is part of the cost), with CPU spent on each side."""
    client_cpu, server_cpu = time.process_time(), _cpu_seconds(pid)
    start = time.perf_counter()
    async with SamplingClient(url, "bench-key", concurrency=concurrency) as client:
        results = await asyncio.gather(*(client.chat(BODY) for _ in range(requests)))
    wall = time.perf_counter() - start
    assert all(r["choices"][0]["message"]["content"] == "42" for r in results)
    return {
        "wall": wall,
        "client_cpu": time.process_time() - client_cpu,
        "server_cpu": _cpu_seconds(pid) - server_cpu,
    }


async def run(
    latency: float = LATENCY, requests: int = REQUESTS, concurrencies: tuple[int, ...] = CONCURRENCIES
) -> dict[str, float]:
    results: dict[str, float] = {}
    with fake_server(latency) as (url, process):
        rtt = await round_trip(url)
        await fan_out(url, process.pid, max(concurrencies), max(concurrencies))  # warm-up
        rows = [
            ("server latency L", f"{latency * 1000:.0f} ms"),
            ("baseline: one request at a time, median", f"{rtt * 1000:.2f} ms"),
            ("  overhead per request over L", f"{(rtt - latency) * 1000:.2f} ms"),
        ]
        for concurrency in concurrencies:
            ideal = requests * latency / concurrency
            m = await fan_out(url, process.pid, concurrency, requests)
            ratio = m["wall"] / ideal
            verdict = "met" if ratio <= GOAL else "NOT met"
            rows += [
                (f"C={concurrency}: ideal N*L/C", f"{ideal * 1000:.0f} ms"),
                (f"C={concurrency}: wall", f"{m['wall'] * 1000:.0f} ms"),
                (f"C={concurrency}: ratio", f"{ratio:.3f}x (goal <= {GOAL}: {verdict})"),
                (
                    f"C={concurrency}: CPU per request, client / server",
                    f"{m['client_cpu'] / requests * 1000:.2f} / "
                    f"{m['server_cpu'] / requests * 1000:.2f} ms",
                ),
            ]
            results[f"ratio_c{concurrency}"] = ratio
    report(
        f"fan-out: {requests} chat completions, server latency {latency * 1000:.0f} ms, "
        f"wall / (N*L/C)",
        rows,
    )
    return results


if __name__ == "__main__":
    asyncio.run(run())
