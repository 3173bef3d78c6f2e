"""Large legal bodies do not stall the service: while one is read, checked and stored,
`/healthz` keeps answering another connection. The test is a stall detector (p99 under 5 s:
over 10x the p99 measured with a suite beside it, which reached 2-3.7 s at load 15 on two
cores); the goal, p99 within 200 ms, is measured by `python -m bench.stalls`.

The service is a `trainyard serve` process of its own (API only), as it runs deployed: the
test process sends the body and probes, and its own pauses do not fall on the server's
figures. `/healthz` is asked every 20 ms whether or not the last answer came (open loop);
each answer's latency counts from when it was due, so a stall of the event loop counts for
every request it held back, not just one. The body is sent at once, over real HTTP.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import statistics
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.settings import Settings
from app.training import spec as training_spec
from tests import factories as f
from tests.processes import free_port, pieces, start_api, stop, wait_ready
from tests.test_hostile_bodies import JSON, stored_payload

pytestmark = pytest.mark.any_database

INTERVAL = 0.02
# A stall detector, not the goal: p99 was 20-135 ms with a suite beside it (2.0-3.7 s at
# load 15 on two cores); reading a body on the event loop held /healthz for seconds. The
# 200 ms goal: `python -m bench.stalls`.
P99 = 5.0


def training_body(groups: int) -> dict[str, Any]:
    """`groups` groups of two trajectories, each answer 40 tokens with one alternative
    each: about 12 KB a group, well within the default limits."""
    body = {"model": "agent", "groups": f.art_groups([[1.0, 0.0]] * groups)}
    for g, group in enumerate(body["groups"]):
        for t, trajectory in enumerate(group["trajectories"]):
            trajectory["messages_and_choices"][1] = f.art_choice(
                f"answer {g} {t}", [(g * 7 + t + i) % 50_000 for i in range(40)]
            )
    return body


def nat_body(groups: int) -> dict[str, Any]:
    collection = f.nat_collection([[1.0, 0.0]] * groups)
    for g, group in enumerate(collection["trajectories"]):
        for trajectory in group:
            trajectory["episode"][-1]["logprobs"] = f.logprobs(
                [(g + i) % 50_000 for i in range(40)]
            )
    return {"model": "agent", "collection": collection}


def broken_body(groups: int) -> dict[str, Any]:
    body = training_body(groups)
    for group in body["groups"]:
        for trajectory in group["trajectories"]:
            trajectory["reward"] = "high"
    return body


def rollout_body(examples: int) -> dict[str, Any]:
    text = "lorem ipsum dolor sit amet " * 9
    turns = [{"role": ("user", "assistant")[k % 2], "content": f"{k} {text}"} for k in range(19)]
    return {
        "model": "toy",
        "examples": [
            {"id": i, "messages": [*turns, {"role": "user", "content": str(i)}], "expected": "x"}
            for i in range(examples)
        ],
        "grader": {"type": "exact_match"},
    }


def run_body(examples: int) -> dict[str, Any]:
    """A run's most inline examples, each as large as a rollout example above."""
    rollout = rollout_body(examples)
    return {
        "model": "toy",
        "examples": rollout["examples"],
        "recipe": {"num_generations": 2, "grader": {"type": "exact_match"}},
        "schedule": {"max_steps": 1},
    }


def dataset_lines(examples: int) -> bytes:
    return "\n".join(json.dumps(e) for e in rollout_body(examples)["examples"]).encode()


def text(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


class Probe:
    """Asks `/healthz` every INTERVAL seconds on connections of its own."""

    def __init__(self, url: str) -> None:
        self.client = httpx.AsyncClient(base_url=url, timeout=60)
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _one(self, due: float) -> None:
        try:
            response = await self.client.get("/healthz")
            if response.status_code != 200:
                self.failures.append(response.text)
        except httpx.HTTPError as exc:
            self.failures.append(repr(exc))
        self.latencies.append(asyncio.get_running_loop().time() - due)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while not self._stop.is_set():
            while due <= loop.time():  # every request due by now, late ones included
                self._tasks.append(asyncio.create_task(self._one(due)))
                due += INTERVAL
            await asyncio.sleep(max(0.0, due - loop.time()))

    async def __aenter__(self) -> Probe:
        for _ in range(5):  # open connections before measuring
            await self.client.get("/healthz")
        self._runner = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await self._runner
        await asyncio.gather(*self._tasks)
        await self.client.aclose()

    def p99(self) -> float:
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[98]


def many_groups_text(groups: int) -> bytes:
    """The attack the issue names: 110,000 small groups (about 60 MB), as JSON text."""
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
    return ('{"model": "agent", "groups": [' + ", ".join([group] * groups) + "]}").encode()


CASES = {
    "110,000 small groups": ("/v1/training-jobs", lambda: many_groups_text(110_000), 413),
    "ART groups": ("/v1/training-jobs", lambda: training_body(3000), 202),
    "NAT collection": ("/v1/training-jobs", lambda: nat_body(3000), 202),
    "every reward wrong": ("/v1/training-jobs", lambda: broken_body(3000), 422),
    "rollout examples": ("/v1/rollout-jobs", lambda: rollout_body(6000), 202),
    "run examples": ("/v1/runs", lambda: run_body(10_000), 202),
    "dataset lines": ("/v1/datasets?name=big", lambda: dataset_lines(10_000), 201),
}


class Served:
    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log = log
        self.client = httpx.AsyncClient(base_url=url, timeout=30)


@pytest.fixture
async def served(make_settings, tmp_path) -> AsyncIterator[Served]:
    """`trainyard serve` without a worker, with `agent` (dry-run) and `toy` (cpu, served:
    rollouts and runs can name it; nothing loads it)."""
    settings: Settings = make_settings()
    base = Path(settings.data_dir).resolve() / "toy-base"
    base.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as output:
        process = start_api(
            settings,
            port,
            output=output,
            TRAINYARD_WORKER_ENABLED="false",
            TRAINYARD_LOG_LEVEL="info",
        )
        try:
            server = Served(f"http://127.0.0.1:{port}", log)
            await wait_ready(server.url, [process])
            async with server.client:
                await f.create_model(server.client)
                toy = {"name": "toy", "base_model": str(base), "backend": "cpu"}
                created = await server.client.post("/v1/models", json=toy)
                assert created.status_code == 201, created.text
                yield server
        finally:
            stop(process)


@pytest.mark.parametrize("name", list(CASES))
async def test_healthz_keeps_answering_while_a_large_body_is_read(
    served, database_url, name, figure
) -> None:
    url, build, status = CASES[name]
    raw = text(build())
    gc.collect()  # the client runs in this process: it keeps nothing of the body
    assert len(raw) > 30_000_000, len(raw)
    async with Probe(served.url) as probe:
        started = asyncio.get_running_loop().time()
        headers = {"Content-Type": "application/jsonl"} if "datasets" in url else JSON
        headers = {**headers, "Content-Length": str(len(raw))}
        response = await served.client.post(url, content=pieces(raw), headers=headers, timeout=300)
        took = asyncio.get_running_loop().time() - started
    # Checked once the probe has stopped: decoding what was stored takes this process over
    # 2 s, which the probe would count against a /healthz answer in flight meanwhile.
    assert response.status_code == status, response.text[:2000]
    if status == 413:  # not the body limit: a limit on what a job holds, after parsing
        assert response.json()["type"] == "urn:trainyard:problem:limit-exceeded"
    if status == 202 and url == "/v1/training-jobs":
        payload = await stored_payload(database_url, response.json()["id"])
        stored = training_spec.stored_groups(payload)
        assert len(stored) == response.json()["summary"]["num_groups"]
    figure(
        f"{len(raw) / 1e6:.0f} MB answered {status} in {took:.1f} s; /healthz "
        f"n={len(probe.latencies)} p50={statistics.median(probe.latencies) * 1000:.0f} ms "
        f"p99={probe.p99() * 1000:.0f} ms max={max(probe.latencies) * 1000:.0f} ms"
    )
    assert probe.failures == []
    assert len(probe.latencies) >= 10
    assert probe.p99() <= P99, f"/healthz p99 {probe.p99():.3f}s, max {max(probe.latencies):.3f}s"
    logged = served.log.read_text(errors="replace")
    assert not re.search(r'HTTP/1\.[01]" 5\d\d', logged), logged[-3000:]
    assert "Traceback" not in logged, logged[-3000:]
