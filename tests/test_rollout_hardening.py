"""Rollout jobs as an attacker submits them, through the live service: catastrophic regular
expressions, agents and graders that bomb, drip, redirect or echo, URLs aimed at what the
egress policy refuses, agents that answer untrainable trajectories, and secrets in headers
that no route may show.

The model is the dry-run trainer standing in for the `cpu` backend, served from a scripted
OpenAI-compatible endpoint on loopback (no weights needed); agents and graders are little
services on loopback too. Tests run the service with a 2 s lease (a stalled event loop shows
as a lapsed lease at once).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from sqlalchemy import select, update

from app.backends.dry_run import DryRunBackend
from app.db import create_engine
from app.jobs.payloads import Payload
from app.models import JobRow
from app.rollouts import spec as rollout_spec
from tests import factories
from tests.conftest import LiveServer
from tests.hostile import RawServer, Seen, answer, gzip_bomb, head
from tests.processes import PATIENCE
from tests.test_egress import MiB, rss

SECRET = "s3cr3t-7c0ffee-header"
# A stall detector, not a timing: before these fixes the same attacks held the event loop
# for 4 s (a 1 GiB gzip answer) to 8 s (the regex); the slowest /healthz is typically a
# tenth of a second or less, and a busy machine adds tenths. How fast it answers is
# measured by `python -m bench.stalls`.
STALL = 3.0
EXAMPLE = {"id": "q1", "messages": [{"role": "user", "content": "say yes"}], "expected": "yes"}


class ServedDryRun(DryRunBackend):
    """The dry-run trainer, whose models are served at `base_url`."""

    def __init__(self, path: Path, base_url: str) -> None:
        super().__init__(path)
        self.base_url = base_url

    async def _prepare_backend_for_training(
        self, model: Any, config: Any = None
    ) -> tuple[str, str]:
        return self.base_url, "sampler-key"


class Endpoint:
    """A chat-completions endpoint whose choices' contents are `contents` (cycled), with
    logprobs unless `without_logprobs` names the choice index."""

    def __init__(self) -> None:
        self.contents: list[str] = ["yes", "no"]
        self.without_logprobs: set[int] = set()
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def completions(request: Request) -> dict[str, Any]:
            body = await request.json()
            choices = []
            for i in range(int(body.get("n", 1))):
                choice = factories.art_choice(self.contents[i % len(self.contents)], [19 + i])
                choice["index"] = i
                if i in self.without_logprobs:
                    choice["logprobs"] = None
                choices.append(choice)
            return {"id": "c", "object": "chat.completion", "choices": choices}

        self.live = LiveServer(app)


@asynccontextmanager
async def service(
    serve: Callable[..., LiveServer], tmp_path: Path, **settings: Any
) -> AsyncIterator[tuple[LiveServer, Endpoint]]:
    endpoint = Endpoint()
    async with endpoint.live:
        backend = ServedDryRun(tmp_path / "served", f"{endpoint.live.url}/v1")
        async with serve(
            worker_enabled=True, backend_overrides={"cpu": backend}, **settings
        ) as live:
            base = tmp_path / "data" / "toy"  # a cpu model's base lies under the model roots
            base.mkdir(parents=True, exist_ok=True)
            body = {**factories.model_body("toy", backend="cpu"), "base_model": str(base)}
            created = await live.client.post("/v1/models", json=body)
            assert created.status_code == 201, created.text
            yield live, endpoint


async def submit(live: LiveServer, **body: Any) -> httpx.Response:
    payload = {"model": "toy", "examples": [EXAMPLE], "num_generations": 2, **body}
    return await live.client.post("/v1/rollout-jobs", json=payload)


async def finished(live: LiveServer, job_id: str, timeout: float = PATIENCE) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = (await live.client.get(f"/v1/rollout-jobs/{job_id}")).json()
        if job["status"] in {"succeeded", "failed", "cancelled"}:
            return job
        assert time.monotonic() < deadline, job
        await asyncio.sleep(0.05)


async def run(live: LiveServer, **body: Any) -> dict[str, Any]:
    response = await submit(live, **body)
    assert response.status_code == 202, response.text
    return await finished(live, response.json()["id"])


async def event_types(live: LiveServer, job_id: str) -> list[str]:
    events = (await live.client.get(f"/v1/rollout-jobs/{job_id}/events?limit=100")).json()
    return [e["type"] for e in events["data"]]


@asynccontextmanager
async def probing(live: LiveServer) -> AsyncIterator[dict[str, float]]:
    """GETs /healthz every 20 ms on its own connection: `worst` is the slowest answer, in
    seconds; `rss` the largest growth of this process's memory (the service runs here)."""
    seen = {"worst": 0.0, "rss": 0.0, "probes": 0}
    base = rss()

    async def probe(client: httpx.AsyncClient) -> None:
        while True:
            start = time.monotonic()
            assert (await client.get("/healthz")).status_code == 200
            seen["worst"] = max(seen["worst"], time.monotonic() - start)
            seen["rss"] = max(seen["rss"], rss() - base)
            seen["probes"] += 1
            await asyncio.sleep(0.02)

    async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
        task = asyncio.create_task(probe(client))
        try:
            yield seen
        finally:
            task.cancel()


def art_answer(reward: float = 1.0, **trajectory: Any) -> dict[str, Any]:
    return {
        "trajectory": {
            "messages_and_choices": [
                {"role": "user", "content": "say yes"},
                factories.art_choice("yes", [5, 6]),
            ],
            **trajectory,
        },
        "reward": reward,
    }


# -- 1. regular expressions ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "content"),
    [
        (r"^(.?){26}.{26}$", "a" * 26),  # held /healthz 8 s with Python's re
        (r"^(.?){30}.{30}$", "a" * 30),  # 16x that
        (r"(a+)+$", "a" * 40 + "!"),
        (r"(\w+\s?)*$", "word " * 30 + "!"),
    ],
)
async def test_a_catastrophic_regex_grades_in_linear_time_and_the_service_keeps_serving(
    serve: Any, tmp_path: Path, pattern: str, content: str, figure: Any
) -> None:
    async with service(serve, tmp_path) as (live, endpoint):
        endpoint.contents = [content, "b"]
        async with probing(live) as probe:
            job = await run(live, num_generations=4, grader={"type": "regex", "pattern": pattern})
        types = await event_types(live, job["id"])
    assert job["status"] == "succeeded", job["error"]
    assert job["summary"]["num_graded"] == 4 and job["attempts"] == 1
    assert "job_retrying" not in types
    figure(f"slowest /healthz {probe['worst'] * 1000:.0f} ms over {probe['probes']} probes")
    assert probe["worst"] < STALL, probe


@pytest.mark.parametrize(
    "pattern",
    [r"(a)\1", r"(?=yes)y", r"(?<!n)o", r"(?>a+)", r"a++", r"a{1001}", r"(.*a){1000}"],
)
async def test_a_pattern_re2_cannot_run_is_refused_at_submission(
    serve: Any, tmp_path: Path, pattern: str
) -> None:
    async with service(serve, tmp_path) as (live, _):
        response = await submit(live, grader={"type": "regex", "pattern": pattern})
        listed = (await live.client.get("/v1/rollout-jobs")).json()
    assert response.status_code == 422, response.text
    (error,) = response.json()["errors"]
    assert error["path"].startswith("grader.") and error["path"].endswith(".pattern"), error
    assert "RE2" in error["message"]
    assert listed["data"] == []


# -- 2. answers: bombs, drips, redirects -----------------------------------------------------


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return gzip_bomb(1 << 30)


async def drip(_seen: Seen, writer: asyncio.StreamWriter) -> None:
    writer.write(head(200, ("content-type", "application/json"), ("content-length", "100")))
    for _ in range(100):
        writer.write(b" ")
        await writer.drain()
        await asyncio.sleep(0.25)


async def test_an_agent_gzip_bomb_is_cut_at_the_limit(
    serve: Any, tmp_path: Path, bomb: bytes
) -> None:
    served = answer(bomb, 200, ("content-encoding", "gzip"), ("content-type", "application/json"))
    async with (
        RawServer(served) as agent,
        service(serve, tmp_path, agent_max_response_bytes=8 * MiB) as (live, _),
        probing(live) as probe,
    ):
        job = await run(live, agent={"url": agent.url("/episode")}, num_generations=4)
    assert job["status"] == "failed" and job["error"]["type"] == "NothingCollected"
    assert job["summary"]["errors"] == [
        f"example q1 generation {g}: agent answered more than {8 * MiB} bytes" for g in range(4)
    ]
    assert len(agent.seen) == 4
    assert probe["rss"] < 200 * MiB, probe  # four answers at once; each stops at 8 MiB
    assert probe["worst"] < STALL, probe


async def test_an_agent_that_drips_is_cut_at_its_total_timeout(serve: Any, tmp_path: Path) -> None:
    async with RawServer(drip) as agent, service(serve, tmp_path) as (live, _):
        start = time.monotonic()
        async with probing(live) as probe:
            job = await run(live, agent={"url": agent.url(), "timeout_s": 1})
        elapsed = time.monotonic() - start
    assert job["summary"]["errors"] == [
        f"example q1 generation {g}: agent timed out after 1 s" for g in range(2)
    ]
    # Each byte came in well under the timeout, for 25 s: a per-read timeout waits it out.
    assert elapsed < 20, elapsed
    assert probe["worst"] < STALL, probe


@pytest.mark.parametrize(
    ("respond", "error"),
    [
        (answer(f"Traceback (most recent call last): {SECRET}".encode(), 500), "HTTP 500 (56"),
        (answer(f"<html>{SECRET}</html>".encode()), "HTTP 200 with a body that is not JSON ("),
        (answer(json.dumps({"secret": SECRET}).encode()), 'without {"trajectory"'),
        (answer(b"", 302, ("location", f"http://127.0.0.1:9/{SECRET}")), "redirects are not"),
        (answer(b"", 200, ("x-bad header", SECRET)), "agent request failed: RemoteProtocolError"),
    ],
)
async def test_agent_errors_say_status_and_length_never_the_body(
    serve: Any, tmp_path: Path, respond: Any, error: str
) -> None:
    async with RawServer(respond) as agent, service(serve, tmp_path) as (live, _):
        job = await run(live, agent={"url": agent.url()})
        everything = json.dumps(job) + json.dumps(
            (await live.client.get(f"/v1/rollout-jobs/{job['id']}/events")).json()
        )
    assert job["status"] == "failed", job
    assert all(error in e for e in job["summary"]["errors"]), job["summary"]["errors"]
    assert SECRET not in everything


async def test_webhook_grader_errors_say_status_and_length_never_the_body(
    serve: Any, tmp_path: Path
) -> None:
    body = f"KeyError: {SECRET}".encode()
    grader = answer(body, 500)
    async with RawServer(grader) as hook, service(serve, tmp_path) as (live, _):
        job = await run(live, grader={"type": "webhook", "url": hook.url()})
    assert job["summary"]["errors"] == [
        f"example q1 generation {g}: webhook grader answered HTTP 500 ({len(body)} bytes)"
        for g in range(2)
    ]
    assert SECRET not in json.dumps(job)


# -- 3. the egress policy --------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "169.254.169.254",
        "2852039166",  # the same, as one number
        "0xa9.0xfe.0xa9.0xfe",
        "[::ffff:169.254.169.254]",
        "[fe80::1]",
        "0.0.0.0",
        "0",
        "[::]",
        "224.0.0.1",
        "255.255.255.255",
        "100.64.0.1",
        "[64:ff9b::a9fe:a9fe]",
    ],
)
async def test_a_special_use_address_is_refused_at_submission(
    serve: Any, tmp_path: Path, host: str
) -> None:
    async with service(serve, tmp_path) as (live, _):
        agent = await submit(live, agent={"url": f"http://{host}/latest/meta-data/"})
        hook = await submit(live, grader={"type": "webhook", "url": f"https://{host}:8443/g"})
        listed = (await live.client.get("/v1/rollout-jobs")).json()
    for response, path in ((agent, "agent.url"), (hook, "grader.webhook.url")):
        assert response.status_code == 422, response.text
        (error,) = response.json()["errors"]
        assert error["path"] == path and error["type"] == "egress", error
        assert "refused by the egress policy" in error["message"]
    assert listed["data"] == []


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1", "[::1]", "[::ffff:127.0.0.1]"])
async def test_an_operator_who_denies_loopback_gets_422_for_its_addresses(
    serve: Any, tmp_path: Path, host: str
) -> None:
    async with service(serve, tmp_path, egress_deny=["loopback"]) as (live, _):
        response = await submit(live, agent={"url": f"http://{host}:8000/episode"})
    assert response.status_code == 422
    assert response.json()["errors"][0]["path"] == "agent.url"


async def test_credentials_in_a_url_are_refused(serve: Any, tmp_path: Path) -> None:
    async with service(serve, tmp_path) as (live, _):
        agent = await submit(live, agent={"url": f"http://user:{SECRET}@127.0.0.1:9/"})
        hook = await submit(live, grader={"type": "webhook", "url": f"http://{SECRET}@x.test/"})
    for response in (agent, hook):
        assert response.status_code == 422
        assert "send them in `headers`" in response.text and SECRET not in response.text


async def test_port_0_in_an_outbound_url_is_refused(serve: Any, tmp_path: Path) -> None:
    """Every outbound URL a request names (agents, webhook graders; webhook endpoints in
    test_webhooks) refuses port 0: nothing listens there."""
    async with service(serve, tmp_path) as (live, _):
        agent = await submit(live, agent={"url": "http://agent.example:0/episode"})
        hook = await submit(live, grader={"type": "webhook", "url": "http://x.example:0/"})
    for response, path in ((agent, "agent.url"), (hook, "grader.webhook.url")):
        assert response.status_code == 422, response.text
        errors = response.json()["errors"]
        assert any(
            e["path"].startswith(path.split(".")[0]) and "port 0" in e["message"] for e in errors
        ), errors


@pytest.mark.parametrize("kind", ["agent", "webhook"])
async def test_a_name_resolving_to_a_denied_address_is_refused_at_call_time(
    serve: Any, tmp_path: Path, kind: str
) -> None:
    """`localhost` passes at submission (a name) but resolves to loopback, denied here: each
    call is refused before connecting, and the job fails on its own, without a retry."""
    async with (
        RawServer(answer(json.dumps(art_answer()).encode())) as target,
        service(serve, tmp_path, egress_deny=["loopback"]) as (live, _),
    ):
        url = target.url("/x", host="localhost")
        body: dict[str, Any] = (
            {"agent": {"url": url}}
            if kind == "agent"
            else {"grader": {"type": "webhook", "url": url}}
        )
        job = await run(live, **body)
        types = await event_types(live, job["id"])
    assert target.connections == 0
    assert job["status"] == "failed" and job["attempts"] == 1 and "job_retrying" not in types
    who = "agent" if kind == "agent" else "webhook grader"
    for error in job["summary"]["errors"]:
        assert f": {who} call refused by the egress policy: localhost (" in error
        assert error.endswith(") is denied")


# -- 5. untrainable answers ------------------------------------------------------------------


UNTRAINABLE: list[tuple[dict[str, Any], str]] = [
    (
        art_answer(
            messages_and_choices=[
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "y"},
            ]
        ),
        "cannot be trained on: no_trainable_turn at trajectory.messages_and_choices",
    ),
    (
        art_answer(
            messages_and_choices=[
                {"role": "user", "content": "x"},
                {**factories.art_choice("y", [1]), "logprobs": None},
            ]
        ),
        "cannot be trained on: missing_logprobs at trajectory.messages_and_choices[1].logprobs",
    ),
    (
        art_answer(messages_and_choices=[factories.art_choice("y", [1])]),
        "cannot be trained on: invalid_first_role at trajectory.messages_and_choices[0]",
    ),
    (
        art_answer(
            messages_and_choices=[
                {"role": "user", "content": "x"},
                {**factories.art_choice("y", [1]), "message": {"role": "user", "content": SECRET}},
            ]
        ),
        "cannot be trained on: invalid_role at trajectory.messages_and_choices[1].message.role",
    ),
    (
        art_answer(
            messages_and_choices=[{"role": SECRET, "content": "x"}, factories.art_choice("y", [1])]
        ),
        "invalid_first_role at trajectory.messages_and_choices[0]",
    ),
    (
        {"trajectory": {"episode": [factories.nat_item("user", "hi")]}, "reward": 1.0},
        "cannot be trained on: no_assistant_turn at trajectory.episode",
    ),
    (
        {
            "trajectory": {
                "episode": [factories.nat_item("user", "hi"), factories.nat_item("assistant", "y")]
            },
            "reward": 1.0,
        },
        "cannot be trained on: missing_logprobs at trajectory.episode[1].logprobs",
    ),
    ({"trajectory": {"messages_and_choices": "no"}, "reward": 1}, "not valid: list_type at"),
    (art_answer(reward=SECRET), "not valid: float_type at trajectory.reward"),  # type: ignore[arg-type]
    (art_answer(reward=None), "not valid: float_type at trajectory.reward"),  # type: ignore[arg-type]
]


def agent_app(answers: list[dict[str, Any]], headers_seen: list[dict[str, str]]) -> FastAPI:
    app = FastAPI()

    @app.post("/episode")
    async def episode(request: Request) -> Response:
        body = await request.json()
        headers_seen.append(dict(request.headers))
        return Response(json.dumps(answers[body["generation"]]), media_type="application/json")

    return app


async def test_untrainable_agent_answers_are_refused_as_they_arrive_and_left_out(
    serve: Any, tmp_path: Path
) -> None:
    good_nat = {"trajectory": factories.nat_trajectory(0.0), "reward": 0.0}
    answers = [art_answer(1.0), good_nat, *(a for a, _ in UNTRAINABLE)]
    seen: list[dict[str, str]] = []
    async with (
        LiveServer(agent_app(answers, seen)) as agent,
        service(serve, tmp_path, lease_seconds=600) as (
            live,
            _,
        ),
    ):
        start = time.monotonic()
        job = await run(
            live,
            agent={"url": f"{agent.url}/episode"},
            num_generations=len(answers),
            train={"hyperparameters": {}},
        )
        elapsed = time.monotonic() - start
        types = await event_types(live, job["id"])
        training = (await live.client.get(f"/v1/training-jobs/{job['training_job_id']}")).json()
    assert job["status"] == "succeeded", job["error"]
    assert job["summary"]["num_graded"] == 2 and job["summary"]["num_errors"] == len(UNTRAINABLE)
    errors = job["summary"]["errors"]
    for generation, (_, expected) in enumerate(UNTRAINABLE, start=2):
        message = next(e for e in errors if e.startswith(f"example q1 generation {generation}:"))
        assert f": agent trajectory {expected}" in message or expected in message, message
    assert SECRET not in json.dumps(job)
    assert training["summary"]["num_trajectories"] == 2
    # The lease (600 s) never lapsed: an end by lease would not come within the wait.
    assert "job_retrying" not in types and elapsed < 300


async def test_an_agent_that_answers_only_untrainable_trajectories_fails_the_job_at_once(
    serve: Any, tmp_path: Path
) -> None:
    answers = [a for a, _ in UNTRAINABLE[:4]]
    async with (
        LiveServer(agent_app(answers, [])) as agent,
        service(serve, tmp_path, lease_seconds=600) as (
            live,
            _,
        ),
    ):
        start = time.monotonic()
        job = await run(live, agent={"url": f"{agent.url}/episode"}, num_generations=4, train={})
        elapsed = time.monotonic() - start
        types = await event_types(live, job["id"])
    assert job["status"] == "failed" and job["error"]["type"] == "NothingCollected"
    assert job["attempts"] == 1 and "job_retrying" not in types
    assert elapsed < 300, elapsed  # not three lease cycles: the lease is 600 s
    assert types[-1] == "rollout_failed"


async def test_without_train_an_agents_trajectory_needs_no_logprobs(
    serve: Any, tmp_path: Path
) -> None:
    no_logprobs = {
        "trajectory": {
            "episode": [factories.nat_item("user", "hi"), factories.nat_item("assistant", "y")]
        },
        "reward": 1.0,
    }
    async with (
        LiveServer(agent_app([no_logprobs, UNTRAINABLE[5][0]], [])) as agent,
        service(serve, tmp_path) as (live, _),
    ):
        job = await run(live, agent={"url": f"{agent.url}/episode"})
        collection = await live.client.get(f"/v1/rollout-jobs/{job['id']}/trajectories")
    assert job["status"] == "succeeded" and job["summary"]["num_graded"] == 1
    assert job["summary"]["errors"] == [
        "example q1 generation 1: agent trajectory cannot be trained on: no_assistant_turn at "
        "trajectory.episode"
    ]
    assert collection.status_code == 200


async def test_sampled_answers_training_would_refuse_are_left_out(
    serve: Any, tmp_path: Path
) -> None:
    async with service(serve, tmp_path) as (live, endpoint):
        endpoint.without_logprobs = {1}
        job = await run(live, grader={"type": "contains"}, num_generations=3, train={})
        training = (await live.client.get(f"/v1/training-jobs/{job['training_job_id']}")).json()
    assert job["status"] == "succeeded", job["error"]
    assert job["summary"]["errors"] == [
        "example q1 generation 1: the endpoint's answer cannot be trained on: missing_logprobs "
        "at trajectory.messages_and_choices[1].logprobs"
    ]
    assert training["summary"]["num_trajectories"] == 2


# -- 6. headers are write-only ---------------------------------------------------------------


async def test_agent_and_grader_headers_are_used_and_never_shown(
    serve: Any, tmp_path: Path
) -> None:
    seen: list[dict[str, str]] = []
    hooks: list[Seen] = []

    async def grade(request: Seen, writer: asyncio.StreamWriter) -> None:
        hooks.append(request)
        status = 500 if json.loads(request.body)["generation"] == 0 else 200
        body = b'{"reward": 1.0}' if status == 200 else b"no"
        writer.write(head(status, ("content-length", str(len(body)))) + body)

    secret_headers = {"Authorization": f"Bearer {SECRET}", "X-Api-Key": SECRET}
    async with (
        LiveServer(agent_app([art_answer(1.0), art_answer(0.0)], seen)) as agent,
        RawServer(grade) as hook,
        service(serve, tmp_path) as (live, _),
    ):
        agent_job = await run(
            live,
            agent={"url": f"{agent.url}/episode", "headers": secret_headers},
            train={},
            metadata={"note": "headers are write-only"},
        )
        graded_job = await run(
            live, grader={"type": "webhook", "url": hook.url(), "headers": secret_headers}
        )
        child = agent_job["training_job_id"]
        await finished_training(live, child)
        shown = []
        for path in [
            *(f"/v1/rollout-jobs/{j['id']}" for j in (agent_job, graded_job)),
            *(f"/v1/rollout-jobs/{j['id']}/events?limit=100" for j in (agent_job, graded_job)),
            *(f"/v1/rollout-jobs/{j['id']}/trajectories" for j in (agent_job, graded_job)),
            "/v1/rollout-jobs",
            "/v1/rollout-jobs?status=succeeded",
            f"/v1/training-jobs/{child}",
            f"/v1/training-jobs/{child}/events",
            "/v1/training-jobs",
            "/v1/models",
            "/v1/models/toy",
            "/metrics",
            "/readyz",
        ]:
            response = await live.client.get(path)
            assert response.status_code == 200, (path, response.text)
            shown.append(response.text)
        async with live.client.stream(
            "GET", f"/v1/rollout-jobs/{agent_job['id']}/events/stream"
        ) as stream:
            text = ""
            async for chunk in stream.aiter_text():
                text += chunk
                if "rollout_ended" in text:
                    break
            shown.append(text)
    assert agent_job["status"] == "succeeded" and graded_job["status"] == "succeeded"
    assert all(s["authorization"] == f"Bearer {SECRET}" for s in seen)  # used ...
    assert all(h.headers["x-api-key"] == SECRET for h in hooks)
    for text in shown:  # ... never shown
        assert SECRET not in text
    assert SECRET not in json.dumps(graded_job["summary"]["errors"])


async def finished_training(live: LiveServer, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + PATIENCE
    while True:
        job = (await live.client.get(f"/v1/training-jobs/{job_id}")).json()
        if job["status"] in {"succeeded", "failed", "cancelled"}:
            return job
        assert time.monotonic() < deadline, job
        await asyncio.sleep(0.05)


async def test_an_error_building_the_result_ends_the_job_now_not_by_lease(
    serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("a bug while enqueuing the training job")

    monkeypatch.setattr("app.rollouts.runner.training_child", broken)
    async with service(serve, tmp_path, lease_seconds=600) as (live, _):
        start = time.monotonic()
        job = await run(live, grader={"type": "contains"}, train={})
        elapsed = time.monotonic() - start
        types = await event_types(live, job["id"])
    assert job["status"] == "failed" and job["error"]["type"] == "TypeError", job["error"]
    assert job["attempts"] == 1 and "job_retrying" not in types
    assert elapsed < 300, elapsed  # the lease is 600 s: it never had to lapse


async def test_a_sampled_answer_training_would_refuse_costs_no_webhook_call(
    serve: Any, tmp_path: Path
) -> None:
    async with (
        RawServer(answer(b'{"reward": 0.5}')) as hook,
        service(serve, tmp_path) as (
            live,
            endpoint,
        ),
    ):
        endpoint.without_logprobs = {0, 2}
        job = await run(
            live, grader={"type": "webhook", "url": hook.url()}, num_generations=4, train={}
        )
    assert job["status"] == "succeeded", job["error"]
    assert sorted(json.loads(s.body)["generation"] for s in hook.seen) == [1, 3]
    assert job["summary"]["num_errors"] == 2


async def test_a_stored_spec_that_no_longer_validates_fails_without_quoting_it(
    serve: Any, tmp_path: Path, database_url: str
) -> None:
    """A job queued before a header check existed (here: a `Host` header holding a secret)
    fails when its worker decodes it, naming the field, never its value."""
    async with service(serve, tmp_path) as (live, _):
        pass  # registers the model
    endpoint = Endpoint()
    async with endpoint.live:
        backend = ServedDryRun(tmp_path / "served", f"{endpoint.live.url}/v1")
        async with serve(backend_overrides={"cpu": backend}) as queued:  # no worker
            response = await submit(queued, agent={"url": "http://127.0.0.1:9/episode"})
            job_id = response.json()["id"]
        recipe = rollout_spec.decode(await stored_payload(database_url, job_id)).model_dump(
            mode="json"
        )
        recipe["agent"]["headers"] = {"Host": SECRET}
        payload = rollout_spec.CODEC.encode(recipe)
        engine = create_engine(database_url)
        try:
            async with engine.begin() as conn:
                await conn.execute(
                    update(JobRow)
                    .where(JobRow.id == job_id)
                    .values(payload=payload.data, payload_bytes=payload.size)
                )
        finally:
            await engine.dispose()
        async with serve(worker_enabled=True, backend_overrides={"cpu": backend}) as live:
            job = await finished(live, job_id)
    assert job["status"] == "failed" and job["attempts"] == 1
    assert job["error"]["message"].startswith(
        "the stored spec is not valid: value_error at agent.headers"
    ), job["error"]
    assert SECRET not in json.dumps(job)


async def stored_payload(database_url: str, job_id: str) -> Payload:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    select(JobRow.payload_format, JobRow.payload, JobRow.payload_bytes).where(
                        JobRow.id == job_id
                    )
                )
            ).one()
    finally:
        await engine.dispose()
    return Payload(row[0], row[1], row[2])
