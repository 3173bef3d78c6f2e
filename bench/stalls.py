"""Stalls: how fast `/healthz` answers while large bodies and attacks arrive.

One `trainyard serve` process (API only, keys on, SQLite) is asked for `/healthz` every
20 ms on connections of its own whether or not the last answer came (open loop); each
answer's latency counts from when it was due, so a stall of the server's event loop counts
for every request it held back. Three phases, each for as long as its load lasts:

- idle (the baseline, same process, same run): nothing else arrives, 3 s;
- large bodies: a 40 MB NAT collection (202) and 110,000 small groups (about 60 MB, 413);
- attacks: a 62 MB body without a key, a body and headers dripped a byte at a time,
  invalid UTF-8, 800 levels of nesting and a gzip-encoded body.

Figures per phase: p50, p99 and max latency (the max is the longest stall seen), and p99
against the idle p99. Goal: p99 <= 200 ms under large bodies and under attacks (README,
Security). The probe runs in a process of its own, so the sender of the bodies is not
what it waits for. The tests keep only stall detectors 10x above
these figures (tests/test_large_bodies.py, test_attacks.py, test_edge.py).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import multiprocessing
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from bench.common import dumps, nat_collection, report, server

INTERVAL = 0.02
GOAL = 0.2  # seconds, p99 of /healthz under large bodies and under attacks
KEY = "bench-stalls-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Probe:
    """`/healthz` every INTERVAL on its own connections; latency from when it was due."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self.failures: list[str] = []

    async def run(self, stop: threading.Event) -> None:
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[None]] = []
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            for _ in range(5):  # open connections before measuring
                await client.get("/healthz")

            async def one(due: float) -> None:
                try:
                    response = await client.get("/healthz")
                    if response.status_code != 200:
                        self.failures.append(str(response.status_code))
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self.latencies.append(loop.time() - due)

            due = loop.time()
            while not stop.is_set():
                while due <= loop.time():
                    tasks.append(asyncio.create_task(one(due)))
                    due += INTERVAL
                await asyncio.sleep(max(0.0, due - loop.time()))
            await asyncio.gather(*tasks)

    def figures(self) -> dict[str, float]:
        ordered = self.latencies
        return {
            "n": len(ordered),
            "p50": statistics.median(ordered),
            "p99": statistics.quantiles(ordered, n=100, method="inclusive")[98],
            "max": max(ordered),
        }


def _probe_main(url: str, stop: Any, started: Any, out: Any) -> None:
    """The probe, in a process of its own: the bodies' sender is not what it waits for."""
    probe = Probe(url)
    flag = threading.Event()

    def watch() -> None:
        stop.wait()
        flag.set()

    async def main() -> None:
        runner = asyncio.create_task(probe.run(flag))
        await asyncio.sleep(0.3)  # its connections are open
        started.set()
        await runner

    threading.Thread(target=watch, daemon=True).start()
    asyncio.run(main())
    out.send((probe.latencies, probe.failures))


def probed(url: str, load: Callable[[], None]) -> Probe:
    """Probe `url` from another process while `load` runs here."""
    context = multiprocessing.get_context("spawn")
    stop, started = context.Event(), context.Event()
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_probe_main, args=(url, stop, started, send))
    process.start()
    try:
        assert started.wait(120), "the probe did not start"
        load()
    finally:
        stop.set()
    probe = Probe(url)
    probe.latencies, probe.failures = receive.recv()
    process.join(60)
    assert not probe.failures, probe.failures[:5]
    return probe


def raw(port: int, data: bytes, *, drip: bytes = b"", pace: float = 0.05) -> bytes:
    """Send `data`, then `drip` a byte every `pace` seconds; return what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        try:
            for byte in drip:
                sock.sendall(bytes([byte]))
                time.sleep(pace)
        except OSError:
            pass  # the server cut it off: what the attack is for
        try:
            return sock.recv(65536)
        except OSError:
            return b""


def head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: bench", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def many_groups(groups: int = 110_000) -> bytes:
    choice = {
        "finish_reason": "stop",
        "index": 0,
        "message": {"role": "assistant", "content": "a"},
        "logprobs": {"content": [{"token": "token_id:1", "logprob": -0.5}]},
    }
    trajectories = [
        {"messages_and_choices": [{"role": "user", "content": "hi"}, choice], "reward": r}
        for r in (1.0, 0.0)
    ]
    group = json.dumps({"trajectories": trajectories})
    return ('{"model": "bench", "groups": [' + ", ".join([group] * groups) + "]}").encode()


def run(idle_seconds: float = 3.0) -> dict[str, float]:
    collection = dumps({"model": "bench", "collection": nat_collection(trajectories=1024)})
    groups = many_groups()
    unauthenticated = b'{"model": "bench", "groups": [' + b" " * (62 * 2**20) + b"]}"
    nested = b'{"model": "bench", "collection": ' + b"[" * 800 + b"]" * 800 + b"}"
    zipped = gzip.compress(b"{" + b" " * (64 * 2**20) + b"}")
    json_head = {"Content-Type": "application/json", **AUTH}

    with (
        tempfile.TemporaryDirectory() as data,
        server({"TRAINYARD_DATA_DIR": data, "TRAINYARD_API_KEYS": KEY}) as (url, _),
    ):
        port = int(url.rsplit(":", 1)[1])
        with httpx.Client(base_url=url, headers=AUTH, timeout=300) as client:
            created = client.post(
                "/v1/models", json={"name": "bench", "base_model": "b", "backend": "dry-run"}
            )
            assert created.status_code == 201, created.text

            def post(body: bytes, status: int, headers: dict[str, str] = json_head) -> None:
                response = client.post("/v1/training-jobs", content=body, headers=headers)
                assert response.status_code == status, response.text[:500]

            def large() -> None:
                post(collection, 202)
                post(groups, 413)

            def attacks() -> None:
                anonymous = httpx.post(
                    f"{url}/v1/training-jobs",
                    content=unauthenticated,
                    headers={"Content-Type": "application/json"},
                    timeout=300,
                )
                assert anonymous.status_code == 401, anonymous.text[:500]
                body = json.dumps({"name": "m"}).encode()
                drip_head = head("POST", "/v1/models", {"Content-Length": str(len(body)), **AUTH})
                raw(port, drip_head, drip=body, pace=0.1)  # a body that drips
                raw(port, b"", drip=b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 40, pace=0.05)
                gz = {**json_head, "Content-Encoding": "gzip"}
                for body, headers in [
                    (b'{"model": "bench\xff\xfe"}', json_head),
                    (nested, json_head),
                    (zipped, gz),
                ]:
                    response = client.post("/v1/training-jobs", content=body, headers=headers)
                    assert 400 <= response.status_code < 500, response.text[:500]

            phases = {
                "idle (baseline)": probed(url, lambda: time.sleep(idle_seconds)),
                "large bodies": probed(url, large),
                "attacks": probed(url, attacks),
            }
    idle = phases["idle (baseline)"].figures()
    rows: list[tuple[str, str]] = []
    results: dict[str, float] = {}
    for name, probe in phases.items():
        f = probe.figures()
        rows.append(
            (
                f"/healthz {name}",
                f"n={f['n']:.0f} p50 {f['p50'] * 1000:.0f} ms, p99 {f['p99'] * 1000:.0f} ms, "
                f"max (longest stall) {f['max'] * 1000:.0f} ms",
            )
        )
        if probe is not phases["idle (baseline)"]:
            key = name.replace(" ", "_")
            results[f"stalls_{key}_p99"] = f["p99"]
            ok = "met" if f["p99"] <= GOAL else "MISSED"
            rows.append(
                (
                    f"  p99 {name} / idle p99",
                    f"{f['p99'] / idle['p99']:.1f}x; p99 goal <= {GOAL * 1000:.0f} ms: {ok}",
                )
            )
    report("stalls: /healthz every 20 ms (open loop) under large bodies and attacks", rows)
    return results


if __name__ == "__main__":
    run()
