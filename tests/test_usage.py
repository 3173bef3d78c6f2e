"""Usage and cost (issue 28 §4): `GET /v1/usage`, the `usage` and `cost` of jobs and runs,
and a run priced by a dry run, over real HTTP on both dialects. The jobs are submitted
through the API; their times and tokens are then set in the database (as their final write
sets them), so every figure is known."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, insert, select, update

from app.db import Base, create_engine
from app.jobs.lifecycle import JobKind
from app.jobs.payloads import Payload
from app.jobs.statements import jobs
from app.jobs.store import enqueue, new_job
from app.models import GatewayUsageRow
from app.rollouts.sampling import tokens_of
from app.runs.schedule import child_id
from app.tenants.metering import tokens_in
from app.training import tokens
from tests import factories as f
from tests.test_projects import FRESH, ROOT, bearer, key, project

DAY = datetime(2026, 11, 20, tzinfo=UTC)
PRICES = {"trainer_hour": 3.6, "trainer_hour:dry-run": 7.2, "rollout_hour": 1.8}
WINDOW = {"from": "2026-11-19T00:00:00Z", "to": "2026-11-22T00:00:00Z"}


async def _times(database_url: str, job_id: str, **values: object) -> None:
    engine = create_engine(database_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(update(jobs).where(jobs.c.id == job_id).values(**values))
    finally:
        await engine.dispose()


async def _project_with_a_job(c) -> tuple[str, dict[str, str], str]:
    """Project `a`, a write key of it, its model `a1` and a training job of that model."""
    a = await project(c, "a")
    headers = bearer((await key(c, a, "write", "read"))["secret"])
    assert (await c.post("/v1/models", json=f.model_body("a1"), headers=headers)).is_success
    return a, headers, await _job(c, headers, "a1")


async def _quota_seconds(database_url: str, project_id: str, now: datetime) -> float:
    """What the daily trainer-seconds quota counts for the project at `now`."""
    from sqlalchemy.ext.asyncio import AsyncSession

    from app.jobs.quotas import trainer_seconds

    engine = create_engine(database_url)
    try:
        async with AsyncSession(engine) as session:
            return await trainer_seconds(session, project_id, now)
    finally:
        await engine.dispose()


async def _job(c, headers, model: str) -> str:
    made = await c.post(
        "/v1/training-jobs",
        json={"model": model, "collection": f.nat_collection()},
        headers=headers,
    )
    assert made.status_code == 202, made.text
    return str(made.json()["id"])


async def test_usage_is_grouped_priced_and_kept_to_the_project(serve, database_url: str) -> None:
    async with serve(**FRESH, prices=PRICES, price_currency="EUR") as live:
        c = live.client
        a, b = await project(c, "a"), await project(c, "b")
        a_read = bearer((await key(c, a, "read"))["secret"])
        a_write = bearer((await key(c, a, "write"))["secret"])
        b_write = bearer((await key(c, b, "write"))["secret"])
        for name, headers in (("a1", a_write), ("a2", a_write), ("b1", b_write)):
            assert (await c.post("/v1/models", json=f.model_body(name), headers=headers)).is_success
        # a1: 600 s on day 1, 1200 s on day 2 (failed counts too); a2: 300 s on day 2;
        # one still queued (never started) and one of b: not a's.
        spans = [
            ("a1", a_write, DAY, DAY + timedelta(seconds=600), "succeeded"),
            (
                "a1",
                a_write,
                DAY + timedelta(days=1),
                DAY + timedelta(days=1, seconds=1200),
                "failed",
            ),
            (
                "a2",
                a_write,
                DAY + timedelta(days=1, hours=5),
                DAY + timedelta(days=1, hours=5, seconds=300),
                "succeeded",
            ),
            ("b1", b_write, DAY, DAY + timedelta(seconds=3600), "succeeded"),
        ]
        for model, headers, started, finished, status in spans:
            job_id = await _job(c, headers, model)
            await _times(
                database_url, job_id, status=status, started_at=started, finished_at=finished
            )
        await _job(c, a_write, "a2")  # queued: not counted

        by_day = await c.get("/v1/usage", params={**WINDOW, "group_by": "day"}, headers=a_read)
        assert by_day.status_code == 200, by_day.text
        body = by_day.json()
        assert body["currency"] == "EUR" and body["group_by"] == "day"
        rows = {r["group"]: r for r in body["data"]}
        assert set(rows) == {"2026-11-20", "2026-11-21"}
        assert rows["2026-11-20"]["trainer_seconds"] == pytest.approx(600)
        assert rows["2026-11-21"]["trainer_seconds"] == pytest.approx(1500)
        assert rows["2026-11-21"]["jobs"] == 2
        # dry-run's own price: 7.2 an hour, so 2100 s cost 4.2.
        assert body["total"]["cost"] == pytest.approx(4.2)
        assert body["total"]["rollout_seconds"] == 0

        by_model = (
            await c.get("/v1/usage", params={**WINDOW, "group_by": "model"}, headers=a_read)
        ).json()
        assert {r["group"]: r["trainer_seconds"] for r in by_model["data"]} == {
            "a1": pytest.approx(1800),
            "a2": pytest.approx(300),
        }
        # An admin sees every project, or one.
        every = await c.get("/v1/usage", params={**WINDOW, "group_by": "kind"}, headers=ROOT)
        assert every.json()["total"]["trainer_seconds"] == pytest.approx(5700)
        only_b = await c.get("/v1/usage", params={**WINDOW, "project_id": b}, headers=ROOT)
        assert only_b.json()["total"]["trainer_seconds"] == pytest.approx(3600)
        # Another project's usage is no project of the key's; bad queries name the field.
        theirs = await c.get("/v1/usage", params={"project_id": b}, headers=a_read)
        assert theirs.status_code == 404 and theirs.json()["errors"][0]["path"] == "project_id"
        backwards = {"from": "2026-11-22T00:00:00Z", "to": "2026-11-19T00:00:00Z"}
        for params, field in (
            ({"group_by": "week"}, "group_by"),
            ({"from": "yesterday"}, "from"),
            (backwards, "from"),  # a window that holds no time
            ({"from": WINDOW["to"], "to": WINDOW["to"]}, "from"),
        ):
            bad = await c.get("/v1/usage", params=params, headers=a_read)
            assert bad.status_code == 422, bad.text
            assert bad.json()["errors"][0]["path"] == field
        outside = await c.get(
            "/v1/usage",
            params={"from": "2026-11-22T00:00:00Z", "to": "2026-11-23T00:00:00Z"},
            headers=a_read,
        )
        assert outside.json()["data"] == [] and outside.json()["total"]["jobs"] == 0


async def test_a_price_table_with_an_unknown_unit_is_refused_at_start() -> None:
    from pydantic import ValidationError

    from app.settings import Settings

    for prices in ({"gpu_hour": 1.0}, {"trainer_hour:": 1.0}, {"rollout_hour": -1.0}):
        with pytest.raises(ValidationError, match="price"):
            Settings(prices=prices)


TOKEN_PRICES = {
    "trainer_hour": 3.6,
    "sampled_mtok": 2.0,
    "sampled_mtok:dry-run": 4.0,  # the backend's own
    "trained_mtok": 10.0,
}


async def _gateway_row(database_url: str, **values: object) -> None:
    engine = create_engine(database_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(insert(GatewayUsageRow.__table__).values(**values))
    finally:
        await engine.dispose()


async def test_jobs_show_their_usage_and_cost_and_usage_counts_tokens_and_keys(
    serve, database_url: str
) -> None:
    async with serve(**FRESH, prices=TOKEN_PRICES) as live:
        c = live.client
        a = await project(c, "a")
        writer = await key(c, a, "write")
        headers = bearer(writer["secret"])
        assert (await c.post("/v1/models", json=f.model_body("a1"), headers=headers)).is_success
        trained = await _job(c, headers, "a1")
        sampled = await _job(c, headers, "a1")
        await _times(
            database_url,
            trained,
            status="succeeded",
            started_at=DAY,
            finished_at=DAY + timedelta(seconds=600),
            trained_tokens=1000,
        )
        # A sampling job's ledger, as a rollout's final write leaves it.
        await _times(
            database_url,
            sampled,
            kind="rollout",
            status="succeeded",
            started_at=DAY + timedelta(days=1),
            finished_at=DAY + timedelta(days=1, seconds=1800),
            prompt_tokens=300,
            completion_tokens=700,
        )
        await _gateway_row(
            database_url,
            created_at=DAY + timedelta(days=1, hours=1),
            project_id=a,
            key_id=writer["id"],
            model="a1",
            prompt_tokens=100,
            completion_tokens=400,
        )
        job = (await c.get(f"/v1/training-jobs/{trained}", headers=headers)).json()
        queued = (await c.post("/v1/training-jobs", json=_body("a1"), headers=headers)).json()
        by_key = (
            await c.get("/v1/usage", params={**WINDOW, "group_by": "key"}, headers=headers)
        ).json()
        by_kind = (
            await c.get("/v1/usage", params={**WINDOW, "group_by": "kind"}, headers=headers)
        ).json()
        by_model = (
            await c.get("/v1/usage", params={**WINDOW, "group_by": "model"}, headers=headers)
        ).json()

    assert job["usage"] == {
        "prompt_tokens": None,
        "completion_tokens": None,
        "trained_tokens": 1000,
        "trainer_seconds": 600.0,
        "rollout_seconds": None,
    }
    # 600 s at 3.6 an hour, 1000 tokens at 10 a million.
    assert job["cost"]["trainer"] == pytest.approx(0.6)
    assert job["cost"]["trained"] == pytest.approx(0.01)
    assert job["cost"]["amount"] == pytest.approx(0.61)
    assert queued["usage"]["trainer_seconds"] is None and queued["cost"]["amount"] == 0
    # The jobs the key submitted and its gateway calls, under its id.
    (row,) = by_key["data"]
    assert row["group"] == writer["id"]
    assert (row["jobs"], row["gateway_calls"]) == (2, 1)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (400, 1100)
    assert row["trained_tokens"] == 1000
    # Sampled at dry-run's own 4 a million: 1500 tokens; trained 0.01; trainer time 0.6.
    assert by_key["total"]["cost"] == pytest.approx(0.6 + 0.01 + 1500 * 4e-6)
    kinds = {r["group"]: r for r in by_kind["data"]}
    assert set(kinds) == {"training", "rollout", "gateway"}
    assert kinds["gateway"]["prompt_tokens"] == 100
    assert kinds["rollout"]["rollout_seconds"] == pytest.approx(1800)
    assert [r["group"] for r in by_model["data"]] == ["a1"]
    assert "checkpoint_bytes" in by_model["data"][0]
    assert all(r["checkpoint_bytes"] is None for r in by_kind["data"])


def _body(model: str) -> dict[str, object]:
    return {"model": model, "collection": f.nat_collection()}


async def test_the_daily_quota_and_usage_count_the_same_clipped_seconds(
    serve, database_url: str
) -> None:
    """A job that ran across midnight: the day's quota counts only its part of the day,
    and so does a window that starts at that midnight."""
    async with serve(**FRESH) as live:
        c = live.client
        a, headers, job_id = await _project_with_a_job(c)
        midnight = DAY + timedelta(days=1)
        await _times(
            database_url,
            job_id,
            status="succeeded",
            started_at=midnight - timedelta(seconds=300),
            finished_at=midnight + timedelta(seconds=900),
        )
        window = {"from": "2026-11-21T00:00:00Z", "to": "2026-11-22T00:00:00Z"}
        used = (await c.get("/v1/usage", params=window, headers=headers)).json()
        both = (await c.get("/v1/usage", params=WINDOW, headers=headers)).json()
        today = await _quota_seconds(database_url, a, midnight + timedelta(hours=1))
    assert used["total"]["trainer_seconds"] == pytest.approx(900)
    assert today == pytest.approx(900)
    # A window holding all of it counts all of it, on the day it started.
    assert both["total"]["trainer_seconds"] == pytest.approx(1200)
    assert [r["group"] for r in both["data"]] == ["2026-11-20"]


def test_tokens_are_read_from_answers_and_counted_in_what_is_trained() -> None:
    answer = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5}}
    assert tokens_of(answer) == (12, 5)
    assert tokens_of({"choices": []}) == (0, 0)
    assert tokens_of({"usage": {"prompt_tokens": True, "completion_tokens": -3}}) == (0, 0)
    streamed = (
        b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,'
        b'"total_tokens":10}}\n\ndata: [DONE]\n\n'
    )
    assert tokens_in(streamed) == (7, 3)
    assert tokens_in(b'{"choices":[]}') is None
    # A sampled choice counts a token per logprob; other text at 4 bytes a token.
    choice = {
        "message": {"role": "assistant", "content": "ignored"},
        "logprobs": {"content": [{}] * 3},
    }
    group = {
        "trajectories": [{"messages_and_choices": [{"role": "user", "content": "12345"}, choice]}]
    }
    assert tokens.count([group]) == 2 + 3


async def _count_rows(database_url: str) -> dict[str, int]:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            return {
                table.name: int(await conn.scalar(select(func.count()).select_from(table)) or 0)
                for table in Base.metadata.sorted_tables
            }
    finally:
        await engine.dispose()


async def _child(database_url: str, run_id: str, role: str, **values: object) -> None:
    engine = create_engine(database_url)
    try:
        async with engine.begin() as conn:
            kind = JobKind.training if role == "training" else JobKind.rollout
            new = new_job(
                kind,
                job_id=child_id(run_id, role, 1),  # type: ignore[arg-type]
                model="demo",
                payload=Payload("test", b"", 0),
                summary={},
                request_hash="x",
                max_attempts=1,
                metadata={"run": run_id},
            )
            await enqueue(conn, new)
            await conn.execute(update(jobs).where(jobs.c.id == new.id).values(**values))
    finally:
        await engine.dispose()


@pytest.mark.torch
async def test_a_dry_run_prices_a_run_and_stores_nothing_and_a_run_sums_its_children(
    serve, database_url: str, tmp_path
) -> None:
    from app.backends.tiny_model import make_tiny_model
    from tests.test_runs import run_body, toy_lines, upload

    tiny = make_tiny_model(tmp_path / "models" / "tiny")
    prices = {"sampled_mtok": 1000.0, "trainer_hour": 3600.0}
    async with serve(
        model_roots=[tiny.parent], demo_model=True, worker_enabled=False, prices=prices
    ) as live:
        c = live.client
        dataset = await upload(c, toy_lines(8, 2))
        before = await _count_rows(database_url)
        priced = await c.post("/v1/run-estimates", json=run_body(dataset["id"]))
        bad_body = run_body(dataset["id"])
        bad_body["recipe"] = {**bad_body["recipe"], "num_generations": 1}
        bad = await c.post("/v1/run-estimates", json=bad_body)
        after = await _count_rows(database_url)
        made = await c.post("/v1/runs", json=run_body(dataset["id"]))
        assert made.status_code == 202, made.text
        run_id = made.json()["id"]
        assert made.json()["usage"]["trained_tokens"] is None
        await _child(
            database_url,
            run_id,
            "rollout",
            status="succeeded",
            started_at=DAY,
            finished_at=DAY + timedelta(seconds=30),
            prompt_tokens=10,
            completion_tokens=20,
        )
        await _child(
            database_url,
            run_id,
            "training",
            status="succeeded",
            started_at=DAY + timedelta(seconds=30),
            finished_at=DAY + timedelta(seconds=90),
            trained_tokens=500,
        )
        run = (await c.get(f"/v1/runs/{run_id}")).json()
        listed = (await c.get("/v1/runs")).json()["data"]

    assert priced.status_code == 200, priced.text
    estimate = priced.json()
    # 24 steps of 4 examples x 8 answers at 1 token; 9 validations (the start step's, then
    # every 3 steps) of 2 examples x 16 answers.
    assert (estimate["total_steps"], estimate["validations"]) == (24, 9)
    assert estimate["samples"] == 24 * 4 * 8 + 9 * 2 * 16
    assert estimate["usage"]["completion_tokens"] == 24 * 4 * 8 + 9 * 2 * 16
    assert estimate["usage"]["trainer_seconds"] is None  # no job of the model ran yet
    assert any("trainer_seconds: null" in note for note in estimate["notes"])
    sampled = estimate["usage"]["prompt_tokens"] + estimate["usage"]["completion_tokens"]
    assert estimate["cost"]["sampled"] == pytest.approx(sampled * 1000 / 1e6)
    assert bad.status_code == 422 and bad.json()["errors"][0]["path"] == "recipe.num_generations"
    # A dry run, good or bad, stores nothing; the audit log records it, as every POST.
    assert after.pop("audit_events") == before.pop("audit_events") + 2
    assert after == before
    assert run["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "trained_tokens": 500,
        "trainer_seconds": 60.0,
        "rollout_seconds": 30.0,
    }
    assert run["cost"]["sampled"] == pytest.approx(30 * 1000 / 1e6)
    assert run["cost"]["trainer"] == pytest.approx(60.0)
    assert listed[0]["usage"] == run["usage"]


async def test_every_attempt_of_a_retried_job_counts_its_seconds(
    serve, database_url: str, store
) -> None:
    """An attempt sent back to the queue keeps its seconds (to its lease's end, for a worker
    that died), the wait for a retry adds none, and the job's usage, `GET /v1/usage`, the
    daily quota and the run-free sum all count every attempt. The claims' times are set in
    the rows, relative to the clock the writes read: nothing waits on a clock."""
    from app.jobs.lifecycle import ErrorInfo, Retry, Succeeded

    error = ErrorInfo(type="ConnectionError", message="refused", transient=True)
    async with serve(**FRESH) as live:
        c = live.client
        a, headers, job_id = await _project_with_a_job(c)

        async def attempt(claimed_ago: float, lease_ended_ago: float | None = None) -> Any:
            [claim] = await store.claim(owner="w1", lease_seconds=30, limit=1)
            now = datetime.now(UTC)
            values: dict[str, Any] = {"started_at": now - timedelta(seconds=claimed_ago)}
            if lease_ended_ago is not None:
                values["lease_expires_at"] = now - timedelta(seconds=lease_ended_ago)
            await _times(database_url, job_id, **values)
            return claim.lease

        async def seconds() -> float:
            job = (await c.get(f"/v1/training-jobs/{job_id}", headers=headers)).json()
            return float(job["usage"]["trainer_seconds"])

        # Attempt 1: claimed 100 s ago, sent back now by an error.
        assert await store.apply(await attempt(100), Retry(error, 0)) == "queued"
        waiting = await seconds()
        assert waiting == pytest.approx(100, abs=10)
        # Waiting for the retry counts nothing: the job's seconds stay where they were.
        await asyncio.sleep(0.05)
        assert await seconds() == waiting
        # Attempt 2: claimed 80 s ago; its worker died and its lease ended 50 s ago.
        lease = await attempt(80, lease_ended_ago=50)
        assert await store.apply(lease, Retry(error, 0), only_if_expired=True) == "queued"
        assert await seconds() == pytest.approx(waiting + 30, abs=1)
        # Attempt 3: claimed 20 s ago, succeeds now.
        assert await store.apply(await attempt(20), Succeeded({})) == "succeeded"
        total = await seconds()
        assert total == pytest.approx(150, abs=10)

        # Moved to a day of its own: the window and the day's quota count every attempt.
        row = (await c.get(f"/v1/training-jobs/{job_id}", headers=headers)).json()
        last = (
            datetime.fromisoformat(row["finished_at"]) - datetime.fromisoformat(row["started_at"])
        ).total_seconds()
        start = DAY + timedelta(hours=10)
        await _times(
            database_url,
            job_id,
            started_at=start,
            finished_at=start + timedelta(seconds=last),
        )
        window = {"from": "2026-11-20T00:00:00Z", "to": "2026-11-21T00:00:00Z"}
        used = (await c.get("/v1/usage", params=window, headers=headers)).json()
        assert used["total"]["trainer_seconds"] == pytest.approx(total, abs=0.01)
        before = {"from": "2026-11-19T00:00:00Z", "to": "2026-11-20T00:00:00Z"}
        assert (await c.get("/v1/usage", params=before, headers=headers)).json()["total"][
            "trainer_seconds"
        ] == 0
        today = await _quota_seconds(database_url, a, start + timedelta(hours=1))
        assert today == pytest.approx(total, abs=0.01)

        # Sent back after 60 s, then cancelled while it waits: its attempt counts once.
        job_id = await _job(c, headers, "a1")
        assert await store.apply(await attempt(60), Retry(error, 60)) == "queued"
        cancelled = await c.post(f"/v1/training-jobs/{job_id}/cancel", headers=headers)
        assert cancelled.json()["status"] == "cancelled", cancelled.text
        assert await seconds() == pytest.approx(60, abs=10)
