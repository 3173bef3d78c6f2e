"""`GET /v1/usage` (issue 28 §4, its first part): what a project's jobs used, grouped, with
the price table's estimated cost, over real HTTP on both dialects. The jobs are submitted
through the API; their times are then set in the database, so every figure is known."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import update

from app.db import create_engine
from app.jobs.statements import jobs
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
        for params, field in (
            ({"group_by": "week"}, "group_by"),
            ({"from": "yesterday"}, "from"),
        ):
            bad = await c.get("/v1/usage", params=params, headers=a_read)
            assert bad.status_code == 422, bad.text
            assert bad.json()["errors"][0]["path"] == field
        backwards = await c.get(
            "/v1/usage",
            params={"from": "2026-11-22T00:00:00Z", "to": "2026-11-19T00:00:00Z"},
            headers=a_read,
        )
        assert backwards.status_code == 200 and backwards.json()["data"] == []
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
