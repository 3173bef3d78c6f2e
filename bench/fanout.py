"""Fan-out efficiency of the sampling client against an OpenAI-compatible server.

A fake `/v1/chat/completions` (uvicorn, in its own process on loopback) answers every
request after a fixed latency L with a small chat.completion carrying logprobs. N
`SamplingClient.chat` calls at concurrency C can take no less than N*L/C; the figure is
the measured wall time divided by that ideal, in the same run (goal <= 1.15). N is a
multiple of every C: with N = 400 and C = 64 the last round holds 16 requests and even a
perfect client needs 7 rounds of L, not 6.25 (1.12x).

Setup, chosen so that the client is what is measured:
- the fake server is a bare ASGI app (no FastAPI routing or validation), so it is not
  the bottleneck: at 1,280 requests/s FastAPI's own CPU queued requests too;
- on a machine with 2+ CPUs the server is pinned to one CPU and this process to another,
  as if the model server were on its own machine (the scheduler otherwise puts both on
  one CPU after each loopback wake-up);
- "cold" includes creating the client and opening its connections (what a rollout job
  pays once); "warm" starts with the connections open. Each is the median of 3 runs.
Baseline: the raw round trip of one request at a time (median): its excess over L is the
per-request overhead of client, server and loopback together, when nothing queues. With
it comes a floor for this machine, ceil(N/C) rounds of that round trip: what no client
could beat here, and what the ratio to the ideal already holds of the machine's latency
(on this 2-core VM the round trip's excess moved from 3 to 7 ms within an evening).
"""

from __future__ import annotations

import asyncio
import json
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

from app.rollouts.sampling import SamplingClient
from bench.common import free_port, report

LATENCY = 0.050
REQUESTS = 512
CONCURRENCIES = (16, 64)
REPEAT = 3
GOAL = 1.15
ROOT = Path(__file__).resolve().parent.parent

BODY = {
    "model": "bench",
    "messages": [{"role": "user", "content": "What is 6 x 7?"}],
    "max_tokens": 8,
    "logprobs": True,
}


def completion(model: str) -> dict[str, Any]:
    tokens = ["4", "2"]
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
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


def create_fake_app(latency: float) -> Any:
    """ASGI app: POST /v1/chat/completions sleeps `latency`, then answers; GET /v1/models."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "POST" and scope["path"] == "/v1/chat/completions":
            request = json.loads(body)
            await asyncio.sleep(latency)
            status, payload = 200, completion(request["model"])
        elif scope["path"] == "/v1/models":
            status, payload = 200, {"object": "list", "data": [{"id": "bench"}]}
        else:
            status, payload = 404, {"error": {"message": "not found"}}
        out = json.dumps(payload).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out})

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


@contextmanager
def separate_cpus(pid: int) -> Iterator[str]:
    """Pin the server (every thread) to one CPU and this process to another; undone after."""
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        yield "not pinned (1 CPU)"
        return
    client_cpu, server_cpu = sorted(mine)[:2]
    for thread in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(thread), {server_cpu})
    os.sched_setaffinity(0, {client_cpu})
    try:
        yield f"server on CPU {server_cpu}, client on CPU {client_cpu}"
    finally:
        os.sched_setaffinity(0, mine)


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
            if i >= 3:  # the first requests open the connection
                times.append(elapsed)
    return statistics.median(times)


async def fan_out(
    url: str, pid: int, concurrency: int, requests: int, *, warm: bool
) -> dict[str, float]:
    """Wall time of `requests` chat calls at `concurrency`, with the CPU each side spent.
    Cold: from creating the client. Warm: after one round has opened every connection."""
    start = time.perf_counter()
    client_cpu, server_cpu = time.process_time(), _cpu_seconds(pid)
    async with SamplingClient(url, "bench-key", concurrency=concurrency) as client:
        if warm:
            await asyncio.gather(*(client.chat(BODY) for _ in range(concurrency)))
            start = time.perf_counter()
            client_cpu, server_cpu = time.process_time(), _cpu_seconds(pid)
        results = await asyncio.gather(*(client.chat(BODY) for _ in range(requests)))
        wall = time.perf_counter() - start
        client_cpu, server_cpu = time.process_time() - client_cpu, _cpu_seconds(pid) - server_cpu
    assert all(r["choices"][0]["message"]["content"] == "42" for r in results)
    return {"wall": wall, "client_cpu": client_cpu, "server_cpu": server_cpu}


async def run(
    latency: float = LATENCY,
    requests: int = REQUESTS,
    concurrencies: tuple[int, ...] = CONCURRENCIES,
) -> dict[str, float]:
    results: dict[str, float] = {}
    with fake_server(latency) as (url, process), separate_cpus(process.pid) as placement:
        rtt = await round_trip(url)
        await fan_out(url, process.pid, max(concurrencies), requests, warm=False)  # warm-up
        rows = [
            ("server latency L", f"{latency * 1000:.0f} ms"),
            ("placement", placement),
            ("baseline: one request at a time, median", f"{rtt * 1000:.2f} ms"),
            ("  overhead per request over L", f"{(rtt - latency) * 1000:.2f} ms"),
        ]
        for concurrency in concurrencies:
            ideal = requests * latency / concurrency
            # No client does better than a round trip per request per slot: the machine's
            # own overhead (loopback, wake-ups, the server) is in the baseline's round trip.
            floor = -(-requests // concurrency) * rtt
            rows.append((f"C={concurrency}: ideal N*L/C", f"{ideal * 1000:.0f} ms"))
            rows.append(
                (
                    f"C={concurrency}: floor here, rounds x baseline round trip",
                    f"{floor * 1000:.0f} ms ({floor / ideal:.3f}x the ideal)",
                )
            )
            for mode in ("cold", "warm"):
                runs = [
                    await fan_out(url, process.pid, concurrency, requests, warm=mode == "warm")
                    for _ in range(REPEAT)
                ]
                m = sorted(runs, key=lambda r: r["wall"])[len(runs) // 2]
                ratio = m["wall"] / ideal
                spread = ", ".join(f"{r['wall'] / ideal:.3f}" for r in runs)
                verdict = "met" if ratio <= GOAL else "NOT met"
                rows += [
                    (
                        f"C={concurrency} {mode}: wall, ratio",
                        f"{m['wall'] * 1000:.0f} ms, {ratio:.3f}x (goal <= {GOAL}: {verdict}; "
                        f"runs {spread})",
                    ),
                    (f"C={concurrency} {mode}: wall / floor here", f"{m['wall'] / floor:.3f}x"),
                    (
                        f"C={concurrency} {mode}: CPU per request, client / server",
                        f"{m['client_cpu'] / requests * 1000:.2f} / "
                        f"{m['server_cpu'] / requests * 1000:.2f} ms",
                    ),
                    (
                        f"C={concurrency} {mode}: client CPU needed at the ideal rate",
                        f"{m['client_cpu'] / requests * concurrency / latency:.2f} of one core",
                    ),
                ]
                key = f"ratio_c{concurrency}" if mode == "cold" else f"warm_ratio_c{concurrency}"
                results[key] = ratio
    report(
        f"fan-out: {requests} chat completions through SamplingClient, server latency "
        f"{latency * 1000:.0f} ms; ratio = wall / (N*L/C)",
        rows,
    )
    return results


if __name__ == "__main__":
    asyncio.run(run())
