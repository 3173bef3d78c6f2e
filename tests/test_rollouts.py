"""Rollout jobs end to end on the cpu backend: sample, grade, group, train."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from app.backends.tiny_model import make_tiny_model
from tests import factories as f
from tests.conftest import LiveServer
from tests.processes import PATIENCE

pytestmark = pytest.mark.torch
EXAMPLES = [
    {"id": "yes", "messages": [{"role": "user", "content": "say yes"}], "expected": "yes"},
    {
        "id": 2,
        "messages": [
            {"role": "system", "content": "answer in one word"},
            {"role": "user", "content": "say no"},
        ],
        "expected": "no",
    },
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("rollout-models") / "tiny")


@pytest.fixture
def serve(serve: Callable[..., LiveServer], tiny_model: Path) -> Callable[..., LiveServer]:
    """The service, allowed to load the tiny model (TRAINYARD_MODEL_ROOTS)."""
    return functools.partial(serve, model_roots=[tiny_model.parent])


async def wait_job(client: httpx.AsyncClient, url: str, timeout: float = PATIENCE) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        job = (await client.get(url)).json()
        if job["status"] in {"succeeded", "failed", "cancelled"}:
            return job
        assert loop.time() < deadline, job
        await asyncio.sleep(0.05)


async def wait_served(client: httpx.AsyncClient, name: str, timeout: float = PATIENCE) -> None:
    """Until a worker serves the model (its endpoint is recorded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (await client.get(f"/v1/models/{name}")).json()["inference_base_url"]:
        assert loop.time() < deadline, f"{name} was never served"
        await asyncio.sleep(0.05)


async def cpu_model(client: httpx.AsyncClient, base: Path, name: str = "toy") -> None:
    response = await client.post(
        "/v1/models", json={"name": name, "base_model": str(base), "backend": "cpu"}
    )
    assert response.status_code == 201, response.text


async def test_graded_rollout_builds_groups_with_logprobs_and_trains(serve, tiny_model) -> None:
    async with serve(worker_enabled=True) as live:
        await cpu_model(live.client, tiny_model)
        response = await live.client.post(
            "/v1/rollout-jobs",
            json={
                "model": "toy",
                "examples": EXAMPLES,
                "num_generations": 6,
                "sampling": {"max_tokens": 1, "temperature": 1.0},
                "grader": {"type": "exact_match"},
                "train": {"hyperparameters": {"learning_rate": 0.02}},
            },
        )
        assert response.status_code == 202, response.text
        assert response.headers["location"] == f"/v1/rollout-jobs/{response.json()['id']}"
        job = await wait_job(live.client, response.headers["location"])
        collection = (await live.client.get(f"/v1/rollout-jobs/{job['id']}/trajectories")).json()
        training = await wait_job(live.client, f"/v1/training-jobs/{job['training_job_id']}")
        model = (await live.client.get("/v1/models/toy")).json()
        events = (await live.client.get(f"/v1/rollout-jobs/{job['id']}/events")).json()

    assert job["status"] == "succeeded", job["error"]
    assert job["summary"]["num_samples"] == 12 and job["summary"]["num_graded"] == 12
    assert job["progress"]["step"] == 12 and job["progress"]["total"] == 12
    assert collection["run_id"] == job["id"]
    assert [len(group) for group in collection["trajectories"]] == [6, 6]
    answer = collection["trajectories"][1][0]["episode"][-1]
    assert answer["role"] == "assistant"
    assert answer["logprobs"]["content"][0]["token"].startswith("token_id:")
    assert collection["trajectories"][1][0]["episode"][0]["role"] == "system"
    rewards = {t["reward"] for g in collection["trajectories"] for t in g}
    assert rewards <= {0.0, 1.0}
    assert training["status"] == "succeeded", training["error"]
    assert training["metadata"] == {"rollout_job": job["id"]}
    assert training["policy_step"] == 0  # the step the rollout sampled tags its data
    assert model["current_step"] == 1
    types = [e["type"] for e in events["data"]]
    assert types[0] == "job_queued" and types[-1] == "rollout_ended"
    assert "rollout_progress" in types
    # A rollout speaks its own words: it samples the step it started from, trains nothing.
    started = next(e for e in events["data"] if e["type"] == "rollout_started")
    assert started["data"]["start_step"] == 0 and started["data"]["samples"] == 12
    assert not [t for t in types if t.startswith("training_")]


async def webhook_graded(client: httpx.AsyncClient, url: str, generations: int) -> httpx.Response:
    """A rollout of the first example, 2 tokens an answer, graded by the webhook at `url`."""
    return await client.post(
        "/v1/rollout-jobs",
        json={
            "model": "toy",
            "examples": EXAMPLES[:1],
            "num_generations": generations,
            "sampling": {"max_tokens": 2},
            "grader": {"type": "webhook", "url": url},
        },
    )


async def test_webhook_grader_and_its_errors(serve, tiny_model) -> None:
    grader = FastAPI()
    seen: list[dict[str, Any]] = []

    @grader.post("/grade")
    async def grade(body: dict[str, Any]) -> Any:
        seen.append(body)
        if body["generation"] == 0:
            return {"oops": True}  # a bad answer from the grader: recorded, not fatal
        return {"reward": float(len(body["answer"]) % 2), "reasoning": "parity"}

    async with LiveServer(grader) as grading, serve(worker_enabled=True) as live:
        await cpu_model(live.client, tiny_model)
        response = await webhook_graded(live.client, f"{grading.url}/grade", generations=4)
        job = await wait_job(live.client, response.headers["location"])
        collection = (await live.client.get(f"/v1/rollout-jobs/{job['id']}/trajectories")).json()
    assert job["status"] == "succeeded", job["error"]
    assert job["summary"]["num_graded"] == 3 and job["summary"]["num_errors"] == 1
    assert len(seen) == 4 and seen[0]["example"]["id"] == "yes"
    assert len(collection["trajectories"][0]) == 3
    assert "reward" in job["summary"]["errors"][0]
    assert collection["trajectories"][0][0]["metadata"]["reasoning"] == "parity"


async def test_a_rollout_cancelled_while_it_grades_counts_the_tokens_it_sampled(
    serve, tiny_model
) -> None:
    """Its answers were sampled (the model's usage counted them) before the cancel came:
    the job's usage shows them, as a finished job's would."""
    grader = FastAPI()
    asked = asyncio.Event()
    release = asyncio.Event()

    @grader.post("/grade")
    async def grade(body: dict[str, Any]) -> Any:
        asked.set()
        await release.wait()  # held until the test ends
        return {"reward": 1.0}

    async with LiveServer(grader) as grading, serve(worker_enabled=True) as live:
        try:
            await cpu_model(live.client, tiny_model)
            response = await webhook_graded(live.client, f"{grading.url}/grade", generations=2)
            url = response.headers["location"]
            await asyncio.wait_for(asked.wait(), PATIENCE)  # sampled; being graded
            cancel = await live.client.post(f"{url}/cancel")
            assert cancel.status_code == 200, cancel.text
            job = await wait_job(live.client, url)
        finally:
            release.set()
    assert job["status"] == "cancelled", job
    usage = job["usage"]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 2 * 2, usage


async def test_agent_rollout_runs_the_agents_own_episode(serve, tiny_model) -> None:
    """The agent is told its model's endpoint and key, and samples there; with that key
    it sees no other model (another project's, say), and without it nothing at all."""
    agent = FastAPI()
    calls: list[dict[str, Any]] = []
    probes: list[tuple[str, Any]] = []

    @agent.post("/episode")
    async def episode(body: dict[str, Any]) -> dict[str, Any]:
        calls.append(body)
        model = body["model"]
        messages = body["example"]["messages"]
        key = {"authorization": f"Bearer {model['api_key']}"}
        async with httpx.AsyncClient(base_url=model["base_url"], headers=key) as client:
            completion = (
                await client.post(
                    "/chat/completions",
                    json={
                        "model": model["name"],
                        "messages": messages,
                        "max_tokens": 2,
                        "logprobs": True,
                    },
                )
            ).json()
            if body["generation"] == 0 and body["example"]["id"] == "yes":  # once
                listed = (await client.get("/models")).json()
                probes.append(("listed", [m["id"] for m in listed["data"]]))
                other = {"model": "other@0", "messages": messages, "max_tokens": 1}
                reply = await client.post("/chat/completions", json=other)
                probes.append(("other", (reply.status_code, reply.json()["error"]["code"])))
                del client.headers["authorization"]
                bare = await client.post(
                    "/chat/completions", json={**other, "model": model["name"]}
                )
                probes.append(("no key", bare.status_code))
        choice = completion["choices"][0]
        return {
            "trajectory": {"messages_and_choices": [*messages, choice]},
            "reward": float(body["generation"] % 2),
        }

    async with LiveServer(agent) as agent_server, serve(worker_enabled=True) as live:
        await cpu_model(live.client, tiny_model, name="other")
        await cpu_model(live.client, tiny_model)
        for name in ("other", "toy"):  # each served by the backend's endpoint before the job
            await wait_served(live.client, name)
        response = await live.client.post(
            "/v1/rollout-jobs",
            json={
                "model": "toy",
                "examples": EXAMPLES,
                "num_generations": 2,
                "agent": {"url": f"{agent_server.url}/episode"},
                "train": {"hyperparameters": {}},
            },
        )
        job = await wait_job(live.client, response.headers["location"])
        training = await wait_job(live.client, f"/v1/training-jobs/{job['training_job_id']}")
    assert job["status"] == "succeeded", job["error"]
    assert len(calls) == 4
    assert calls[0]["model"]["name"] == "toy@0"
    assert dict(probes) == {"listed": ["toy@0"], "other": (404, "model_not_found"), "no key": 401}
    assert job["summary"]["mean_reward"] == 0.5
    assert training["status"] == "succeeded" and training["result"]["final_step"] == 1


@pytest.mark.parametrize(
    ("change", "path"),
    [
        # A union's branch (the grader's type, the id's str or int) is not in the path.
        ({"grader": {"type": "regex", "pattern": "("}}, "grader.pattern"),
        ({"grader": {"type": "regex"}}, "grader.pattern"),
        ({"examples": [{**EXAMPLES[0], "id": [1]}]}, "examples[0].id"),
        # A prompt's content is text, content parts or null: no number.
        (
            {"examples": [{**EXAMPLES[0], "messages": [{"role": "user", "content": 5}]}]},
            "examples[0].messages[0].content",
        ),
        (
            {"examples": [{"id": 1, "messages": [{"role": "user", "content": "x"}]}]},
            "examples[0].expected",
        ),
        ({"examples": [{"id": 1, "messages": []}]}, "examples[0].messages"),
        (
            {"examples": [{"id": 1, "messages": [{"role": "robot", "content": "x"}]}]},
            "examples[0].messages[0].role",
        ),
        (
            {"examples": [{"id": 1, "messages": [{"role": "user"}, {"content": "x"}]}]},
            "examples[0].messages[1].role",
        ),
        ({"agent": {"url": "http://127.0.0.1:9/x"}}, ""),
        ({"num_generations": 0}, "num_generations"),
        # Every example is checked as a run's and a dataset's are.
        ({"examples": [EXAMPLES[0], {**EXAMPLES[1], "id": "yes"}]}, "examples[1].id"),
        ({"examples": [{**EXAMPLES[0], "id": ""}]}, "examples[0].id"),
        ({"examples": [{**EXAMPLES[0], "id": 2**70}]}, "examples[0].id"),
        ({"examples": [{**EXAMPLES[0], "id": "a\u0000b"}]}, "examples[0].id"),
        (
            {"examples": [{"id": 1, "messages": [{"role": "assistant", "content": "x"}]}]},
            "examples[0].messages",
        ),
        ({"grader": {"type": "telepathy"}}, "grader"),
        ({"train": {"hyperparameters": {"lr": 1}}}, "train.hyperparameters.lr"),
        ({"model": "nobody"}, "model"),
    ],
)
async def test_bad_rollout_requests_are_422_with_paths(serve, tiny_model, change, path) -> None:
    async with serve() as live:
        await cpu_model(live.client, tiny_model)
        body = {"model": "toy", "examples": EXAMPLES, "grader": {"type": "exact_match"}, **change}
        response = await live.client.post("/v1/rollout-jobs", json=body)
        listed = (await live.client.get("/v1/rollout-jobs")).json()
    assert response.status_code == 422, response.text
    assert any(e["path"] == path for e in response.json()["errors"]), response.json()
    assert listed["data"] == []


@pytest.mark.parametrize(
    ("url", "wrong"),
    [
        ("/v1/rollout-jobs", {"num_generations": 0}),
        ("/v1/evaluation-jobs", {"samples_per_example": 0}),
        ("/v1/runs", {"schedule": {"max_steps": 0}}),
        ("/v1/run-estimates", {"schedule": {"max_steps": 0}}),
    ],
)
async def test_a_repeated_id_is_listed_with_the_bodys_other_problems(serve, url, wrong) -> None:
    # The repeated id is the service's check of a valid body; one answer names every problem.
    examples = [EXAMPLES[0], EXAMPLES[1], {**EXAMPLES[1], "id": EXAMPLES[0]["id"]}]
    body = {"model": "toy", "examples": examples, "grader": {"type": "exact_match"}, **wrong}
    if url.startswith("/v1/run"):
        body = {"model": "toy", "examples": examples, **wrong}
        body["recipe"] = {"grader": {"type": "exact_match"}}
    async with serve() as live:
        response = await live.client.post(url, json=body)
    assert response.status_code == 422, response.text
    errors = {e["path"]: e["type"] for e in response.json()["errors"]}
    assert errors.pop("examples[2].id") == "duplicate_id", errors
    assert len(errors) == 1 and next(iter(errors.values())) == "greater_than_equal", errors


async def test_a_model_that_is_not_served_cannot_roll_out(serve) -> None:
    async with serve() as live:
        await live.client.post(
            "/v1/models", json={"name": "d", "base_model": "b", "backend": "dry-run"}
        )
        response = await live.client.post(
            "/v1/rollout-jobs",
            json={"model": "d", "examples": EXAMPLES, "grader": {"type": "exact_match"}},
        )
    assert response.status_code == 422
    assert response.json()["errors"][0]["type"] == "not_served"


async def test_cancel_a_queued_rollout_and_trajectories_are_409_until_done(
    serve, tiny_model
) -> None:
    async with serve() as live:  # no worker: stays queued
        await cpu_model(live.client, tiny_model)
        job = (
            await live.client.post(
                "/v1/rollout-jobs",
                json={"model": "toy", "examples": EXAMPLES, "grader": {"type": "contains"}},
            )
        ).json()
        early = await live.client.get(f"/v1/rollout-jobs/{job['id']}/trajectories")
        cancelled = await live.client.post(f"/v1/rollout-jobs/{job['id']}/cancel")
        wrong_kind = await live.client.get(f"/v1/training-jobs/{job['id']}")
    assert early.status_code == 409
    assert cancelled.json()["status"] == "cancelled"
    assert wrong_kind.status_code == 404


async def test_an_idempotency_key_returns_the_rollout_it_made(serve, tiny_model) -> None:
    async with serve() as live:  # no worker: the jobs stay queued
        await cpu_model(live.client, tiny_model)
        body = {"model": "toy", "examples": EXAMPLES, "grader": {"type": "contains"}}
        headers = {"Idempotency-Key": "rollout-1"}
        first = await live.client.post("/v1/rollout-jobs", json=body, headers=headers)
        again = await live.client.post("/v1/rollout-jobs", json=body, headers=headers)
        other = {**body, "num_generations": 3}
        reused = await live.client.post("/v1/rollout-jobs", json=other, headers=headers)
        # A key is one job of any kind: a training job cannot take it over either.
        training = await live.client.post(
            "/v1/training-jobs",
            json={"model": "toy", "collection": f.nat_collection()},
            headers=headers,
        )
        empty = await live.client.post(
            "/v1/rollout-jobs", json=body, headers={"Idempotency-Key": ""}
        )
        listed = (await live.client.get("/v1/rollout-jobs")).json()["data"]
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    for refused in (reused, training):
        assert refused.status_code == 422, refused.text
        assert refused.json()["errors"][0]["type"] == "idempotency_key_reused"
    assert empty.status_code == 422
    assert [j["id"] for j in listed] == [first.json()["id"]]
