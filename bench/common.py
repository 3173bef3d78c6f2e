"""Helpers shared by the benchmarks: payloads, a server subprocess, timing, memory."""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

TRAINYARD = str(Path(sys.executable).parent / "trainyard")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nat_collection(
    trajectories: int = 512, group_size: int = 8, tokens_per_turn: int = 130, seed: int = 0
) -> dict[str, Any]:
    """A NAT TrajectoryCollection shaped like a LangChain agent against ART's vLLM."""
    rng = random.Random(seed)

    def logprobs() -> dict[str, Any]:
        content = []
        for _ in range(tokens_per_turn):
            token = f"token_id:{rng.randrange(151_000)}"
            logprob = -rng.random() * 3
            entry = {
                "token": token,
                "bytes": [rng.randrange(32, 127) for _ in range(4)],
                "logprob": logprob,
            }
            content.append({**entry, "top_logprobs": [dict(entry)]})
        return {"content": content, "refusal": None}

    def item(role: str, content: str, lp: Any = None, metadata: Any = None) -> dict[str, Any]:
        return {"role": role, "content": content, "logprobs": lp, "metadata": metadata}

    groups = []
    for g in range(trajectories // group_size):
        group = []
        for n in range(group_size):
            call = {
                "id": f"call_{g}_{n}",
                "type": "function",
                "function": {"name": "search", "arguments": '{"q": "weather"}'},
            }
            group.append(
                {
                    "episode": [
                        item("system", "You are a helpful agent with a search tool."),
                        item("user", f"Question {g}: what is the weather in city {g}?"),
                        item("assistant", "Let me search.", logprobs(), {"tool_calls": [call]}),
                        item("tool", "Sunny, 21 degrees.", None, {"tool_call_id": call["id"]}),
                        item("assistant", "It is sunny and 21 degrees." * 3, logprobs()),
                    ],
                    "reward": rng.random(),
                    "shaped_rewards": None,
                    "metadata": {"id": g, "generation": n, "run_id": "bench"},
                }
            )
        groups.append(group)
    return {"trajectories": groups, "run_id": "bench"}


def median_seconds(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_rss_mib(pid: int) -> float:
    """Peak resident memory of a process (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextmanager
def server(env: dict[str, str], *, worker: bool = False) -> Iterator[tuple[str, subprocess.Popen]]:
    """`trainyard serve` in its own process on a free loopback port."""
    port = free_port()
    environ = {
        **os.environ,
        **env,
        "TRAINYARD_WORKER_ENABLED": str(worker).lower(),
        "TRAINYARD_LOG_LEVEL": "warning",
    }
    process = subprocess.Popen([TRAINYARD, "serve", "--port", str(port)], env=environ)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.1)
        yield url, process
    finally:
        process.terminate()
        process.wait(30)


def report(name: str, rows: list[tuple[str, str]]) -> None:
    print(f"\n## {name}")
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key.ljust(width)}  {value}")


def dumps(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()
