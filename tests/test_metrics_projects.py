"""Per-project counters on `/metrics` (issue 28 §4): jobs submitted and finished, trainer
seconds, read from the job event log at scrape time; and who may read `/metrics` (its labels
name every project and model). Over real HTTP, with a real worker, on both dialects."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Interval, func, literal, select, update
from sqlalchemy.ext.asyncio import async_sessionmaker

from app.db import write_connection
from app.jobs.lifecycle import JobKind
from app.jobs.store import QueueStore, enqueue, new_job
from app.metrics import ProjectCounters, job_events, jobs
from app.models import DEFAULT_PROJECT_ID
from tests import factories as f
from tests.processes import until
from tests.test_projects import FRESH, ROOT, bearer, key, project
from tests.test_store import _job as _stored_job
from tests.test_store import _model, _payload
from tests.test_usage import _job


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the exposition `text` (0 when it is not there)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(wanted)}\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_counters_by_project_grow_as_jobs_end(serve) -> None:
    async with serve(**FRESH, worker_enabled=True) as live:
        c = live.client
        a, b = await project(c, "a"), await project(c, "b")
        a_write = bearer((await key(c, a, "write"))["secret"])
        b_write = bearer((await key(c, b, "write"))["secret"])
        for name, headers in (("a1", a_write), ("b1", b_write)):
            made = await c.post("/v1/models", json=f.model_body(name), headers=headers)
            assert made.status_code == 201, made.text
        slow = f.model_body("b-slow", seconds_per_step=600)
        assert (await c.post("/v1/models", json=slow, headers=b_write)).status_code == 201
        before = await _job(c, a_write, "a1")  # before the first scrape: not counted
        first = await c.get("/metrics", headers=ROOT)
        assert first.status_code == 200, first.text
        assert "trainyard_project_jobs_submitted_total{" not in first.text
        counted_from = live.app.state.metrics.projects.cursor  # the first scrape's last event
        done = [await _job(c, a_write, "a1"), await _job(c, a_write, "a1")]
        done.append(await _job(c, b_write, "b1"))
        stopped = await _job(c, b_write, "b-slow")

        async def status(job_id: str) -> str:
            return str((await c.get(f"/v1/training-jobs/{job_id}", headers=ROOT)).json()["status"])

        async def ended() -> bool:
            return all([await status(job) == "succeeded" for job in [before, *done]])

        await until(ended, what="the jobs to succeed")
        await until(lambda: _is(status(stopped), "running"), what="the slow job to start")
        assert (await c.post(f"/v1/training-jobs/{stopped}/cancel", headers=b_write)).is_success
        await until(lambda: _is(status(stopped), "cancelled"), what="the cancel")

        async def scraped() -> str | None:
            text = (await c.get("/metrics", headers=ROOT)).text
            finished = "trainyard_project_jobs_finished_total"
            cancelled = sample(text, finished, project=b, kind="training", status="cancelled")
            return text if cancelled == 1 else None

        # Postgres: an event counts once the transactions open when it was seen have ended.
        text = await until(scraped, what="the cancel counted")
        submitted = "trainyard_project_jobs_submitted_total"
        assert sample(text, submitted, project=a, kind="training") == 2
        assert sample(text, submitted, project=b, kind="training") == 2
        finished = "trainyard_project_jobs_finished_total"
        # `before` was submitted before the first scrape: its submission does not count, its
        # end does where it came after that scrape (the job may well have ended before it).
        async with live.app.state.engine.connect() as conn:
            before_end = await conn.scalar(
                select(func.max(job_events.c.id)).where(job_events.c.job_id == before)
            )
            began, ended = (
                await conn.execute(
                    select(jobs.c.started_at, jobs.c.finished_at).where(jobs.c.id == before)
                )
            ).one()
        ended_after = int(before_end > counted_from)
        uncounted = {a: 0.0 if ended_after else (ended - began).total_seconds(), b: 0.0}
        assert sample(text, finished, project=a, kind="training", status="succeeded") == (
            2 + ended_after
        )
        assert sample(text, finished, project=b, kind="training", status="succeeded") == 1
        # Seconds as GET /v1/usage counts them, from the same columns.
        for pid in (a, b):
            usage = await c.get("/v1/usage", params={"project_id": pid}, headers=ROOT)
            seconds = sample(text, "trainyard_project_trainer_seconds_total", project=pid)
            assert seconds > 0
            used = usage.json()["total"]["trainer_seconds"] - uncounted[pid]
            assert seconds == pytest.approx(used, abs=0.01)
        assert sample(text, "trainyard_project_rollout_seconds_total", project=a) == 0
        # Counters only grow: a scrape with nothing new leaves them as they were.
        again = (await c.get("/metrics", headers=ROOT)).text
        assert sample(again, submitted, project=a, kind="training") == 2


async def test_a_submission_committed_after_a_later_one_was_scraped_still_counts(
    store: QueueStore,
) -> None:
    """Postgres takes an event's id at its insert: a submission still in its transaction
    holds a lower id than one made and committed after it. Scrapes taken meanwhile count
    neither; once the first commits, both count, once."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer: its ids come in commit order")
    registry = CollectorRegistry()
    counters = ProjectCounters(registry)
    sessions = async_sessionmaker(store.engine)
    labels = {"project": DEFAULT_PROJECT_ID, "kind": "training"}

    async def scrape() -> float:
        async with sessions() as session:
            await counters.read(session)
        return registry.get_sample_value("trainyard_project_jobs_submitted_total", labels) or 0

    await _model(store, "m")
    await scrape()  # the first scrape: counts from here on
    early = new_job(
        JobKind.training,
        model="m",
        payload=_payload(),
        summary={"num_groups": 1},
        request_hash="h",
        max_attempts=1,
    )
    # Both events stamped a minute old: as if the first transaction had stalled that long
    # before its commit (no allowance of time is long enough for every stall).
    aged = update(job_events).values(
        created_at=job_events.c.created_at - literal(timedelta(minutes=1), Interval)
    )
    async with write_connection(store.engine) as open_:
        await enqueue(open_, early)  # its event's id is taken; not committed
        await open_.execute(aged.where(job_events.c.job_id == early.id))
        later = await _stored_job(store, "m")  # a higher id, committed
        async with write_connection(store.engine) as conn:
            await conn.execute(aged.where(job_events.c.job_id == later))
        for _ in range(3):
            assert await scrape() == 0
    await until(lambda: _is_count(scrape(), 2), what="both submissions counted")
    assert await scrape() == 2


async def _is_count(value, expected: float) -> bool:
    return await value == expected


async def _is(value, expected: str) -> bool:
    return await value == expected


async def test_metrics_need_an_admin_or_a_metrics_key_unless_public(serve) -> None:
    async with serve(**FRESH, metrics_keys="scrape-token") as live:
        c = live.client
        pid = await project(c, "p")
        reader = bearer((await key(c, pid, "read"))["secret"])
        scraper = bearer("scrape-token")
        assert (await c.get("/metrics")).status_code == 401
        refused = await c.get("/metrics", headers=reader)
        assert refused.status_code == 403, refused.text
        assert refused.json()["missing_scope"] == "admin"
        assert (await c.get("/metrics", headers=ROOT)).status_code == 200
        assert (await c.get("/metrics", headers=scraper)).status_code == 200
        # The metrics key reads nothing else.
        assert (await c.get("/v1/models", headers=scraper)).status_code == 401
        assert (await c.get("/healthz")).status_code == 200
    async with serve(**FRESH, metrics_public=True) as live:
        assert (await live.client.get("/metrics")).status_code == 200
