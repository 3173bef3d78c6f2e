"""Every attack of the hardening work against one real `trainyard serve` process, keys on,
with `/healthz` probed from another connection all along: it answers within 200 ms at the
99th percentile, the server's RSS stays within ATTACK_RSS_BOUND of its idle size, and no
request is answered or logged as a server error."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.settings import Settings
from tests.hostile import RawServer, Seen, answer, gzip_bomb, head
from tests.processes import PATIENCE, free_port, pieces, start_api, stop, until, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.any_database, pytest.mark.torch]

KEY = "attack-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MiB = 1 << 20
# A stall detector, not the goal: p99 was 22-93 ms inside the full suite; the 200 ms goal
# (README, Security) is measured by `python -m bench.stalls`. On a loaded machine every
# process answers late: the bound grows by CONTROL_FACTOR times the p99 of a control, a
# trivial server in a process of its own probed the same way at the same time (the stress
# run, README, had the server's p99 past 2 s with the machine at load 15 on 2 cores).
P99_BOUND = 2.0
CONTROL_FACTOR = 10
CONTROL = """
import asyncio, sys

async def answer(reader, writer):
    try:
        while True:
            await reader.readuntil(b"\\r\\n\\r\\n")
            writer.write(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\nok")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()

async def main():
    server = await asyncio.start_server(answer, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""
ATTACK_RSS_BOUND = 512 * MiB  # over the server's idle RSS, stated in the README
EXAMPLE = {"id": "q1", "messages": [{"role": "user", "content": "say yes"}], "expected": "yes"}


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def _answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            return (await client.get(f"{url}/healthz")).status_code == 200
    except httpx.TransportError:
        return False


class Probe:
    """`/healthz` every 50 ms on its own connection, and the server's RSS (`pid`; None:
    the control's, not read)."""

    def __init__(self, url: str, pid: int | None) -> None:
        self.url, self.pid = url, pid
        self.latencies: list[float] = []
        self.rss: list[int] = []
        self.failures: list[str] = []

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    response = await client.get("/healthz")
                    if response.status_code != 200:
                        self.failures.append(f"healthz {response.status_code}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"healthz {type(exc).__name__}")
                self.latencies.append(time.perf_counter() - start)
                if self.pid is not None:
                    self.rss.append(_rss(self.pid))
                await asyncio.sleep(0.05)

    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def _finished(
    client: httpx.AsyncClient, url: str, timeout: float = PATIENCE
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = (await client.get(url)).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        assert time.monotonic() < deadline, job
        await asyncio.sleep(0.1)


async def _raw(port: int, data: bytes, *, drip: bytes = b"", pace: float = 1.0) -> bytes:
    """Send `data`, then `drip` a byte every `pace` seconds; return what the server said
    before it closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        for byte in drip:
            if reader.at_eof():
                break
            writer.write(bytes([byte]))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(reader.read(4096), pace)
        return await asyncio.wait_for(reader.read(4096), 10)
    finally:
        writer.close()


async def _drip_answer(_seen: Seen, writer: asyncio.StreamWriter) -> None:
    writer.write(head(200, ("content-type", "application/json"), ("content-length", "100")))
    for _ in range(100):
        writer.write(b" ")
        await writer.drain()
        await asyncio.sleep(0.25)


@pytest.fixture
async def server(make_settings, tmp_path) -> AsyncIterator[tuple[str, int, Path]]:
    from app.backends.tiny_model import make_tiny_model

    settings: Settings = make_settings()
    make_tiny_model(settings.data_dir / "tiny")
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as output:
        process = start_api(
            settings,
            port,
            output=output,
            TRAINYARD_API_KEYS=KEY,
            TRAINYARD_LOG_LEVEL="info",
            TRAINYARD_BODY_TIMEOUT_SECONDS="2",
            TRAINYARD_HEADER_TIMEOUT_SECONDS="2",
            TRAINYARD_AGENT_MAX_RESPONSE_BYTES=str(8 * MiB),
            TRAINYARD_LEASE_SECONDS="60",  # no lease lapses on a loaded machine
            TRAINYARD_HEARTBEAT_SECONDS="1",
        )
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_ready(url, [process])
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as client:
                created = await client.post(
                    "/v1/models",
                    json={
                        "name": "toy",
                        "base_model": str(settings.data_dir / "tiny"),
                        "backend": "cpu",
                    },
                )
                assert created.status_code == 201, created.text
                for _ in range(200):
                    if (await client.get("/readyz")).status_code == 200:
                        break
                    await asyncio.sleep(0.1)
            yield url, process.pid, log
        finally:
            stop(process)


Attack = Callable[[httpx.AsyncClient, str, int], Awaitable[None]]


async def unauthenticated_large_body(client: httpx.AsyncClient, url: str, port: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as anonymous:
        big = await anonymous.post("/v1/training-jobs", content=b"x" * (62 * MiB))
        malformed = await anonymous.post("/v1/training-jobs", content=b"{not json")
    assert (big.status_code, malformed.status_code) == (401, 401)


async def slow_body(client: httpx.AsyncClient, url: str, port: int) -> None:
    request = (
        f"POST /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
        "content-type: application/json\r\ncontent-length: 100\r\n\r\n"
    ).encode()
    said = await _raw(port, request, drip=b"{" * 10)
    assert said.startswith(b"HTTP/1.1 408"), said[:80]


async def slow_headers(client: httpx.AsyncClient, url: str, port: int) -> None:
    said = await _raw(port, b"GET /v1/models HTTP/1.1\r\n", drip=b"x-slow: " + b"a" * 8)
    assert said == b"" or said.startswith(b"HTTP/1.1 408"), said[:80]


async def catastrophic_regex(client: httpx.AsyncClient, url: str, port: int) -> None:
    grader = {"type": "regex", "pattern": "^(.?){26}.{26}$"}
    body = {"model": "toy", "examples": [EXAMPLE], "num_generations": 8, "grader": grader}
    response = await client.post("/v1/rollout-jobs", json=body)
    assert response.status_code == 202, response.text
    job = await _finished(client, response.headers["location"])
    assert job["status"] == "succeeded", job


async def agent_gzip_bomb(client: httpx.AsyncClient, url: str, port: int) -> None:
    served = answer(
        gzip_bomb(1 << 30), 200, ("content-encoding", "gzip"), ("content-type", "application/json")
    )
    async with RawServer(served) as agent:
        body = {"model": "toy", "examples": [EXAMPLE], "num_generations": 4}
        response = await client.post(
            "/v1/rollout-jobs", json={**body, "agent": {"url": agent.url("/episode")}}
        )
        assert response.status_code == 202, response.text
        job = await _finished(client, response.headers["location"])
    assert job["status"] == "failed", job
    assert all("more than" in error for error in job["summary"]["errors"]), job


async def agent_drip(client: httpx.AsyncClient, url: str, port: int) -> None:
    async with RawServer(_drip_answer) as agent:
        body = {"model": "toy", "examples": [EXAMPLE], "num_generations": 2}
        agent_spec = {"url": agent.url(), "timeout_s": 1}
        start = time.monotonic()
        response = await client.post("/v1/rollout-jobs", json={**body, "agent": agent_spec})
        assert response.status_code == 202, response.text
        job = await _finished(client, response.headers["location"])
    # Cut at the 1 s timeout per generation, not the 25 s drip: 10x the typical ~2 s.
    assert time.monotonic() - start < 20
    assert all("timed out" in error for error in job["summary"]["errors"]), job


async def invalid_unicode(client: httpx.AsyncClient, url: str, port: int) -> None:
    bodies = [
        (
            "/v1/models",
            b'{"name": "s1", "backend": "dry-run", "base_model": "b", '
            b'"config": {"fail_with": "\\ud800"}}',
        ),
        ("/v1/models", b'{"name": "s2", "backend": "dry-run", "base_model": "\\udfff x"}'),
        ("/v1/training-jobs", b'{"model": "toy", "groups": [], "metadata": {"\\ud83d": 1}}'),
        (
            "/v1/rollout-jobs",
            b'{"model": "toy", "examples": [{"id": "\\udc00", "messages": '
            b'[{"role": "user", "content": "hi"}]}], "grader": {"type": "exact_match"}}',
        ),
    ]
    for path, raw in bodies:
        response = await client.post(
            path, content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == 422, (path, response.text)
    for page in ("/v1/models", "/v1/training-jobs", "/v1/rollout-jobs"):
        assert (await client.get(page)).status_code == 200


async def encodings_and_depth(client: httpx.AsyncClient, url: str, port: int) -> None:
    body = json.dumps({"name": "enc", "backend": "dry-run", "base_model": "b"})
    deep = '{"name": "deep", "backend": "dry-run", "base_model": "b", "config": '
    deep += '{"a": ' * 800 + "1" + "}" * 800 + "}"
    for raw in (
        b"\xef\xbb\xbf" + body.encode(),
        body.encode("utf-16"),
        deep.encode(),
    ):
        response = await client.post(
            "/v1/models", content=raw, headers={"content-type": "application/json"}
        )
        assert 400 <= response.status_code < 500, response.text
    names = [m["name"] for m in (await client.get("/v1/models")).json()["data"]]
    assert "enc" not in names and "deep" not in names


@functools.cache
def large_legal_text() -> bytes:
    """The large legal body, built before the probe starts: built while it runs, the test
    process's own work (a 24 MB `json.dumps`) counted against a /healthz answer in flight."""
    step = {
        "role": "assistant",
        "content": "ok",
        "metadata": None,
        "logprobs": {
            "content": [{"token": "token_id:5", "logprob": -0.1, "bytes": None, "top_logprobs": []}]
        },
    }
    trajectory = {
        "episode": [{"role": "user", "content": "hi", "logprobs": None, "metadata": None}, step],
        "reward": 1.0,
        "shaped_rewards": None,
        "metadata": None,
    }
    groups = [[trajectory, {**trajectory, "reward": 0.0}]] * 40_000
    body = json.dumps({"model": "toy", "collection": {"trajectories": groups, "run_id": "big"}})
    return body.encode()


async def large_legal_body(client: httpx.AsyncClient, url: str, port: int) -> None:
    body = large_legal_text()
    assert len(body) > 20 * MiB
    response = await client.post(
        "/v1/training-jobs",
        content=pieces(body),  # streamed, as a client sends a file
        headers={"content-type": "application/json", "content-length": str(len(body))},
    )
    assert response.status_code in (202, 413, 422), response.text[:300]


ATTACKS: list[Attack] = [
    unauthenticated_large_body,
    slow_body,
    slow_headers,
    catastrophic_regex,
    agent_gzip_bomb,
    agent_drip,
    invalid_unicode,
    encodings_and_depth,
    large_legal_body,
]


@pytest.fixture
def control() -> Iterator[str]:
    """The control: a trivial HTTP server in a process of its own; its URL."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", CONTROL, str(port)])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


async def test_the_service_rides_out_every_attack(server, control, figure) -> None:
    url, pid, log = server
    port = int(url.rsplit(":", 1)[1])
    idle = _rss(pid)
    large_legal_text()  # built before probing: this process's work is not the server's
    await until(lambda: _answers(control), what="the control server")
    probe, beside = Probe(url, pid), Probe(control, None)
    done = asyncio.Event()
    probers = [asyncio.create_task(p.run(done)) for p in (probe, beside)]
    try:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:
            for attack in ATTACKS:
                await asyncio.wait_for(attack(client, url, port), PATIENCE)
    finally:
        done.set()
        await asyncio.gather(*probers)
    figure(
        f"{len(probe.latencies)} probes, healthz p99 {probe.p99() * 1000:.1f} ms, "
        f"max {max(probe.latencies) * 1000:.1f} ms; RSS idle {idle / MiB:.0f} MiB, "
        f"peak {max(probe.rss) / MiB:.0f} MiB; control p99 {beside.p99() * 1000:.1f} ms"
    )
    assert probe.failures == []
    assert len(probe.latencies) > 50
    # Inside the full suite this missed 200 ms (208-317 ms) until full collections stopped
    # walking what the test process and the server's training stack hold (conftest.py,
    # app/process.py): the probe's client runs in the test process.
    bound = P99_BOUND + CONTROL_FACTOR * beside.p99()
    assert probe.p99() < bound, (probe.p99(), max(probe.latencies), beside.p99())
    assert max(probe.rss) - idle < ATTACK_RSS_BOUND, (idle, max(probe.rss))
    logged = log.read_text(errors="replace")
    # 503 from /readyz while the model loads is readiness, not an error.
    errors = [
        line
        for line in logged.splitlines()
        if re.search(r'HTTP/1\.[01]" 5\d\d', line) and "/readyz" not in line
    ]
    assert errors == [], errors
    assert "Traceback" not in logged, logged[-3000:]
