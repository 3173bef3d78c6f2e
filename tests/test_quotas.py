"""Project quotas and the fair claim (issue 28 §3), on both dialects: projects take turns
in the claim, a running quota holds jobs queued (saying why) and is never passed, and the
other quotas refuse a submission with 429 naming the quota, storing nothing. Claims are
made by the store itself, one at a time, so no test depends on a worker's timing."""

from __future__ import annotations

import ast
import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import create_engine, utcnow, write_connection
from app.jobs import quotas, statements
from app.jobs.lifecycle import Succeeded
from app.jobs.statements import jobs, projects
from app.jobs.store import PostgresStore, QueueStore, enqueue, store_for
from tests import factories as f
from tests.test_projects import FRESH, ROOT, bearer, key, project
from tests.test_store import _job, _model, _new_job

APP = Path(__file__).resolve().parent.parent / "app"


async def _project(store: QueueStore, project_id: str, **limits: int | None) -> None:
    async with write_connection(store.engine) as conn:
        await conn.execute(
            insert(projects).values(id=project_id, name=project_id, created_at=utcnow(), **limits)
        )


async def _owners(store: QueueStore, job_ids: list[str]) -> list[str]:
    async with store.engine.connect() as conn:
        rows = dict(
            (
                await conn.execute(
                    select(jobs.c.id, jobs.c.project_id).where(jobs.c.id.in_(job_ids))
                )
            ).all()
        )
    return [rows[job_id] for job_id in job_ids]


async def _claim_one_by_one(store: QueueStore, count: int) -> list[str]:
    claimed: list[str] = []
    for _ in range(count):
        [claim] = await store.claim(owner="w1", lease_seconds=30, limit=1)
        claimed.append(claim.lease.job_id)
    return claimed


async def test_a_project_that_queued_100_jobs_does_not_starve_one_that_queued_5(
    store: QueueStore,
) -> None:
    await _project(store, "big")
    await _project(store, "small")
    for i in range(25):
        await _model(store, f"big-{i}", "big")
    for i in range(5):
        await _model(store, f"small-{i}", "small")
    for i in range(100):
        await _job(store, f"big-{i % 25}")
    small = [await _job(store, f"small-{i}") for i in range(5)]
    # Submitted after all of big's: in submission order they would come 101st to 105th
    # (after the 25 big jobs of free models); in fair order the projects take turns.
    order = await _owners(store, await _claim_one_by_one(store, 10))
    assert order == ["big", "small"] * 5, order
    assert set(small) <= set(await _claimed(store))


async def _claimed(store: QueueStore) -> list[str]:
    async with store.engine.connect() as conn:
        return list((await conn.scalars(select(jobs.c.id).where(jobs.c.status == "running"))).all())


async def test_a_project_arriving_while_a_backlog_is_served_starts_at_once(
    store: QueueStore,
) -> None:
    await _project(store, "big")
    await _project(store, "late")
    for i in range(30):
        await _model(store, f"big-{i}", "big")
    for i in range(3):
        await _model(store, f"late-{i}", "late")
    for i in range(60):
        await _job(store, f"big-{i % 30}")
    first = await _owners(store, await _claim_one_by_one(store, 8))
    assert first == ["big"] * 8
    for i in range(3):
        await _job(store, f"late-{i}")
    # The late project's jobs are placed where the backlog is served now, not behind it.
    after = await _owners(store, await _claim_one_by_one(store, 6))
    assert after.count("late") == 3 and after[:2].count("late") >= 1, after


async def test_a_running_quota_holds_jobs_queued_and_is_never_passed(store: QueueStore) -> None:
    await _project(store, "capped", max_running_jobs=2)
    await _project(store, "free")
    for i in range(4):
        await _model(store, f"capped-{i}", "capped")
        await _model(store, f"free-{i}", "free")
    capped = [await _job(store, f"capped-{i}") for i in range(4)]
    free = [await _job(store, f"free-{i}") for i in range(4)]
    # One claim asking for everything takes 2 of capped's and all of free's.
    claims = await store.claim(owner="w1", lease_seconds=30, limit=10)
    taken = {c.lease.job_id for c in claims}
    assert taken & set(free) == set(free)
    assert len(taken & set(capped)) == 2, taken
    assert await store.claim(owner="w2", lease_seconds=30, limit=10) == []
    async with store.engine.connect() as conn:
        assert await quotas.at_running_quota(conn) == {"capped": (2, 2)}
    # One ends: one more starts, and no more.
    done = next(c for c in claims if c.lease.job_id in capped)
    assert await store.apply(done.lease, Succeeded({"final_step": 1})) == "succeeded"
    [next_one] = await store.claim(owner="w2", lease_seconds=30, limit=10)
    assert next_one.lease.job_id in capped
    assert await store.claim(owner="w2", lease_seconds=30, limit=10) == []
    # Lifting the quota lets the last one start.
    async with write_connection(store.engine) as conn:
        await conn.execute(
            update(projects).where(projects.c.id == "capped").values(max_running_jobs=None)
        )
    [last] = await _claim_after_quota_change(store)
    assert last.lease.job_id in capped


async def _claim_after_quota_change(store: QueueStore) -> list:
    # Postgres: a process rereads whether any project has a running quota every
    # `quota_check_seconds`; a test makes it reread now instead of waiting.
    if isinstance(store, PostgresStore):
        store.forget_quotas()
    return await store.claim(owner="w3", lease_seconds=30, limit=10)


async def test_concurrent_claims_never_pass_a_running_quota(store: QueueStore) -> None:
    """Eight claimers at once, on their own connections, for a project with room for 3."""
    await _project(store, "capped", max_running_jobs=3)
    for i in range(20):
        await _model(store, f"m-{i}", "capped")
        await _job(store, f"m-{i}")
    results = await asyncio.gather(
        *(store.claim(owner=f"w{i}", lease_seconds=30, limit=4) for i in range(8))
    )
    assert sum(len(r) for r in results) == 3
    async with store.engine.connect() as conn:
        running = await conn.scalar(
            select(func.count()).where(jobs.c.project_id == "capped", jobs.c.status == "running")
        )
    assert running == 3


async def test_a_claim_that_starts_a_capped_projects_jobs_raises_its_claim_seq(
    store: QueueStore,
) -> None:
    """Postgres: the mark a claim leaves on a capped project's row, that a claim whose
    snapshot is older than it finds (see the next test)."""
    if not isinstance(store, PostgresStore):
        pytest.skip("SQLite: one writer claims at a time; nothing to mark")
    await _project(store, "capped", max_running_jobs=3)
    await _project(store, "free")
    for name in ("capped-0", "capped-1", "free-0", "free-1"):
        await _model(store, name, name.split("-")[0])
    capped = [await _job(store, "capped-0"), await _job(store, "capped-1")]
    free = [await _job(store, "free-0"), await _job(store, "free-1")]

    async def claim_seqs() -> dict[str, int]:
        async with store.engine.connect() as conn:
            rows = await conn.execute(select(projects.c.id, projects.c.claim_seq))
            return {row.id: row.claim_seq for row in rows if row.id in ("capped", "free")}

    # One claim taking a job of each: one mark, on the capped project only.
    first = await store.claim(owner="w1", lease_seconds=30, limit=2)
    assert {c.lease.job_id for c in first} == {capped[0], free[0]}
    assert await claim_seqs() == {"capped": 1, "free": 0}
    # A claim that takes only the free project's job leaves no mark.
    async with write_connection(store.engine) as conn:
        await conn.execute(
            update(projects).where(projects.c.id == "capped").values(max_running_jobs=1)
        )
    second = await store.claim(owner="w2", lease_seconds=30, limit=2)
    assert [c.lease.job_id for c in second] == [free[1]]
    assert await claim_seqs() == {"capped": 1, "free": 0}


async def test_a_claim_passes_over_a_project_whose_jobs_started_after_its_snapshot(
    store: QueueStore,
) -> None:
    """The race a capped claim closes in one statement: claim B's snapshot is taken, claim
    A starts the capped project's jobs and commits, then B reaches the project's row. B's
    count of running jobs is stale, so B must not take that project's jobs. B is held
    between the two steps deterministically: its statement waits for an advisory lock the
    test holds, after its snapshot and before it locks the project row."""
    if not isinstance(store, PostgresStore):
        pytest.skip("SQLite: one writer claims at a time")
    await _project(store, "capped", max_running_jobs=2)
    for i in range(2):
        await _model(store, f"capped-{i}", "capped")
    first = await _job(store, "capped-0")
    held = 7_028_001
    probe = (
        select(func.pg_advisory_lock(held), statements.capped_rows_as_seen().label("current"))
        .select_from(projects)
        .where(projects.c.id == "capped")
    )

    async def run_probe() -> bool:
        async with store.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            current = (await conn.execute(probe)).one().current
            await conn.execute(select(func.pg_advisory_unlock(held)))
            return bool(current)

    assert await run_probe()  # nothing started since its snapshot: current
    async with store.engine.connect() as holder:
        holder = await holder.execution_options(isolation_level="AUTOCOMMIT")
        await holder.execute(select(func.pg_advisory_lock(held)))
        b = asyncio.create_task(run_probe())
        while not await holder.scalar(
            select(func.count())
            .select_from(text("pg_locks"))
            .where(text("locktype = 'advisory' AND NOT granted"))
        ):
            await asyncio.sleep(0.01)
        [a] = await store.claim(owner="a", lease_seconds=30, limit=1)  # commits
        assert a.lease.job_id == first
        await holder.execute(select(func.pg_advisory_unlock(held)))
        assert await b is False
    assert await run_probe()  # a snapshot taken after A's commit is current again


async def test_trainer_seconds_are_clipped_to_the_utc_day(store: QueueStore) -> None:
    await _project(store, "p")
    await _model(store, "m", "p")
    noon = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    day = noon.replace(hour=0)
    spans = [
        (day - timedelta(minutes=10), day + timedelta(minutes=5), "succeeded"),  # 300 s today
        (noon - timedelta(seconds=70), noon - timedelta(seconds=10), "failed"),  # 60 s
        (noon - timedelta(seconds=30), None, "running"),  # 30 s so far
        (day - timedelta(hours=3), day - timedelta(hours=2), "succeeded"),  # yesterday
        (noon - timedelta(seconds=50), None, "queued"),  # its attempt sent back: 40 s
    ]
    # As the write that sent it back leaves a job: the attempt's seconds among the earlier.
    returned = {"attempts": 1, "returned_at_attempt": 1, "earlier_seconds": 40.0}
    for started, finished, status in spans:
        job_id = await _job(store, "m")
        async with write_connection(store.engine) as conn:
            await conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id)
                .values(status=status, started_at=started, finished_at=finished)
                .values(returned if status == "queued" else {})
            )
    async with store.engine.connect() as conn, AsyncSession(bind=conn) as session:
        used = await quotas.trainer_seconds(session, "p", noon)
    assert used == pytest.approx(430.0)


def test_every_submission_passes_the_quota_check() -> None:
    """Jobs are inserted by `app.jobs.store.enqueue` (or `enqueue_new`, a run's child that
    may exist) only: through `enqueue_once` (every API submission, which checks the quotas
    first) or as a job's or a run's child."""
    callers = set()
    for path in APP.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in ("enqueue", "enqueue_new"):
                    callers.add(str(path.relative_to(APP)))
    assert callers == {"jobs/service.py", "jobs/runs.py", "jobs/store.py"}
    source = (APP / "jobs" / "service.py").read_text(encoding="utf-8")
    once = source[source.index("async def enqueue_once") :]
    assert once.index("quotas.admit(") < once.index("enqueue(session")


# -- over HTTP ------------------------------------------------------------------------------


async def _submit(client, model: str, headers: dict[str, str], **extra_headers: str):
    return await client.post(
        "/v1/training-jobs",
        json={"model": model, "collection": f.nat_collection()},
        headers={**headers, **extra_headers},
    )


async def _count_jobs(database_url: str, project_id: str) -> int:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            return int(
                await conn.scalar(select(func.count()).where(jobs.c.project_id == project_id))
            )
    finally:
        await engine.dispose()


async def test_quotas_are_set_by_an_admin_and_read_by_the_project(serve) -> None:
    async with serve(**FRESH) as live:
        c = live.client
        a, b = await project(c, "a"), await project(c, "b")
        a_write = bearer((await key(c, a, "write"))["secret"])
        b_read = bearer((await key(c, b, "read"))["secret"])
        empty = await c.get(f"/v1/projects/{a}/quotas", headers=a_write)
        assert empty.status_code == 200, empty.text
        assert empty.json()["quotas"] == {
            "running_jobs": None,
            "queued_jobs": None,
            "submissions_per_minute": None,
            "trainer_seconds_per_day": None,
        }
        body = {"running_jobs": 2, "queued_jobs": 10}
        assert (
            await c.put(f"/v1/projects/{a}/quotas", json=body, headers=a_write)
        ).status_code == 403
        assert (await c.get(f"/v1/projects/{a}/quotas", headers=b_read)).status_code == 404
        set_ = await c.put(f"/v1/projects/{a}/quotas", json=body, headers=ROOT)
        assert set_.status_code == 200, set_.text
        assert set_.json()["quotas"]["running_jobs"] == 2
        assert set_.json()["usage"] == {
            "running_jobs": 0,
            "queued_jobs": 0,
            "submissions_last_minute": 0,
            "trainer_seconds_today": 0.0,
        }
        # Bad input: 422 naming the field; nothing changes.
        for bad, path in (
            ({"running_jobs": -1}, "running_jobs"),
            ({"queued_jobs": "5"}, "queued_jobs"),
            ({"queued_jobs": 1, "gpus": 2}, "gpus"),
            ({"trainer_seconds_per_day": 10**10}, "trainer_seconds_per_day"),
        ):
            refused = await c.put(f"/v1/projects/{a}/quotas", json=bad, headers=ROOT)
            assert refused.status_code == 422, refused.text
            assert [e["path"] for e in refused.json()["errors"]] == [path]
        assert (await c.get(f"/v1/projects/{a}/quotas", headers=ROOT)).json()["quotas"] == {
            **empty.json()["quotas"],
            **body,
        }
        missing = await c.put("/v1/projects/proj_nope/quotas", json=body, headers=ROOT)
        assert missing.status_code == 404 and missing.json()["errors"][0]["path"] == "project_id"


async def test_over_a_quota_a_submission_is_429_and_nothing_is_stored(
    serve, database_url: str
) -> None:
    async with serve(**FRESH) as live:
        c = live.client
        a = await project(c, "a")
        a_write = bearer((await key(c, a, "write"))["secret"])
        for name in ("m1", "m2"):
            made = await c.post("/v1/models", json=f.model_body(name), headers=a_write)
            assert made.status_code == 201, made.text
        await c.put(f"/v1/projects/{a}/quotas", json={"queued_jobs": 2}, headers=ROOT)
        first = await _submit(c, "m1", a_write, **{"Idempotency-Key": "one"})
        assert first.status_code == 202, first.text
        assert (await _submit(c, "m2", a_write)).status_code == 202
        full = await _submit(c, "m1", a_write)
        assert full.status_code == 429, full.text
        assert full.headers["content-type"] == "application/problem+json"
        problem = full.json()
        assert (problem["quota"], problem["limit"]) == ("queued_jobs", 2)
        assert "queued_jobs" in problem["detail"] and int(full.headers["retry-after"]) >= 1
        assert await _count_jobs(database_url, a) == 2
        # A retry of an accepted submission is its replay, never refused.
        again = await _submit(c, "m1", a_write, **{"Idempotency-Key": "one"})
        assert again.status_code in (200, 202) and again.json()["id"] == first.json()["id"]
        # The rate: 2 submissions in the minute are the limit.
        await c.put(f"/v1/projects/{a}/quotas", json={"submissions_per_minute": 2}, headers=ROOT)
        rate = await _submit(c, "m1", a_write)
        assert rate.status_code == 429 and rate.json()["quota"] == "submissions_per_minute"
        assert 1 <= int(rate.headers["retry-after"]) <= 60
        # The budget: none left today, so until midnight UTC.
        await c.put(f"/v1/projects/{a}/quotas", json={"trainer_seconds_per_day": 0}, headers=ROOT)
        budget = await _submit(c, "m1", a_write)
        assert budget.status_code == 429 and budget.json()["quota"] == "trainer_seconds_per_day"
        assert 1 <= int(budget.headers["retry-after"]) <= 86_400
        assert await _count_jobs(database_url, a) == 2
        # Another project is not held by a's quotas.
        b = await project(c, "b")
        b_write = bearer((await key(c, b, "write"))["secret"])
        assert (await c.post("/v1/models", json=f.model_body("b1"), headers=b_write)).is_success
        assert (await _submit(c, "b1", b_write)).status_code == 202
        usage = (await c.get(f"/v1/projects/{a}/quotas", headers=a_write)).json()["usage"]
        assert usage["queued_jobs"] == 2 and usage["submissions_last_minute"] == 2


async def test_a_job_held_by_the_running_quota_says_why(serve, database_url: str) -> None:
    async with serve(**FRESH) as live:
        c = live.client
        a = await project(c, "a")
        a_write = bearer((await key(c, a, "write"))["secret"])
        await c.put(f"/v1/projects/{a}/quotas", json={"running_jobs": 1}, headers=ROOT)
        ids = []
        for name in ("m1", "m2"):
            assert (await c.post("/v1/models", json=f.model_body(name), headers=a_write)).is_success
            submitted = await _submit(c, name, a_write)
            assert submitted.status_code == 202, submitted.text
            ids.append(submitted.json()["id"])
        engine = create_engine(database_url)
        try:
            claims = await store_for(engine).claim(owner="w1", lease_seconds=30, limit=5)
        finally:
            await engine.dispose()
        assert [claim.lease.job_id for claim in claims] == ids[:1]
        # The process rereads the projects at their quota once a second (LIVE_WORKERS_TTL):
        # the test drops its read instead of waiting a second.
        live.app.state.waits = None
        held = (await c.get(f"/v1/training-jobs/{ids[1]}", headers=a_write)).json()
        assert held["status"] == "queued"
        assert "running_jobs quota: 1 of 1 running" in held["waiting_for"], held


async def test_a_claim_counts_a_capped_projects_running_jobs_not_its_history(
    store: QueueStore,
) -> None:
    """SQLite: the quota's count reads the partial index of running jobs, where the
    planner, left to itself, read every job the project ever had (~0.3 s a claim at 100,000
    ended jobs). Measured in SQLite's virtual-machine steps, not in time: a claim costs about
    what it did before the project had 2,000 ended jobs."""
    if isinstance(store, PostgresStore):
        pytest.skip("SQLite's query planner")
    steps = [0]

    def counting(dbapi_connection: Any, *_: Any) -> None:
        def step() -> int:
            steps[0] += 1
            return 0  # go on

        dbapi_connection._connection._conn.set_progress_handler(step, 10)

    event.listen(store.engine.sync_engine, "checkout", counting)

    async def claim_steps() -> int:
        steps[0] = 0
        [claim] = await store.claim(owner="w1", lease_seconds=30, limit=1)
        assert claim is not None
        return steps[0]

    await _project(store, "capped", max_running_jobs=5)
    await _model(store, "first", "capped")
    await _model(store, "later", "capped")
    await _job(store, "first")
    before = await claim_steps()
    async with write_connection(store.engine) as conn:
        for _ in range(2000):
            await enqueue(conn, _new_job("first"))
        await conn.execute(
            update(jobs).where(jobs.c.project_id == "capped").values(status="succeeded")
        )
    await _job(store, "later")
    after = await claim_steps()
    assert after < 2 * before, (before, after)
