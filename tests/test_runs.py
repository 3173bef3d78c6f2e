"""Training runs through the API alone, on the cpu backend's demo model: datasets, the
whole loop (sample, grade, train, validate, keep the best, prune), curves, pause, resume
and cancel."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event
from sqlalchemy.engine import Engine

from app.backends.tiny_model import make_tiny_model
from app.runs.schedule import child_id
from tests.conftest import LiveServer
from tests.factories import art_groups, submit
from tests.processes import PATIENCE

pytestmark = pytest.mark.torch
FINAL = {"succeeded", "failed", "cancelled"}
JSONL = {"Content-Type": "application/jsonl"}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def serve(serve: Callable[..., LiveServer], tiny_model: Path) -> Callable[..., LiveServer]:
    return functools.partial(
        serve, model_roots=[tiny_model.parent], worker_enabled=True, demo_model=True
    )


DIGIT = {"type": "regex", "pattern": "^[0-9]$"}  # the toy task's grader


def toy_lines(train: int = 8, validation: int = 4) -> bytes:
    """The toy task: the reward is 1 when the one-token answer is a digit (about one
    answer in ten of the untrained tiny model)."""
    lines = []
    for split, count in (("train", train), ("validation", validation)):
        for i in range(count):
            lines.append(
                {
                    "id": f"{split}-{i}",
                    "messages": [{"role": "user", "content": f"say a number {i}"}],
                    "expected": "7",
                    "split": split,
                }
            )
    return "\n".join(json.dumps(line) for line in lines).encode() + b"\n"


async def served(client: httpx.AsyncClient, name: str = "demo") -> dict[str, Any]:
    for _ in range(400):
        model = (await client.get(f"/v1/models/{name}")).json()
        if model.get("inference_base_url"):
            return model
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} was never served")


async def wait_run(
    client: httpx.AsyncClient, run_id: str, timeout: float = PATIENCE, until: Any = None
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        run = (await client.get(f"/v1/runs/{run_id}")).json()
        if until(run) if until else run["status"] in FINAL:
            return run
        if loop.time() > deadline:
            jobs = [(await client.get(f"/v1/rollout-jobs/{j}")).json() for j in run["current_jobs"]]
            raise AssertionError(f"run {run_id}: {run}; waiting on {jobs}")
        await asyncio.sleep(0.05)


async def all_metrics(client: httpx.AsyncClient, run_id: str) -> list[dict[str, Any]]:
    rows, after = [], 0
    while True:
        page = (await client.get(f"/v1/runs/{run_id}/metrics?after={after}&limit=5")).json()
        rows += page["data"]
        if not page["has_more"]:
            return rows
        after = int(page["next_cursor"])


SEVEN = {
    "messages": [
        {"role": "user", "content": "say a number"},
        {"role": "assistant", "content": "7"},
    ]
}


def run_body(dataset: str, **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "demo",
        "dataset": {"id": dataset},
        "recipe": {
            "num_generations": 8,
            "sampling": {"max_tokens": 1, "temperature": 1.0},
            "grader": DIGIT,
        },
        "schedule": {"max_steps": 24, "examples_per_step": 4, "shuffle_seed": 7},
        "hyperparameters": {"learning_rate": 0.05},
        "validation": {"every_steps": 3, "num_generations": 16},
    }
    body.update(changes)
    return body


def inline_run_body() -> dict[str, Any]:
    """A run of four inline examples, without validation."""
    examples = [
        {"id": i, "messages": [{"role": "user", "content": "say yes"}], "expected": "yes"}
        for i in range(4)
    ]
    body = run_body("", examples=examples, validation=None)
    del body["dataset"]
    return body


async def upload(client: httpx.AsyncClient, data: bytes, name: str = "toy") -> dict[str, Any]:
    response = await client.post(f"/v1/datasets?name={name}", content=data, headers=JSONL)
    assert response.status_code in (200, 201), response.text
    return response.json()


async def test_a_run_lifts_validation_reward_keeps_the_best_and_prunes_the_rest(serve) -> None:
    async with serve() as live:
        client = live.client
        await served(client)
        dataset = await upload(client, toy_lines())
        assert dataset["splits"] == {"train": 8, "validation": 4}
        body = run_body(dataset["id"], early_stopping={"patience": 3, "min_delta": 0.02})
        response = await client.post("/v1/runs", json=body)
        assert response.status_code == 202, response.text
        assert response.headers["location"] == f"/v1/runs/{response.json()['id']}"
        run = await wait_run(client, response.json()["id"])
        metrics = await all_metrics(client, run["id"])
        checkpoints = (await client.get("/v1/models/demo/checkpoints?limit=100")).json()["data"]
        events = (await client.get(f"/v1/runs/{run['id']}/events?limit=1000")).json()["data"]

    assert run["status"] == "succeeded", run
    assert run["stop_reason"] in ("completed", "early_stopping")
    validations = [m for m in metrics if m["kind"] == "validation"]
    steps = [m for m in metrics if m["kind"] == "step"]
    # One row per step trained, steps 1..n in order, each with its curve's figures.
    assert [m["step"] for m in steps] == list(range(1, run["progress"]["step"] + 1))
    assert all(m["data"]["reward_mean"] is not None for m in steps)
    # A step with a group to learn from has a loss; one without trains nothing.
    assert all(
        isinstance(m["data"]["loss"], float) == (m["data"]["trainable_share"] > 0) for m in steps
    ), [m["data"] for m in steps]
    assert all(m["data"]["training_s"] > 0 and m["data"]["sampling_s"] > 0 for m in steps)
    # Validated before the first step (a baseline), then every 3 steps.
    assert validations[0]["step"] == 0 and validations[0]["data"]["score"] <= 0.3, validations
    best = max(validations, key=lambda m: m["data"]["score"])
    assert best["data"]["score"] >= 0.8, validations
    assert run["best_checkpoint"] == {"step": best["step"], "score": best["data"]["score"]}
    # The best and the latest stay; every other step the run made is pruned (step 0 is
    # the base: the run did not make it).
    kept = sorted(c["step"] for c in checkpoints)
    assert kept == sorted({0, best["step"], run["progress"]["step"]}), kept
    by_step = {c["step"]: c for c in checkpoints}
    assert by_step[best["step"]]["validation_metrics"]["score"] == best["data"]["score"]
    types = [e["type"] for e in events]
    assert types[0] == "job_queued" and types[1] == "run_started" and types[-1] == "run_ended"
    assert types.count("run_step") == run["progress"]["step"]
    assert types.count("run_validated") == len(validations)


@pytest.mark.parametrize(
    ("line", "path"),
    [
        (
            b'{"id": 1, "messages": [{"role": "user"}, {"role": "robot", "content": "x"}]}',
            "line[2].messages[1].role",
        ),
        (b'{"id": 1, "messages": []}', "line[2].messages"),
        (b'{"id": 1, "messages": [{"role": "user"}], "split": "a b"}', "line[2].split"),
        (b'{"id": 1, "messages": [{"role": "user"}], "x": 1}', "line[2].x"),
        (b'{"id": 1, "messages": [{"role": "user"}]', "line[2]"),
        (b"[1, 2]", "line[2]"),
    ],
)
async def test_a_bad_upload_names_the_line_and_stores_nothing(live, line, path) -> None:
    good = b'{"id": 0, "messages": [{"role": "user", "content": "hi"}]}\n'
    response = await live.client.post(
        "/v1/datasets?name=bad", content=good + line + b"\n" + good, headers=JSONL
    )
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["errors"][0]["path"].startswith(path)
    assert (await live.client.get("/v1/datasets")).json()["data"] == []


async def test_an_upload_is_jsonl_and_the_same_bytes_are_stored_once(live) -> None:
    client = live.client
    refused = await client.post("/v1/datasets?name=x", json={"id": 1})
    assert refused.status_code == 422 and refused.json()["errors"][0]["path"] == "content-type"
    empty = await client.post("/v1/datasets?name=x", content=b"\n \n", headers=JSONL)
    assert empty.status_code == 422
    first = await client.post("/v1/datasets?name=x", content=toy_lines(2, 1), headers=JSONL)
    again = await client.post("/v1/datasets?name=x", content=toy_lines(2, 1), headers=JSONL)
    other = await client.post("/v1/datasets?name=y", content=toy_lines(2, 1), headers=JSONL)
    assert (first.status_code, again.status_code, other.status_code) == (201, 200, 201)
    assert first.json() == again.json() and first.json()["id"] != other.json()["id"]
    assert first.json()["num_examples"] == 3
    assert len((await client.get("/v1/datasets")).json()["data"]) == 2
    gone = await client.delete(f"/v1/datasets/{other.json()['id']}")
    assert gone.status_code == 204
    assert (await client.get(f"/v1/datasets/{other.json()['id']}")).status_code == 404


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"model": "nope"}, "model"),
        ({"dataset": {"id": "ds_nope"}}, "dataset.id"),
        ({"dataset": {"id": "{ds}", "train_split": "other"}}, "dataset.train_split"),
        ({"schedule": {"examples_per_step": 4}}, "schedule"),
        ({"hyperparameters": {"learning_rate": "fast"}}, "hyperparameters.learning_rate"),
        (
            {"recipe": {"num_generations": 1, "grader": {"type": "exact_match"}}},
            "recipe.num_generations",
        ),
        ({"early_stopping": {"patience": 2}, "validation": None}, ""),
        ({"max_steps_off_policy": 2}, "max_steps_off_policy"),
        (
            {"warmup": {"examples": [{"messages": [{"role": "user", "content": "x"}]}]}},
            "warmup.examples[0]",
        ),
        (
            {"warmup": {"examples": [SEVEN], "hyperparameters": {"beta": 0.1}}},
            "warmup.hyperparameters.beta",
        ),
    ],
)
async def test_bad_runs_are_422_with_paths_and_store_nothing(serve, change, path) -> None:
    async with serve() as live:
        dataset = await upload(live.client, toy_lines(2, 1))
        body = run_body(dataset["id"])
        for key, value in change.items():
            if isinstance(value, dict) and value.get("id") == "{ds}":
                value = {**value, "id": dataset["id"]}
            body[key] = value
        response = await live.client.post("/v1/runs", json=body)
        runs = (await live.client.get("/v1/runs")).json()["data"]
    assert response.status_code == 422, response.text
    assert path in [e["path"] for e in response.json()["errors"]], response.json()
    assert runs == []


async def test_a_runs_settings_are_its_request_with_defaults_and_no_secrets(serve) -> None:
    """What the dashboard compares side by side: the stored settings, defaults filled in,
    hyper-parameters as the backend takes them; never a grader's headers or URL query."""
    grader = {
        "type": "webhook",
        "url": "https://grader.example/score?token=s3cret",
        "headers": {"Authorization": "Bearer s3cret"},
    }
    async with serve(worker_enabled=False) as live:
        dataset = await upload(live.client, toy_lines(2, 1))
        body = run_body(
            dataset["id"],
            warmup={"examples": [SEVEN] * 3, "hyperparameters": {"learning_rate": 0.02}},
        )
        body["recipe"] = {**body["recipe"], "grader": grader}
        created = await live.client.post("/v1/runs", json=body)
        assert created.status_code == 202, created.text
        response = await live.client.get(f"/v1/runs/{created.json()['id']}/settings")
        missing = await live.client.get("/v1/runs/run_nope/settings")
    assert response.status_code == 200, response.text
    shown = response.json()
    assert "s3cret" not in response.text and "headers" not in shown["recipe"]["grader"]
    assert shown["recipe"]["grader"]["url"] == "https://grader.example/score?…"
    assert shown["recipe"]["num_generations"] == 8 and shown["recipe"]["concurrency"] == 8
    assert shown["schedule"] == {
        "epochs": None,
        "max_steps": 24,
        "examples_per_step": 4,
        "shuffle_seed": 7,
    }
    assert shown["hyperparameters"]["learning_rate"] == 0.05
    assert shown["validation"]["every_steps"] == 3
    assert shown["dataset"]["id"] == dataset["id"]
    assert (shown["num_train"], shown["num_validation"]) == (2, 1)
    assert shown["early_stopping"] is None and shown["max_steps_off_policy"] == 0
    assert shown["warmup"]["num_examples"] == 3 and "examples" not in shown["warmup"]
    assert shown["warmup"]["hyperparameters"]["learning_rate"] == 0.02
    assert shown["start_step"] is None  # no worker here: it has not started
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"


async def test_inline_examples_pause_resume_and_cancel_while_a_step_trains(serve) -> None:
    async with serve() as live:
        client = live.client
        await served(client)
        body = inline_run_body()
        body["schedule"] = {"epochs": 50, "examples_per_step": 2}
        run = (await client.post("/v1/runs", json=body, headers={"Idempotency-Key": "r1"})).json()
        replay = await client.post("/v1/runs", json=body, headers={"Idempotency-Key": "r1"})
        assert replay.json()["id"] == run["id"] and replay.headers["idempotent-replayed"] == "true"
        assert run["progress"]["total_steps"] == 100
        # Pause while a step trains: that step lands, no other starts.
        await wait_run(client, run["id"], until=lambda r: r["progress"]["phase"] == "training")
        paused = (await client.post(f"/v1/runs/{run['id']}/pause")).json()
        assert paused["paused"] is True
        held = await wait_run(
            client, run["id"], until=lambda r: r["current_jobs"] == [] and r["progress"]["step"] > 0
        )
        await asyncio.sleep(0.5)
        still = (await client.get(f"/v1/runs/{run['id']}")).json()
        assert still["progress"]["step"] == held["progress"]["step"] and still["current_jobs"] == []
        assert still["progress"]["phase"] == "paused" and still["status"] == "running"
        # Resume, then cancel while the next step trains: the run ends cancelled and every
        # step that landed is in its curve.
        resumed = (await client.post(f"/v1/runs/{run['id']}/resume")).json()
        assert resumed["paused"] is False
        await wait_run(
            client,
            run["id"],
            until=lambda r: (
                r["progress"]["phase"] == "training"
                and r["progress"]["step"] > held["progress"]["step"]
            ),
        )
        cancelled = await client.post(f"/v1/runs/{run['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["cancel_requested"] is True
        final = await wait_run(client, run["id"])
        metrics = await all_metrics(client, run["id"])
        again = await client.post(f"/v1/runs/{run['id']}/cancel")
        pause_after = await client.post(f"/v1/runs/{run['id']}/pause")
        children = (await client.get(f"/v1/rollout-jobs?metadata.run={run['id']}&limit=100")).json()
        model = (await client.get("/v1/models/demo")).json()
    assert final["status"] == "cancelled" and final["stop_reason"] == "cancelled"
    assert [m["step"] for m in metrics] == list(range(1, final["progress"]["step"] + 1))
    assert model["current_step"] == final["progress"]["step"]
    assert again.status_code == 409 and pause_after.status_code == 409
    assert all(job["status"] in FINAL for job in children["data"])


@contextlib.contextmanager
def transactions(engine: Engine) -> Iterator[list[list[tuple[str, str]]]]:
    """The statements (text, parameters) of each transaction the engine commits while
    inside, in order."""
    committed: list[list[tuple[str, str]]] = []
    open_: dict[int, list[tuple[str, str]]] = {}

    def begin(conn: Any) -> None:
        open_[id(conn)] = []

    def execute(conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if id(conn) in open_:
            open_[id(conn)].append((" ".join(statement.split()), str(parameters)))

    def commit(conn: Any) -> None:
        committed.append(open_.pop(id(conn), []))

    def rollback(conn: Any) -> None:
        open_.pop(id(conn), None)

    listeners = [
        ("begin", begin),
        ("before_cursor_execute", execute),
        ("commit", commit),
        ("rollback", rollback),
    ]
    for name, listener in listeners:
        event.listen(engine, name, listener)
    try:
        yield committed
    finally:
        for name, listener in listeners:
            event.remove(engine, name, listener)


def _inserts(statement: str, parameters: str, job_id: str) -> bool:
    """Whether the statement inserts the job `job_id` (its id first, or named `id`)."""
    inserted = parameters.startswith(f"('{job_id}'") or f"'id': '{job_id}'" in parameters
    return statement.startswith("INSERT INTO jobs") and inserted


async def test_a_childs_end_moves_its_run_and_starts_the_next_child_in_one_write(serve) -> None:
    """A training child's final write also writes the run's move, queues the next step's
    rollout and claims it (`app.runs.driver.JoinedMove`): one transaction, where four ran
    one after another (`bench.runs`)."""
    async with serve() as live:
        client = live.client
        await served(client)
        body = inline_run_body()
        body["recipe"]["num_generations"] = 2
        body["schedule"] = {"max_steps": 3, "examples_per_step": 2}
        with transactions(live.app.state.engine.sync_engine) as written:
            response = await client.post("/v1/runs", json=body)
            assert response.status_code == 202, response.text
            run_id = response.json()["id"]
            final = await wait_run(client, run_id)
    assert final["status"] == "succeeded" and final["progress"]["step"] == 3
    for step in (1, 2):
        ended, nxt = child_id(run_id, "training", step), child_id(run_id, "rollout", step + 1)
        # The transaction that queued the next rollout ended the training job before (on
        # Postgres in a statement of data-modifying CTEs), wrote the run's move, and claimed
        # the rollout after.
        [tx] = [tx for tx in written if any(_inserts(s, p, nxt) for s, p in tx)]
        [queued] = [i for i, (s, p) in enumerate(tx) if _inserts(s, p, nxt)]
        assert any(
            "UPDATE jobs SET status" in s and ended in p and "succeeded" in p
            for s, p in tx[:queued]
        ), tx
        assert any(s.startswith("UPDATE runs") for s, _ in tx[:queued]), tx
        assert any("lease_owner" in s for s, _ in tx[queued + 1 :]), tx  # and claimed


async def test_a_run_with_an_agent_calls_it_as_rollout_jobs_do(serve) -> None:
    agent = FastAPI()
    calls: list[dict[str, Any]] = []

    @agent.post("/episode")
    async def episode(body: dict[str, Any]) -> dict[str, Any]:
        calls.append(body)
        model, messages = body["model"], body["example"]["messages"]
        key = {"authorization": f"Bearer {model['api_key']}"}  # as an OpenAI client sends it
        async with httpx.AsyncClient(base_url=model["base_url"], headers=key) as client:
            completion = await client.post(
                "/chat/completions",
                json={
                    "model": model["name"],
                    "messages": messages,
                    "max_tokens": 1,
                    "logprobs": True,
                },
            )
        choice = completion.json()["choices"][0]
        return {
            "trajectory": {"messages_and_choices": [*messages, choice]},
            "reward": float(body["generation"] % 2),
        }

    async with LiveServer(agent) as agent_server, serve() as live:
        await served(live.client)
        examples = [
            {"id": f"a{i}", "messages": [{"role": "user", "content": "say yes"}]} for i in range(2)
        ]
        body = run_body("", examples=examples, validation=None)
        del body["dataset"]
        body["recipe"] = {"num_generations": 2, "agent": {"url": f"{agent_server.url}/episode"}}
        body["schedule"] = {"max_steps": 2, "examples_per_step": 2}
        response = await live.client.post("/v1/runs", json=body)
        assert response.status_code == 202, response.text
        run = await wait_run(live.client, response.json()["id"])
        metrics = await all_metrics(live.client, run["id"])
    assert run["status"] == "succeeded", run
    assert len(calls) == 8  # 2 steps x 2 examples x 2 generations
    assert {c["model"]["name"] for c in calls} == {f"demo@{m['step'] - 1}" for m in metrics}
    assert [m["data"]["reward_mean"] for m in metrics] == [0.5, 0.5]
    assert {c["example"]["metadata"]["example_id"] for c in calls} == {"a0", "a1"}


def yes_examples(count: int = 4) -> list[dict[str, Any]]:
    return [
        {"id": i, "messages": [{"role": "user", "content": "say yes"}], "expected": "yes"}
        for i in range(count)
    ]


def inline_run(steps: int, **changes: Any) -> dict[str, Any]:
    body = run_body("", examples=yes_examples(), validation=None, **changes)
    del body["dataset"]
    body["schedule"] = {"max_steps": steps, "examples_per_step": 2}
    return body


async def test_one_run_owns_its_model_until_it_ends(serve) -> None:
    """A second run, a training job and a rollout that trains are refused (409, naming the
    run) while a run is active on the model; sampling is not; once the run has ended (a
    paused run cancelled shows `paused: false`) the model takes a run again."""
    async with serve() as live:
        client = live.client
        await served(client)
        first = (await client.post("/v1/runs", json=inline_run(500))).json()
        paused = (await client.post(f"/v1/runs/{first['id']}/pause")).json()
        second = await client.post("/v1/runs", json=inline_run(2))
        training = await submit(client, "demo", groups=art_groups())
        rollout = {
            "model": "demo",
            "examples": yes_examples(1),
            "num_generations": 2,
            "sampling": {"max_tokens": 1},
            "grader": {"type": "exact_match"},
        }
        trains = await client.post("/v1/rollout-jobs", json={**rollout, "train": {}})
        samples = await client.post("/v1/rollout-jobs", json=rollout)
        cancelled = (await client.post(f"/v1/runs/{first['id']}/cancel")).json()
        ended = await wait_run(client, first["id"])
        third = await client.post("/v1/runs", json=inline_run(2))
        done = await wait_run(client, third.json()["id"])
    assert paused["paused"] is True
    for refused in (second, training, trains):
        assert refused.status_code == 409, refused.text
        problem = refused.json()
        assert problem["holder"] == first["id"] and first["id"] in problem["detail"]
    assert samples.status_code == 202, samples.text
    # Flagged for its driver, or (still queued: its driver had not started it on a busy
    # machine) cancelled at once; either way it ends cancelled.
    assert cancelled["cancel_requested"] is True or cancelled["status"] == "cancelled", cancelled
    assert ended["status"] == "cancelled" and ended["paused"] is False
    assert third.status_code == 202, third.text
    assert done["status"] == "succeeded" and done["progress"]["step"] == 2


async def test_a_run_whose_state_an_earlier_version_wrote_finishes(serve) -> None:
    """A run in flight during an upgrade: its state row as the first release of runs
    wrote it (format 1, no `format` key) is read by this one, and the run goes on."""
    from sqlalchemy import text

    from app.db import json_dumps, write_connection

    async with serve() as live:
        client = live.client
        await served(client)
        run = (await client.post("/v1/runs", json=inline_run(4))).json()
        await wait_run(client, run["id"], until=lambda r: r["progress"]["phase"] == "training")
        await client.post(f"/v1/runs/{run['id']}/pause")
        await wait_run(
            client, run["id"], until=lambda r: r["current_jobs"] == [] and r["progress"]["step"]
        )
        engine = live.app.state.engine
        async with write_connection(engine) as conn:
            raw = (
                await conn.execute(text("SELECT state FROM runs WHERE id = :id"), {"id": run["id"]})
            ).scalar_one()
            state = json.loads(raw) if isinstance(raw, str) else raw
            assert state.pop("format") == 2
            await conn.execute(
                text("UPDATE runs SET state = :s, version = version + 1 WHERE id = :id"),
                {"s": json_dumps(state), "id": run["id"]},
            )
        await client.post(f"/v1/runs/{run['id']}/resume")
        final = await wait_run(client, run["id"])
        metrics = await all_metrics(client, run["id"])
        async with engine.connect() as conn:
            raw = (
                await conn.execute(text("SELECT state FROM runs WHERE id = :id"), {"id": run["id"]})
            ).scalar_one()
    assert final["status"] == "succeeded" and final["progress"]["step"] == 4
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert (json.loads(raw) if isinstance(raw, str) else raw)["format"] == 2


async def test_an_sft_warm_up_runs_before_the_first_validation_and_rollout(serve) -> None:
    """A run's `warmup`: one SFT step (a training job of the run, `run_role: warmup`) on
    chats answering the toy task, before the baseline validation, which then samples the
    warmed-up step and scores above the untrained model's ~0.1."""
    async with serve() as live:
        client = live.client
        await served(client)
        dataset = await upload(client, toy_lines())
        warmup = {
            "examples": [
                {
                    "messages": [
                        {"role": "user", "content": f"say a number {i}"},
                        {"role": "assistant", "content": "7"},
                    ]
                }
                for i in range(8)
            ],
            "hyperparameters": {"learning_rate": 0.05, "batch_size": 4},
        }
        body = run_body(
            dataset["id"],
            warmup=warmup,
            schedule={"max_steps": 1, "examples_per_step": 4},
            validation={"every_steps": 1, "num_generations": 16},
        )
        response = await client.post("/v1/runs", json=body)
        assert response.status_code == 202, response.text
        run = await wait_run(client, response.json()["id"])
        metrics = await all_metrics(client, run["id"])
        events = (await client.get(f"/v1/runs/{run['id']}/events?limit=1000")).json()["data"]
        job_id = "job_" + run["id"].removeprefix("run_") + "-w000000"
        job = (await client.get(f"/v1/training-jobs/{job_id}")).json()

    assert run["status"] == "succeeded", run
    assert job["method"] == "sft" and job["status"] == "succeeded", job
    assert job["metadata"] == {"run": run["id"], "run_step": 0, "run_role": "warmup"}
    assert job["summary"]["num_examples"] == 8 and job["progress"]["total"] == 2
    assert job["hyperparameters"] == {"learning_rate": 0.05, "batch_size": 4}
    steps = [e["data"] for e in events if e["type"] == "run_step"]
    assert steps[0]["warmup"] == job_id and steps[0]["step"] == 0
    assert steps[0]["loss"] > 0
    validations = [m for m in metrics if m["kind"] == "validation"]
    # The baseline validates the warmed-up step (the warm-up made step 1 of the model).
    assert validations[0]["step"] == job["result"]["final_step"]
    assert validations[0]["data"]["score"] >= 0.5, validations


async def test_cancelling_an_ended_run_or_job_says_which_and_how_it_ended(serve) -> None:
    """The 409 reads alike for every kind: `run run_x already cancelled`, `job job_x
    already cancelled`; so does a pause or resume of an ended run."""
    async with serve(worker_enabled=False) as live:
        dataset = await upload(live.client, toy_lines(2, 1))
        run = (await live.client.post("/v1/runs", json=run_body(dataset["id"]))).json()["id"]
        first = [await live.client.post(f"/v1/runs/{run}/cancel")]
        job = (await submit(live.client, "demo")).json()["id"]  # the run no longer holds demo
        first.append(await live.client.post(f"/v1/training-jobs/{job}/cancel"))
        again = {
            "run": await live.client.post(f"/v1/runs/{run}/cancel"),
            "pause": await live.client.post(f"/v1/runs/{run}/pause"),
            "resume": await live.client.post(f"/v1/runs/{run}/resume"),
            "job": await live.client.post(f"/v1/training-jobs/{job}/cancel"),
        }
    assert [r.json()["status"] for r in first] == ["cancelled", "cancelled"], first
    details = {name: (r.status_code, r.json()["detail"]) for name, r in again.items()}
    assert details == {
        "run": (409, f"run {run} already cancelled; it cannot be cancelled"),
        "pause": (409, f"run {run} already cancelled; it cannot be paused"),
        "resume": (409, f"run {run} already cancelled; it cannot be resumed"),
        "job": (409, f"job {job} already cancelled; it cannot be cancelled"),
    }


async def test_another_projects_run_is_a_404_on_every_route(serve) -> None:
    """A key that is not admin sees only its project's runs (issue 28 §2): another's is a
    404 on every route, absent from lists; a run on another project's model is refused."""
    async with serve(key_cache_seconds=0) as live:
        client = live.client
        await served(client)  # open: no key yet; `demo` is the default project's
        run_id = (await client.post("/v1/runs", json=inline_run(500))).json()["id"]
        dataset = (await upload(client, toy_lines()))["id"]
        project = (await client.post("/v1/projects", json={"name": "b"})).json()["id"]

        async def key(*scopes: str, auth: dict[str, str] | None = None) -> dict[str, str]:
            body = {"name": "k", "scopes": list(scopes)}
            made = await client.post(f"/v1/projects/{project}/keys", json=body, headers=auth)
            assert made.status_code == 201, made.text
            return {"Authorization": f"Bearer {made.json()['secret']}"}

        admin = await key("admin")  # keys exist now: the service asks for one
        other = await key("write", auth=admin)
        for path in ("", "/metrics", "/settings", "/events"):
            answer = await client.get(f"/v1/runs/{run_id}{path}", headers=other)
            assert answer.status_code == 404, (path, answer.text)
        for action in ("pause", "resume", "cancel"):
            answer = await client.post(f"/v1/runs/{run_id}/{action}", headers=other)
            assert answer.status_code == 404, (action, answer.text)
        assert (await client.get("/v1/runs", headers=other)).json()["data"] == []
        refused = await client.post("/v1/runs", json=inline_run(2), headers=other)
        assert refused.status_code == 422 and refused.json()["errors"][0]["path"] == "model"
        theirs = await client.post("/v1/runs", json=run_body(dataset), headers=other)
        assert theirs.status_code == 422
        assert "dataset.id" in {e["path"] for e in theirs.json()["errors"]}
        assert (await client.get(f"/v1/runs/{run_id}", headers=admin)).status_code == 200
        listed = (await client.get("/v1/runs", headers=admin)).json()["data"]
        assert [r["id"] for r in listed] == [run_id]
        cancelled = await client.post(f"/v1/runs/{run_id}/cancel", headers=admin)
        assert cancelled.status_code == 200
