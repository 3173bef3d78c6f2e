"""Evaluation jobs end to end on the cpu backend (the tiny model): a step resolved when the
job is accepted, every answer stored with its score or error and paged, the summary as the
stored rows give it, two steps compared, bad input refused, and a worker killed mid-job
whose retry adds no row twice."""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from app.backends.tiny_model import make_tiny_model
from app.models import EvaluationResultRow
from tests.conftest import LiveServer
from tests.processes import PATIENCE

pytestmark = pytest.mark.torch
EXAMPLES = [
    {"id": f"q{i}", "messages": [{"role": "user", "content": f"say {w}"}], "expected": w}
    for i, w in enumerate(["yes", "no", "a", "b", "c"])
]
SAMPLING = {"max_tokens": 2, "temperature": 1.0}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("evaluation-models") / "tiny")


@pytest.fixture
def serve(serve: Callable[..., LiveServer], tiny_model: Path) -> Callable[..., LiveServer]:
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


async def cpu_model(client: httpx.AsyncClient, base: Path, name: str = "toy") -> None:
    response = await client.post(
        "/v1/models", json={"name": name, "base_model": str(base), "backend": "cpu"}
    )
    assert response.status_code == 201, response.text


async def train_a_step(client: httpx.AsyncClient, name: str) -> None:
    """One SFT step, so the model has steps 0 and 1."""
    body = {
        "model": name,
        "method": "sft",
        "examples": [
            {
                "messages": [
                    {"role": "user", "content": e["messages"][0]["content"]},
                    {"role": "assistant", "content": e["expected"]},
                ]
            }
            for e in EXAMPLES
        ],
        "hyperparameters": {"learning_rate": 0.05, "batch_size": 5},
    }
    response = await client.post("/v1/training-jobs", json=body)
    assert response.status_code == 202, response.text
    job = await wait_job(client, f"/v1/training-jobs/{response.json()['id']}")
    assert job["status"] == "succeeded", job["error"]


async def evaluate(client: httpx.AsyncClient, **body: Any) -> dict:
    body = {"grader": {"type": "contains"}, "sampling": SAMPLING, **body}
    response = await client.post("/v1/evaluation-jobs", json=body)
    assert response.status_code == 202, response.text
    assert response.headers["location"] == f"/v1/evaluation-jobs/{response.json()['id']}"
    return response.json()


async def all_results(client: httpx.AsyncClient, job_id: str, limit: int) -> list[dict]:
    rows: list[dict] = []
    after = None
    while True:
        params: dict[str, Any] = {"limit": limit}
        if after:
            params["after"] = after
        page = (await client.get(f"/v1/evaluation-jobs/{job_id}/results", params=params)).json()
        rows += page["data"]
        if not page["has_more"]:
            return rows
        after = page["next_cursor"]


def expected_stats(rows: list[dict]) -> dict[int, tuple[float, float, float, float]]:
    by: dict[int, list[float]] = {}
    for row in rows:
        if row["score"] is not None:
            by.setdefault(row["example"], []).append(row["score"])
    out = {}
    for example, scores in by.items():
        mean = sum(scores) / len(scores)
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
        out[example] = (mean, min(scores), max(scores), std)
    return out


async def test_an_evaluation_stores_pages_and_sums_up_its_answers(serve, tiny_model) -> None:
    async with serve(worker_enabled=True) as live:
        client = live.client
        await cpu_model(client, tiny_model)
        job = await evaluate(client, model="toy", examples=EXAMPLES, samples_per_example=3)
        assert job["summary"]["step"] == 0 and job["summary"]["num_samples"] == 15
        done = await wait_job(client, f"/v1/evaluation-jobs/{job['id']}")
        rows = await all_results(client, job["id"], limit=4)
        report = (await client.get(f"/v1/evaluation-jobs/{job['id']}/summary")).json()
        listed = (await client.get("/v1/evaluation-jobs", params={"status": "succeeded"})).json()
        events = (await client.get(f"/v1/evaluation-jobs/{job['id']}/events")).json()
    assert done["status"] == "succeeded", done["error"]
    # Every answer, once, in (example, sample) order, across pages of 4.
    assert [(r["example"], r["sample"]) for r in rows] == [
        (e, s) for e in range(5) for s in range(3)
    ]
    assert [r["example_id"] for r in rows[::3]] == [e["id"] for e in EXAMPLES]
    for row in rows:
        assert (row["score"] is None) != (row["error"] is None)
        if row["score"] is not None:  # contains: 1 when the answer holds the expected word
            word = EXAMPLES[row["example"]]["expected"]
            assert row["score"] == (1.0 if word in row["answer"] else 0.0)
    scores = [r["score"] for r in rows if r["score"] is not None]
    summary = done["summary"]
    assert summary["num_scored"] == len(scores)
    assert summary["num_errors"] == 15 - len(scores)
    assert summary["mean_score"] == pytest.approx(sum(scores) / len(scores))
    assert summary["pass_rate"] == pytest.approx(sum(s > 0 for s in scores) / len(scores))
    assert report["mean_score"] == pytest.approx(summary["mean_score"])
    expected = expected_stats(rows)
    assert [e["example"] for e in report["examples"]] == list(range(5))
    for stat in report["examples"]:
        mean, low, high, std = expected[stat["example"]]
        assert stat["mean"] == pytest.approx(mean) and stat["stddev"] == pytest.approx(
            std, abs=1e-6
        )
        assert (stat["min"], stat["max"]) == (low, high)
        assert stat["num_scored"] + stat["num_errors"] == 3
    assert job["id"] in [j["id"] for j in listed["data"]]
    types = [e["type"] for e in events["data"]]
    assert types[0] == "job_queued" and "evaluation_started" in types
    assert types[-1] == "evaluation_ended"


async def test_the_step_is_fixed_when_accepted_and_two_steps_compare(serve, tiny_model) -> None:
    async with serve(worker_enabled=True) as live:
        client = live.client
        await cpu_model(client, tiny_model)
        lines = [{**e, "split": "validation"} for e in EXAMPLES]
        upload = await client.post(
            "/v1/datasets?name=words",
            content=b"\n".join(json.dumps(line).encode() for line in lines),
            headers={"Content-Type": "application/jsonl"},
        )
        assert upload.status_code == 201, upload.text
        # Accepted at step 0 while queued behind the training job: it evaluates step 0.
        dataset = {"name": "words", "split": "validation"}
        base = await evaluate(client, model="toy", dataset=dataset, samples_per_example=2)
        await train_a_step(client, "toy")
        alias = await client.put("/v1/models/toy/aliases/first", json={"step": 1})
        assert alias.status_code in (200, 201), alias.text
        trained = await evaluate(
            client, model="toy@first", dataset={"id": upload.json()["id"]}, samples_per_example=2
        )
        inline = await evaluate(client, model="toy@1", examples=EXAMPLES[:2])
        jobs = [await wait_job(client, f"/v1/evaluation-jobs/{j['id']}") for j in (base, trained)]
        await wait_job(client, f"/v1/evaluation-jobs/{inline['id']}")
        compared = await client.get(
            "/v1/evaluation-jobs/compare", params={"a": base["id"], "b": trained["id"]}
        )
        other = await client.get(
            "/v1/evaluation-jobs/compare", params={"a": base["id"], "b": inline["id"]}
        )
        unknown = await client.get(
            "/v1/evaluation-jobs/compare", params={"a": base["id"], "b": "job_nope"}
        )
        reports = [
            (await client.get(f"/v1/evaluation-jobs/{j['id']}/summary")).json() for j in jobs
        ]
    assert [j["status"] for j in jobs] == ["succeeded", "succeeded"]
    assert [j["summary"]["step"] for j in jobs] == [0, 1]
    assert jobs[0]["summary"]["examples_sha256"] == jobs[1]["summary"]["examples_sha256"]
    assert compared.status_code == 200, compared.text
    body = compared.json()
    assert (body["a_step"], body["b_step"], body["num_examples"]) == (0, 1, 5)
    means = [{e["example"]: e["mean"] for e in r["examples"]} for r in reports]
    for delta in body["examples"]:
        a, b = means[0].get(delta["example"]), means[1].get(delta["example"])
        assert (delta["a"], delta["b"]) == (a, b)
        if a is not None and b is not None:
            assert delta["delta"] == pytest.approx(b - a)
    known = [d["delta"] for d in body["examples"] if d["delta"] is not None]
    assert body["wins"] == sum(d > 0 for d in known) and body["losses"] == sum(d < 0 for d in known)
    assert body["wins"] + body["losses"] + body["ties"] == len(known)
    if known:
        assert body["mean_delta"] == pytest.approx(sum(known) / len(known))
    assert other.status_code == 409
    assert other.headers["content-type"].startswith("application/problem+json")
    assert unknown.status_code == 404
    assert unknown.json()["detail"] == "no evaluation job 'job_nope'"
    assert [(e["location"], e["path"]) for e in unknown.json()["errors"]] == [("query", "b")]


def _paths(response: httpx.Response) -> list[str]:
    return [e["path"] for e in response.json().get("errors") or []]


async def test_bad_input_is_refused_naming_the_field_and_stores_nothing(serve, tiny_model) -> None:
    async with serve(worker_enabled=False) as live:
        client = live.client
        await cpu_model(client, tiny_model)
        await client.post(
            "/v1/models", json={"name": "dry", "base_model": "x", "backend": "dry-run"}
        )
        grader = {"type": "exact_match"}

        async def post(**body: Any) -> httpx.Response:
            return await client.post("/v1/evaluation-jobs", json={"grader": grader, **body})

        unknown_model = await post(model="nope", examples=EXAMPLES)
        future_step = await post(model="toy@7", examples=EXAMPLES)
        unknown_alias = await post(model="toy@nope", examples=EXAMPLES)
        dry = await post(model="dry", examples=EXAMPLES)
        both = await post(model="toy", examples=EXAMPLES, dataset={"name": "words"})
        neither = await post(model="toy")
        too_many = await post(model="toy", examples=EXAMPLES, samples_per_example=65)
        no_grader = await client.post(
            "/v1/evaluation-jobs", json={"model": "toy", "examples": EXAMPLES}
        )
        no_expected = await post(
            model="toy", examples=[{"id": 1, "messages": [{"role": "user", "content": "hi"}]}]
        )
        no_dataset = await post(model="toy", dataset={"name": "nope"})
        twice = await post(model="toy", examples=[EXAMPLES[0], {**EXAMPLES[1], "id": "q0"}])
        empty_id = await post(model="toy", examples=[{**EXAMPLES[0], "id": ""}])
        # A webhook grader's address the egress policy refuses is refused at submission, as
        # a rollout's is (not later, answer by answer).
        metadata_address = {"type": "webhook", "url": "http://169.254.169.254/latest"}
        mapped = {"type": "webhook", "url": "http://[::ffff:a9fe:a9fe]/x"}
        egress = [
            await client.post(
                "/v1/evaluation-jobs", json={"model": "toy", "examples": EXAMPLES, "grader": g}
            )
            for g in (metadata_address, mapped)
        ]
        bad_cursor = await client.get("/v1/evaluation-jobs/job_x/results")
        listed = (await client.get("/v1/evaluation-jobs")).json()
    assert unknown_model.status_code == 404 and _paths(unknown_model) == ["model"]
    assert future_step.status_code == 404 and _paths(future_step) == ["model"]
    assert unknown_alias.status_code == 404 and _paths(unknown_alias) == ["model"]
    assert dry.status_code == 422 and _paths(dry) == ["model"]
    assert "sample" in dry.json()["errors"][0]["message"]
    assert both.status_code == 422 and neither.status_code == 422
    assert too_many.status_code == 422 and _paths(too_many) == ["samples_per_example"]
    assert no_grader.status_code == 422 and _paths(no_grader) == ["grader"]
    assert no_expected.status_code == 422 and _paths(no_expected) == ["examples[0].expected"]
    assert no_dataset.status_code == 404 and _paths(no_dataset) == ["dataset.name"]
    assert twice.status_code == 422 and _paths(twice) == ["examples[1].id"], twice.text
    assert empty_id.status_code == 422 and _paths(empty_id) == ["examples[0].id"], empty_id.text
    for refused in egress:
        assert refused.status_code == 422 and _paths(refused) == ["grader.webhook.url"], (
            refused.text
        )
    assert bad_cursor.status_code == 404
    for response in (unknown_model, dry, both, no_expected):
        assert response.headers["content-type"].startswith("application/problem+json")
    assert listed["data"] == []


async def test_idempotency_key_replays_the_job(serve, tiny_model) -> None:
    async with serve(worker_enabled=False) as live:
        await cpu_model(live.client, tiny_model)
        body = {"model": "toy", "examples": EXAMPLES, "grader": {"type": "contains"}}
        headers = {"Idempotency-Key": "eval-1"}
        first = await live.client.post("/v1/evaluation-jobs", json=body, headers=headers)
        again = await live.client.post("/v1/evaluation-jobs", json=body, headers=headers)
        cancel = await live.client.post(f"/v1/evaluation-jobs/{first.json()['id']}/cancel")
    assert first.status_code == again.status_code == 202
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled"


@pytest.mark.slow
async def test_a_worker_killed_mid_job_is_retried_without_a_row_twice(
    serve, tiny_model, make_settings
) -> None:
    from tests.processes import start_worker, stop, until
    from tests.test_worker_processes import kill_when

    examples = [
        {"id": i, "messages": [{"role": "user", "content": f"count {i}"}], "expected": "1"}
        for i in range(80)
    ]
    async with serve(worker_enabled=False) as live:
        client = live.client
        settings = live.app.state.settings
        await cpu_model(client, tiny_model)
        job = await evaluate(
            client,
            model="toy",
            examples=examples,
            samples_per_example=2,
            concurrency=1,
            sampling={"max_tokens": 4, "temperature": 1.0},
        )
        url = f"/v1/evaluation-jobs/{job['id']}"
        sessions = live.app.state.sessions

        async def stored() -> int:
            async with sessions() as session:
                return int(
                    await session.scalar(
                        select(func.count()).where(EvaluationResultRow.job_id == job["id"])
                    )
                    or 0
                )

        async def part_done() -> bool:
            return 0 < await stored() < 160

        env = {"TRAINYARD_MODEL_ROOTS": str(tiny_model.parent), "TRAINYARD_WORKER_BACKENDS": "cpu"}
        first = start_worker(settings, **env)
        try:
            await until(part_done, timeout=300, what="some answers stored")
            await kill_when(first, part_done, what="a job part done")
        finally:
            stop(first)
        before = await stored()
        second = start_worker(settings, **env)
        try:
            done = await until(
                lambda: _final(client, url), timeout=300, what="the retried job to end"
            )
        finally:
            stop(second)
        rows = await all_results(client, job["id"], limit=500)
        events = (await client.get(f"{url}/events", params={"limit": 200})).json()
    assert 0 < before < 160
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 2
    places = [(r["example"], r["sample"]) for r in rows]
    assert places == [(e, s) for e in range(80) for s in range(2)]  # each once
    assert done["summary"]["num_scored"] + done["summary"]["num_errors"] == 160
    started = [e["data"] for e in events["data"] if e["type"] == "evaluation_started"]
    assert started[-1]["resumed"] > 0  # the retry went on from the examples complete


async def _final(client: httpx.AsyncClient, url: str) -> dict | None:
    job = (await client.get(url)).json()
    return job if job["status"] in {"succeeded", "failed", "cancelled"} else None


async def test_the_cli_submits_watches_and_shows_an_evaluation(serve, tiny_model, tmp_path) -> None:
    from tests.test_client_cli import run_cli

    body = {
        "model": "toy@latest",
        "examples": EXAMPLES[:2],
        "grader": {"type": "contains"},
        "samples_per_example": 2,
        "sampling": SAMPLING,
    }
    job_file = tmp_path / "evaluation.json"
    job_file.write_text(json.dumps(body))
    async with serve(worker_enabled=True) as live:
        await cpu_model(live.client, tiny_model)

        def cli(*args: str) -> Any:
            return run_cli("--json", *args, url=live.url)

        submitted = await asyncio.to_thread(cli, "submit", str(job_file), "--watch")
        job_id = submitted.json_lines()[0]["job_id"]
        shown = await asyncio.to_thread(cli, "jobs", "get", job_id)
        results = await asyncio.to_thread(cli, "evaluations", "results", job_id)
        summary = await asyncio.to_thread(cli, "evaluations", "summary", job_id)
        compared = await asyncio.to_thread(cli, "evaluations", "compare", job_id, job_id)
    assert submitted.code == 0, submitted.err
    assert json.loads(shown.out)["summary"]["step"] == 0  # found by its id alone
    assert len(json.loads(results.out)["data"]) == 4
    assert json.loads(summary.out)["num_examples"] == 2
    comparison = json.loads(compared.out)
    assert comparison["losses"] == comparison["wins"] == 0  # a job against itself
