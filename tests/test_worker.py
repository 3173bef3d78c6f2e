"""Claim, process and recovery, called directly: no loops, no sleeps, a real database."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from app.backends import Backends
from app.db import create_engine, create_sessionmaker, transaction, utcnow
from app.jobs.lifecycle import ErrorInfo, EventType, JobStatus, Retry, Succeeded
from app.jobs.statements import workers
from app.jobs.store import Claim, store_for
from app.models import JobEventRow, JobRow, ModelRow
from app.notify import Notifier
from app.registry.models import create_model
from app.schemas.jobs import TrainingJobCreate
from app.schemas.models import ModelCreate
from app.training.service import create_training_job, prepare
from app.worker import Worker
from tests import factories as f
from tests.backends import FlakyBackend, RecordingBackend
from tests.processes import until

STARTED = (EventType.training_started, {})


class Env:
    def __init__(self, settings, sessions, backend) -> None:
        self.settings = settings
        self.sessions = sessions
        self.backend = backend
        self.store = store_for(sessions.kw["bind"])
        self.worker = Worker(
            settings=settings,
            store=self.store,
            backends=Backends(settings, {"dry-run": backend}),
            notifier=Notifier(),
        )

    async def model(self, name: str = "agent", **config) -> None:
        async with self.sessions() as session:
            await create_model(
                session,
                body=ModelCreate.model_validate(f.model_body(name, **config)),
                model_roots=self.settings.allowed_model_roots(),
            )
            await session.commit()

    async def job(self, model: str = "agent", **body) -> str:
        payload = {"model": model, "collection": f.nat_collection(), **body}
        raw = json.dumps(payload).encode()
        async with self.sessions() as session:
            job, _ = await create_training_job(
                session,
                job=prepare(TrainingJobCreate.model_validate_json(raw), raw, self.settings),
                idempotency_key=None,
                max_attempts=self.settings.max_attempts,
            )
            await session.commit()
        return job.id

    @property
    def engine(self):
        return self.worker.engine

    async def claim_after_job(self, model: str = "agent") -> Claim:
        await self.job(model)
        claim = await self.claim()
        assert claim is not None
        return claim

    async def claim(self) -> Claim | None:
        claims = await self.store.claim(owner="test", lease_seconds=30)
        return claims[0] if claims else None

    async def row(self, job_id: str) -> JobRow:
        async with self.sessions() as session:
            row = await session.get(JobRow, job_id)
            assert row is not None
            return row

    async def events(self, job_id: str) -> list[str]:
        async with self.sessions() as session:
            rows = await session.scalars(
                select(JobEventRow.type)
                .where(JobEventRow.job_id == job_id)
                .order_by(JobEventRow.seq)
            )
            return list(rows)

    async def expire(self, job_id: str) -> None:
        async with transaction(self.sessions) as session:
            await session.execute(
                update(JobRow)
                .where(JobRow.id == job_id)
                .values(lease_expires_at=utcnow() - timedelta(seconds=1))
            )

    async def make_eligible(self, job_id: str) -> None:
        async with transaction(self.sessions) as session:
            await session.execute(
                update(JobRow).where(JobRow.id == job_id).values(not_before=utcnow())
            )


async def _env(make_settings, backend) -> AsyncIterator[Env]:
    settings = make_settings(max_attempts=2)
    engine = create_engine(settings.database_url)
    try:
        yield Env(settings, create_sessionmaker(engine), backend)
    finally:
        await engine.dispose()


@pytest.fixture
async def env(make_settings, tmp_path) -> AsyncIterator[Env]:
    async for e in _env(make_settings, RecordingBackend(tmp_path / "backend")):
        yield e


async def test_claims_oldest_first_and_one_running_job_per_model(env: Env) -> None:
    await env.model("a")
    await env.model("b")
    a1, b1, a2 = await env.job("a"), await env.job("b"), await env.job("a")
    first, second, third = await env.claim(), await env.claim(), await env.claim()
    assert first is not None and second is not None
    assert (first.lease.job_id, second.lease.job_id, third) == (a1, b1, None)
    assert first.lease.attempt == 1 and first.lease.token != second.lease.token
    assert (await env.row(a2)).status == "queued"
    assert await env.events(a1) == ["job_queued", "job_claimed"]


async def test_claim_skips_jobs_not_yet_due_and_cancelled_ones(env: Env) -> None:
    await env.model()
    later, cancelled = await env.job(), await env.job()
    async with transaction(env.sessions) as session:
        await session.execute(
            update(JobRow)
            .where(JobRow.id == later)
            .values(not_before=utcnow() + timedelta(minutes=5))
        )
        await session.execute(
            update(JobRow).where(JobRow.id == cancelled).values(status=JobStatus.cancelled.value)
        )
    assert await env.claim() is None


async def test_the_database_refuses_a_second_running_job_of_a_model(env: Env) -> None:
    await env.model()
    one, two = await env.job(), await env.job()
    assert (await env.claim()).lease.job_id == one
    with pytest.raises(IntegrityError):
        async with transaction(env.sessions) as session:
            await session.execute(
                update(JobRow).where(JobRow.id == two).values(status=JobStatus.running.value)
            )


async def test_process_trains_and_applies_the_result(env: Env) -> None:
    await env.model()
    job_id = await env.job(hyperparameters={"learning_rate": 2e-5})
    claim = await env.claim()
    await env.worker.process(claim)
    row = await env.row(job_id)
    assert row.status == "succeeded"
    assert (row.start_step, row.final_step) == (0, 1)
    assert row.lease_token is None
    ((_, groups, kwargs),) = env.backend.calls
    assert kwargs == {"learning_rate": 2e-5} and len(groups) == 2
    assert await env.events(job_id) == [
        "job_queued",
        "job_claimed",
        "training_started",
        "gradient_step",
        "gradient_step",
        "training_ended",
    ]


async def test_a_diverged_step_with_nan_metrics_is_recorded(make_settings, tmp_path) -> None:
    # Postgres' JSON refuses NaN and Infinity: stored as null, on both dialects alike.
    from tests.backends import DivergingBackend

    async for env in _env(make_settings, DivergingBackend(tmp_path / "backend")):
        await env.model()
        job_id = await env.job()
        await env.worker.process(await env.claim())
        row = await env.row(job_id)
        assert (row.status, row.final_step) == ("succeeded", 1)
        assert row.metrics["loss/train"] is None and row.metrics["grad_norm"] is None
        async with env.sessions() as session:
            step = await session.scalar(
                select(JobEventRow.data).where(
                    JobEventRow.job_id == job_id, JobEventRow.type == "gradient_step"
                )
            )
        assert step["metrics"] == {"loss/train": None, "grad_norm": None, "step": 1}


async def test_a_heartbeat_the_database_refuses_stops_training_at_once(
    make_settings, tmp_path
) -> None:
    # Not "the database is away" (that is retried while the lease lasts): the job stops
    # and settles now, instead of training on unwatched until its lease lapses.
    from tests.backends import UnwritableProgressBackend

    backend = UnwritableProgressBackend(tmp_path / "backend")
    async for env in _env(make_settings, backend):
        await env.model()
        job_id = await env.job()
        await env.worker.process(await env.claim())
        assert backend.stopped.is_set()
        row = await env.row(job_id)
        # Settled by this worker (before, it gave the lease up as lost: still running).
        assert row.status in ("queued", "failed") and row.lease_token is None
        assert "not JSON serializable" in row.error["message"]


async def test_a_stale_lease_writes_nothing(env: Env) -> None:
    await env.model()
    job_id = await env.job()
    stale = await env.claim()
    await env.expire(job_id)
    assert await env.worker.recover_expired() == {job_id: JobStatus.queued}
    await env.make_eligible(job_id)
    fresh = await env.claim()
    assert fresh is not None and fresh.lease.attempt == 2
    beat = await env.store.heartbeat(stale.lease, lease_seconds=30)
    assert beat.alive is False
    events_before = await env.events(job_id)
    stale_result = Succeeded({}, model={"current_step": 99})
    started = (EventType.training_started, {})
    assert await env.store.apply(stale.lease, stale_result, earlier=[started]) is None
    # Nothing of the stale write lands: not the job, not its events, not the model.
    assert (await env.row(job_id)).status == "running"
    assert await env.events(job_id) == events_before
    async with env.sessions() as session:
        assert (await session.get(ModelRow, "agent")).current_step != 99
    await env.worker.process(fresh)
    assert (await env.row(job_id)).status == "succeeded"


async def test_expired_lease_after_the_step_counts_it_once(env: Env) -> None:
    await env.model()
    job_id = await env.job()
    lease = await env.claim()
    # The worker recorded its start, the backend finished the step, then the worker died.
    spec_step = 0
    assert await env.store.record_start(lease.lease, start_step=spec_step, event=STARTED)
    adapter = env.worker.backends.get("dry-run")
    from app.backends.base import ModelSpec

    spec = ModelSpec("agent", "tests", "tiny/base", {})
    await adapter.train(spec, [], {})
    await env.expire(job_id)
    assert await env.worker.recover_expired() == {job_id: JobStatus.succeeded}
    row = await env.row(job_id)
    assert (row.status, row.recovered, row.final_step) == ("succeeded", True, 1)
    assert await adapter.get_step(spec) == 1
    assert len(env.backend.calls) == 1
    assert await env.worker.recover_expired() == {}
    assert await env.claim() is None


async def test_expired_lease_before_the_step_is_retried_with_backoff(env: Env) -> None:
    await env.model()
    job_id = await env.job()
    lease = await env.claim()
    assert await env.store.record_start(lease.lease, start_step=0, event=STARTED)
    await env.expire(job_id)
    before = utcnow()
    assert await env.worker.recover_expired() == {job_id: JobStatus.queued}
    row = await env.row(job_id)
    assert row.status == "queued" and row.not_before > before
    assert row.error["type"] == "LeaseExpired" and row.error["transient"] is True
    assert (await env.events(job_id))[-1] == "job_retrying"
    assert env.backend.calls == []


async def test_attempts_run_out_then_the_job_fails_with_the_last_error(env: Env) -> None:
    await env.model()
    job_id = await env.job()
    for expected in (JobStatus.queued, JobStatus.failed):
        lease = await env.claim()
        assert lease is not None
        await env.expire(job_id)
        outcome = await env.worker.recover_expired()
        assert outcome == {job_id: expected}
        await env.make_eligible(job_id)
    row = await env.row(job_id)
    assert row.status == "failed" and row.attempts == 2
    assert row.error["type"] == "LeaseExpired"
    assert (await env.events(job_id))[-1] == "training_failed"


async def test_a_permanent_backend_error_fails_at_once(env: Env) -> None:
    await env.model(fail_with="token ids exceed the vocabulary")
    job_id = await env.job()
    await env.worker.process(await env.claim())
    row = await env.row(job_id)
    assert row.status == "failed" and row.attempts == 1
    assert row.error == {
        "type": "ValueError",
        "transient": False,
        "message": "ValueError: token ids exceed the vocabulary",
    }


async def test_a_transient_backend_error_is_retried_then_succeeds(make_settings, tmp_path) -> None:
    async for env in _env(make_settings, FlakyBackend(tmp_path / "flaky", failures=1)):
        await env.model()
        job_id = await env.job()
        await env.worker.process(await env.claim())
        row = await env.row(job_id)
        assert row.status == "queued" and row.error["transient"] is True
        assert "Connection refused" in row.error["message"]
        await env.make_eligible(job_id)
        await env.worker.process(await env.claim())
        row = await env.row(job_id)
        assert (row.status, row.attempts, row.final_step) == ("succeeded", 2, 1)


async def test_shutdown_hands_running_jobs_back(env: Env) -> None:
    await env.model(seconds_per_step=30)
    job_id = await env.job()
    await env.worker.start()
    await env.worker.fill()
    assert job_id in env.worker.tasks
    await env.backend.started.wait()
    await env.worker.stop(grace=0.05)
    row = await env.row(job_id)
    assert (row.status, row.attempts, row.lease_token) == ("queued", 0, None)
    assert (await env.events(job_id))[-1] == "job_released"
    assert await env.claim() is not None  # another worker takes it at once


async def test_a_batch_claim_takes_one_job_per_model(env: Env) -> None:
    for name in "abc":
        await env.model(name)
    a1, a2, b1, c1 = [await env.job(m) for m in "aabc"]
    claims = await env.store.claim(owner="test", lease_seconds=30, limit=3)
    assert [c.lease.job_id for c in claims] == [a1, b1, c1]
    assert {c.model.name for c in claims} == {"a", "b", "c"}
    assert len({c.lease.token for c in claims}) == 3  # each job its own fencing token
    for c in claims:
        row = await env.row(c.lease.job_id)
        assert (row.status, row.lease_token, row.lease_owner, row.attempts) == (
            "running",
            c.lease.token,
            "test",
            1,
        )
        async with env.sessions() as session:
            claimed = await session.scalar(
                select(JobEventRow).where(JobEventRow.job_id == row.id, JobEventRow.seq == 2)
            )
        assert (claimed.type, claimed.data) == ("job_claimed", {"worker": "test", "attempt": 1})
        assert row.last_event_seq == 2
    assert (await env.row(a2)).status == "queued"
    assert await env.store.claim(owner="test", lease_seconds=30, limit=3) == []


async def test_an_error_after_the_step_landed_counts_the_step_once(make_settings, tmp_path) -> None:
    from tests.backends import LostReplyBackend

    async for env in _env(make_settings, LostReplyBackend(tmp_path / "lost")):
        await env.model()
        job_id = await env.job()
        await env.worker.process(await env.claim())
        row = await env.row(job_id)
        assert (row.status, row.recovered, row.final_step) == ("succeeded", True, 1)
        assert await env.claim() is None  # not queued again: it would train a second step


async def test_a_retry_honours_a_cancel_asked_meanwhile(env: Env) -> None:
    await env.model()
    job_id = await env.job()
    claim = await env.claim()
    async with transaction(env.sessions) as session:
        await session.execute(
            update(JobRow).where(JobRow.id == job_id).values(cancel_requested=True)
        )
    error = ErrorInfo(type="X", message="", transient=True)
    status = await env.store.apply(claim.lease, Retry(error, delay_s=0))
    assert status == JobStatus.cancelled
    assert (await env.row(job_id)).status == "cancelled"


async def test_one_job_that_cannot_be_settled_does_not_stop_recovery(env: Env) -> None:
    await env.model("good")
    await env.model("broken")
    good, broken = await env.job("good"), await env.job("broken")
    await env.claim()
    await env.claim()
    for job_id in (good, broken):
        await env.expire(job_id)
    from app.models import ModelRow

    async with transaction(env.sessions) as session:  # a stored config that no longer loads
        await session.execute(
            update(ModelRow)
            .where(ModelRow.name == "broken")
            .values(config={"seconds_per_step": "slow"})
        )
    assert await env.worker.recover_expired() == {good: JobStatus.queued}
    assert (await env.row(broken)).status == "running"


async def test_a_bad_payload_fails_with_its_own_error(env: Env) -> None:
    await env.model()
    job_id = await env.job()
    async with transaction(env.sessions) as session:
        await session.execute(update(JobRow).where(JobRow.id == job_id).values(payload=b"not zstd"))
    await env.worker.process(await env.claim())
    row = await env.row(job_id)
    assert row.status == "failed" and row.attempts == 1
    assert row.error["type"] == "ZstdError"


async def test_once_the_model_step_is_known_the_claim_records_the_start(env: Env) -> None:
    await env.model()
    first, second = await env.job(), await env.job()
    claim = await env.claim()
    assert claim.start_step is None  # a new model: the worker asks the backend first
    await env.worker.process(claim)
    claim = await env.claim()
    assert claim.start_step == 1 and (await env.row(second)).start_step == 1
    await env.worker.process(claim)
    row = await env.row(second)
    assert (row.status, row.start_step, row.final_step) == ("succeeded", 1, 2)
    assert await env.events(second) == await env.events(first)  # the same story, in order
    assert len(env.backend.calls) == 2


async def test_a_worker_dying_right_after_a_claim_with_a_known_step(env: Env) -> None:
    from app.backends.base import ModelSpec

    await env.model()
    await env.worker.process(await env.claim_after_job())
    retried = await env.job()
    # Dies before training: the backend is still at the recorded step -> retried.
    assert (await env.claim()).start_step == 1
    await env.expire(retried)
    assert await env.worker.recover_expired() == {retried: JobStatus.queued}
    await env.make_eligible(retried)
    await env.worker.process(await env.claim())
    assert (await env.row(retried)).final_step == 2
    # Dies after the step landed: the backend moved past the recorded step -> counted once.
    recovered = await env.job()
    assert (await env.claim()).start_step == 2
    await env.worker.backends.get("dry-run").train(ModelSpec("agent", "", "", {}), [], {})
    await env.expire(recovered)
    assert await env.worker.recover_expired() == {recovered: JobStatus.succeeded}
    row = await env.row(recovered)
    assert (row.status, row.recovered, row.start_step, row.final_step) == (
        "succeeded",
        True,
        2,
        3,
    )


async def test_a_step_taken_outside_trainyard_is_read_before_training(env: Env) -> None:
    from app.backends.base import ModelSpec

    await env.model()
    await env.worker.process(await env.claim_after_job())
    job_id = await env.job()
    await env.worker.backends.get("dry-run").train(ModelSpec("agent", "", "", {}), [], {})
    claim = await env.claim()
    assert claim.start_step == 1  # what Trainyard last knew
    await env.worker.process(claim)
    row = await env.row(job_id)
    assert (row.status, row.start_step, row.final_step) == ("succeeded", 2, 3)


async def test_a_batch_claim_looks_past_a_page_of_one_models_jobs(env: Env) -> None:
    await env.model("a")
    await env.model("b")
    a_jobs = [await env.job("a") for _ in range(8)]
    b1 = await env.job("b")
    claims = await env.store.claim(owner="test", lease_seconds=30, limit=2)
    assert [c.lease.job_id for c in claims] == [a_jobs[0], b1]


async def test_triggers_signal_queued_jobs_and_events_to_other_processes(env: Env) -> None:
    if env.engine.dialect.name != "postgresql":
        pytest.skip("LISTEN/NOTIFY is Postgres'")
    import asyncio

    import asyncpg

    from app.notify import EVENTS_CHANNEL, JOBS_CHANNEL

    url = env.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(url)
    received: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    for channel in (JOBS_CHANNEL, EVENTS_CHANNEL):
        await conn.add_listener(
            channel, lambda _c, _p, ch, payload: received.put_nowait((ch, payload))
        )
    try:
        await env.model()
        job_id = await env.job()
        got = {await asyncio.wait_for(received.get(), 5) for _ in range(2)}
        assert got == {(JOBS_CHANNEL, job_id), (EVENTS_CHANNEL, job_id)}
        await env.claim()  # a worker's write: its event is signalled too
        assert await asyncio.wait_for(received.get(), 5) == (EVENTS_CHANNEL, job_id)
    finally:
        await conn.close()


async def test_a_final_write_waits_out_a_database_that_is_away(env: Env) -> None:
    if env.engine.dialect.name != "sqlite":
        pytest.skip("a write lock held from outside is SQLite's way to be away")
    import asyncio
    import sqlite3

    await env.model()
    job_id = await env.job()
    claim = await env.claim()
    engine = create_engine(env.settings.database_url, sqlite_busy_timeout=0.05)
    lock = sqlite3.connect(env.engine.url.database, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        write = asyncio.create_task(store_for(engine).apply(claim.lease, Succeeded({})))
        await asyncio.sleep(0.5)  # the database stays away for a while
        assert not write.done()
        lock.execute("COMMIT")
        assert await write is JobStatus.succeeded
        assert (await env.row(job_id)).status == "succeeded"
    finally:
        lock.close()
        await engine.dispose()


async def test_a_worker_whose_database_is_away_at_start_announces_itself_once_back(
    env: Env,
) -> None:
    """A `trainyard worker` that starts while its database restarts keeps going (it used
    to exit on its first heartbeat): its loop announces it once the database is back."""
    if env.engine.dialect.name != "sqlite":
        pytest.skip("a write lock held from outside is SQLite's way to be away")
    import sqlite3

    engine = create_engine(env.settings.database_url, sqlite_busy_timeout=0.05)
    worker = Worker(
        settings=env.settings,
        store=store_for(engine),
        backends=Backends(env.settings, {"dry-run": env.backend}),
        notifier=Notifier(),
    )
    lock = sqlite3.connect(env.engine.url.database, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        await worker.start()
        assert worker.last_heartbeat is None
        lock.execute("COMMIT")

        async def announced() -> bool:
            async with engine.connect() as conn:
                found = await conn.scalar(select(workers.c.id).where(workers.c.id == worker.id))
            return found is not None

        await until(announced, what="the worker's first heartbeat")
    finally:
        lock.close()
        await worker.stop()
        await engine.dispose()


async def test_a_rollout_whose_worker_died_is_settled_by_rollout_rules(env: Env) -> None:
    from app.backends.base import ModelSpec
    from app.db import write_connection
    from app.jobs.lifecycle import JobKind
    from app.jobs.store import enqueue, new_job
    from app.jobs.supervise import started_event
    from app.rollouts import spec as rollout_spec
    from app.schemas.rollouts import RolloutJobCreate

    await env.model()
    body = RolloutJobCreate.model_validate(
        {
            "model": "agent",
            "examples": [{"id": 1, "messages": [{"role": "user", "content": "hi"}]}],
            "grader": {"type": "regex", "pattern": "h"},
        }
    )
    job = new_job(
        JobKind.rollout,
        model="agent",
        payload=rollout_spec.encode(rollout_spec.RolloutSpec.of(body)),
        summary={},
        request_hash="r",
        max_attempts=2,
    )
    async with write_connection(env.engine) as conn:
        await enqueue(conn, job)
    adapter = env.worker.backends.get("dry-run")
    spec = ModelSpec("agent", "tests", "tiny/base", {})
    for expected in (JobStatus.queued, JobStatus.failed):
        claim = await env.claim()
        assert claim is not None and claim.lease.kind is JobKind.rollout
        step = await adapter.get_step(spec)
        started = started_event(claim.lease, step, {})
        assert await env.store.record_start(claim.lease, start_step=step, event=started)
        # The model moved on meanwhile: a training job would count that step as its own;
        # a rollout trains nothing, so it is retried, then failed.
        await adapter.train(spec, [], {})
        await env.expire(job.id)
        assert await env.worker.recover_expired() == {job.id: expected}
        await env.make_eligible(job.id)
    row = await env.row(job.id)
    assert (row.status, row.recovered, row.final_step) == ("failed", False, None)
    assert row.error["type"] == "LeaseExpired"
    types = await env.events(job.id)
    assert types[-1] == "rollout_failed" and "job_retrying" in types
    assert types.count("rollout_started") == 2
    assert not [t for t in types if t.startswith("training_")]
