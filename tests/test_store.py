"""The queue store's contract, run against both implementations (SQLite and Postgres):
whatever the dialect, the same calls leave the same rows and events."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Interval, func, insert, select, text, type_coerce, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db import utcnow, write_connection
from app.jobs.lifecycle import (
    Cancelled,
    ErrorInfo,
    EventType,
    Failed,
    JobKind,
    JobStatus,
    JobUpdate,
    NewJob,
    Released,
    Retry,
    Succeeded,
)
from app.jobs.payloads import Payload
from app.jobs.statements import LeaseClock, jobs, models
from app.jobs.store import (
    Claim,
    LeftOut,
    PostgresStore,
    QueueStore,
    SqliteStore,
    enqueue,
    new_job,
)
from app.models import DEFAULT_PROJECT_ID, JobEventRow
from app.training import spec
from tests import factories as f

ERROR = ErrorInfo(type="ConnectionError", message="refused", transient=True)


def _payload() -> Payload:
    return spec.encode([g for g in f.art_groups([[1.0, 0.0]])])


async def _model(store: QueueStore, name: str, project_id: str = DEFAULT_PROJECT_ID) -> None:
    async with write_connection(store.engine) as conn:
        await conn.execute(
            insert(models).values(
                name=name,
                project="p",
                base_model="tiny/base",
                backend="dry-run",
                config={},
                current_step=3,
                step_known=True,
                created_at=utcnow(),
                updated_at=utcnow(),
                project_id=project_id,
            )
        )


def _new_job(model: str) -> NewJob:
    return new_job(
        JobKind.training,
        model=model,
        payload=_payload(),
        summary={},
        request_hash="h",
        max_attempts=2,
    )


async def _job(store: QueueStore, model: str, kind: JobKind = JobKind.training) -> str:
    job = new_job(
        kind,
        model=model,
        payload=_payload(),
        summary={"num_groups": 1},
        request_hash="h",
        max_attempts=2,
    )
    async with write_connection(store.engine) as conn:
        await enqueue(conn, job)
    return job.id


async def _events(store: QueueStore, job_id: str) -> list[tuple[int, str, dict]]:
    async with store.engine.connect() as conn:
        rows = await conn.execute(
            select(JobEventRow.seq, JobEventRow.type, JobEventRow.data, JobEventRow.created_at)
            .where(JobEventRow.job_id == job_id)
            .order_by(JobEventRow.seq)
        )
        rows = rows.all()
    times = [r.created_at for r in rows]
    assert times == sorted(times), "events are stamped in the order they were written"
    return [(r.seq, r.type, r.data) for r in rows]


async def _row(store: QueueStore, job_id: str):
    async with store.engine.connect() as conn:
        return (await conn.execute(select(jobs).where(jobs.c.id == job_id))).one()


async def _claim(store: QueueStore, limit: int = 1) -> list[Claim]:
    return await store.claim(owner="w1", lease_seconds=30, limit=limit)


async def test_the_store_is_chosen_by_the_engines_dialect(store: QueueStore) -> None:
    expected = PostgresStore if store.engine.dialect.name == "postgresql" else SqliteStore
    assert type(store) is expected


async def test_enqueue_and_claim(store: QueueStore) -> None:
    await _model(store, "a")
    await _model(store, "b")
    a1, a2, b1 = await _job(store, "a"), await _job(store, "a"), await _job(store, "b")
    assert await _events(store, a1) == [(1, "job_queued", {"summary": {"num_groups": 1}})]
    claims = await _claim(store, limit=3)
    assert [c.lease.job_id for c in claims] == [a1, b1]  # one per model, oldest first
    first = claims[0]
    assert (first.lease.kind, first.lease.attempt, first.start_step) == (JobKind.training, 1, 3)
    assert first.payload.format == spec.V1 and len(spec.decode(first.payload)) == 1
    assert (await _row(store, a2)).status == "queued"
    assert await _claim(store) == []
    assert (await _events(store, a1))[-1] == (2, "job_claimed", {"worker": "w1", "attempt": 1})


async def test_a_claim_inside_a_write_holds_only_if_it_commits(store: QueueStore) -> None:
    """`claim_in`: a run's move queues its child and claims it in one transaction."""
    await _model(store, "a")
    queued = _new_job("a")

    class Undone(Exception):
        pass

    with pytest.raises(Undone):  # the child queued and claimed, then the write fails
        async with write_connection(store.engine) as conn:
            await enqueue(conn, queued)
            assert [
                c.lease.job_id for c in await store.claim_in(conn, owner="w1", lease_seconds=30)
            ] == [queued.id]
            raise Undone
    async with store.engine.connect() as conn:
        assert (await conn.scalar(select(func.count()).select_from(jobs))) == 0
    async with write_connection(store.engine) as conn:
        await enqueue(conn, queued)
        claims = await store.claim_in(conn, owner="w1", lease_seconds=30, limit=2)
    assert [c.lease.job_id for c in claims] == [queued.id]
    row = await _row(store, queued.id)
    assert (row.status, row.lease_owner, row.lease_token) == (
        "running",
        "w1",
        claims[0].lease.token,
    )
    assert [t for _, t, _ in await _events(store, queued.id)] == ["job_queued", "job_claimed"]
    assert await _claim(store) == []


@pytest.mark.parametrize("retry", [True, False], ids=["retried", "once"])
async def test_a_claim_that_collides_in_a_transaction_looks_again_or_raises(
    store: QueueStore, retry: bool
) -> None:
    """A claim collides where another worker's claim of the same model commits after the
    look's snapshot (Postgres; here another transaction sets the model's first job
    running and commits while the look waits on it). `claim_in` looks again in a
    savepoint and finds nothing left; `retry=False` (a run's joined move: no savepoint,
    two round trips fewer) raises, and its caller's transaction is rolled back."""
    if not isinstance(store, PostgresStore):
        pytest.skip("SQLite: the caller's BEGIN IMMEDIATE holds the file, no claim collides")
    await _model(store, "a")
    one, two = _new_job("a"), _new_job("a")
    async with write_connection(store.engine) as conn:
        await enqueue(conn, one)
        await enqueue(conn, two)

    async def other() -> list[Claim]:
        async with write_connection(store.engine) as conn:
            return await store.claim_in(conn, owner="w2", lease_seconds=30, retry=retry)

    async with write_connection(store.engine) as conn:
        running = update(jobs).where(jobs.c.id == one.id).values(status="running")
        await conn.execute(running)
        task = asyncio.create_task(other())
        await _waits_on_a_lock(store, task)  # w2 took `two`, and waits on `one`'s row
    if retry:
        assert await task == []
    else:
        with pytest.raises(IntegrityError):
            await task
    assert [(await _row(store, job.id)).status for job in (one, two)] == ["running", "queued"]


async def _waits_on_a_lock(store: QueueStore, task: asyncio.Task[Any]) -> None:
    """Until some backend of this database waits on a lock (the deadline only ends a test
    that would otherwise hang)."""
    deadline = asyncio.get_running_loop().time() + 60
    query = text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    while not task.done():
        async with store.engine.connect() as conn:
            if await conn.scalar(query):
                return
        assert asyncio.get_running_loop().time() < deadline, "the second claim never waited"
        await asyncio.sleep(0.01)
    task.result()  # it ended without waiting: say why


class _Joined:
    """Joined work (`QueueStore.apply(joined=...)`) that queues a job of its own and says
    what it saw, in the order it saw it."""

    def __init__(self, store: QueueStore, job_id: str, *, leave_out: bool = False) -> None:
        self.store, self.job_id, self.leave_out = store, job_id, leave_out
        self.seen: list[str] = []
        self.queued = _new_job("b")

    async def lock(self, conn: AsyncConnection) -> None:
        self.seen.append("lock: " + await self._status(conn))

    async def then(self, conn: AsyncConnection) -> Callable[[], None]:
        self.seen.append("then: " + await self._status(conn))
        await enqueue(conn, self.queued)
        if self.leave_out:
            raise LeftOut("not this time")
        return lambda: self.seen.append("committed")

    async def _status(self, conn: AsyncConnection) -> str:
        return str(await conn.scalar(select(jobs.c.status).where(jobs.c.id == self.job_id)))


async def test_joined_work_commits_with_the_final_write_or_is_left_out(store: QueueStore) -> None:
    """A run's child ends and its run moves in one transaction (`app.runs.driver`): the
    joined work locks first, then runs after the job's write, in its transaction, and what
    follows it runs once that committed. Work that cannot be done is rolled back with the
    whole write, and the job's write is made again alone; a lost lease runs none of it.
    On SQLite, whose write transaction holds the whole file from its start, nothing is
    locked row by row (`QueueStore.locks_rows`)."""
    lock = ["lock: running"] if store.locks_rows else []
    await _model(store, "a")
    await _model(store, "b")
    ids = [await _job(store, "a") for _ in range(3)]
    claims = []
    for _ in ids:  # one running job per model: each ends before the next is claimed
        [claim] = await _claim(store)
        claims.append(claim)
        joined = _Joined(store, claim.lease.job_id, leave_out=len(claims) == 2)
        if len(claims) == 3:  # another worker took the job over: the write matches nothing
            async with write_connection(store.engine) as conn:
                await conn.execute(
                    update(jobs).where(jobs.c.id == claim.lease.job_id).values(lease_token="w2's")
                )
        written = await store.apply(claim.lease, Succeeded({}), joined=joined)
        if len(claims) == 1:
            assert written is JobStatus.succeeded
            assert joined.seen == [*lock, "then: succeeded", "committed"]
            assert (await _row(store, joined.queued.id)).status == "queued"
            async with write_connection(store.engine) as conn:  # out of the way of the next
                await conn.execute(
                    update(jobs).where(jobs.c.id == joined.queued.id).values(status="cancelled")
                )
        elif len(claims) == 2:
            assert written is JobStatus.succeeded  # alone, the second time
            assert joined.seen == [*lock, "then: succeeded"]
            async with store.engine.connect() as conn:
                assert (
                    await conn.scalar(select(jobs.c.id).where(jobs.c.id == joined.queued.id))
                    is None
                )
        else:
            assert written is None
            assert joined.seen == lock
        assert (await _row(store, claim.lease.job_id)).status == (
            "running" if len(claims) == 3 else "succeeded"
        )


async def test_heartbeat_and_start_record(store: QueueStore) -> None:
    await _model(store, "a")
    job_id = await _job(store, "a")
    [claim] = await _claim(store)
    step = (EventType.gradient_step, {"step": 1})
    beat = await store.heartbeat(claim.lease, lease_seconds=30, progress=(1, 4), events=[step])
    assert (beat.alive, beat.cancel_requested) == (True, False)
    started = (EventType.training_started, {"start_step": 5})
    assert await store.record_start(claim.lease, start_step=5, event=started)
    row = await _row(store, job_id)
    assert (row.progress_step, row.progress_total, row.start_step) == (1, 4, 5)
    assert [t for _, t, _ in await _events(store, job_id)][-2:] == [
        "gradient_step",
        "training_started",
    ]


async def test_each_outcome_is_one_guarded_write(store: QueueStore) -> None:
    for name in "abcde":
        await _model(store, name)
    ids = [await _job(store, name) for name in "abcde"]
    claims = {c.lease.job_id: c for c in await _claim(store, limit=5)}
    child = new_job(
        JobKind.training,
        model="a",
        payload=_payload(),
        summary={},
        request_hash="c",
        max_attempts=1,
        queued_event={"after": ids[0]},
    )
    outcomes = [
        Succeeded({"final_step": 4}, job={"final_step": 4}, model={"current_step": 4}, child=child),
        Failed(ERROR),
        Retry(ERROR, delay_s=60),
        Cancelled("running"),
        Released("w1"),
    ]
    expected = ["succeeded", "failed", "queued", "cancelled", "queued"]
    for job_id, outcome, status in zip(ids, outcomes, expected, strict=True):
        lease = claims[job_id].lease
        assert await store.apply(lease, outcome) == status
        assert await store.apply(lease, outcome) is None  # the token is spent
        row = await _row(store, job_id)
        assert (row.status, row.lease_token) == (status, None)
    assert (await _row(store, ids[0])).final_step == 4
    assert await _events(store, child.id) == [(1, "job_queued", {"after": ids[0]})]
    retried = await _row(store, ids[2])
    assert retried.not_before > utcnow() + timedelta(seconds=25) and retried.attempts == 1
    released = await _row(store, ids[4])
    assert released.attempts == 0 and released.not_before <= utcnow()
    async with store.engine.connect() as conn:
        step = await conn.scalar(select(models.c.current_step).where(models.c.name == "a"))
    assert step == 4


async def test_a_retry_after_a_cancel_request_cancels(store: QueueStore) -> None:
    await _model(store, "a")
    job_id = await _job(store, "a")
    [claim] = await _claim(store)
    async with write_connection(store.engine) as conn:
        await conn.execute(update(jobs).where(jobs.c.id == job_id).values(cancel_requested=True))
    assert await store.apply(claim.lease, Retry(ERROR, 0)) is JobStatus.cancelled
    assert (await _events(store, job_id))[-1][1:] == (
        "job_cancelled",
        {"while": "retrying", "error": dict(ERROR)},
    )


async def test_each_attempts_tokens_count_with_the_earlier_attempts(store: QueueStore) -> None:
    """A job's tokens are what every attempt used: a retried attempt's are added to the
    next one's, and a retry that meets a cancel keeps what its attempt sampled."""
    await _model(store, "a")
    job_id = await _job(store, "a", JobKind.rollout)
    [claim] = await _claim(store)
    sampled = JobUpdate(prompt_tokens=10, completion_tokens=20)
    assert await store.apply(claim.lease, Retry(ERROR, 0, job=sampled)) == "queued"
    [claim] = await _claim(store)
    ended = Succeeded({}, job=JobUpdate(prompt_tokens=1, completion_tokens=2))
    assert await store.apply(claim.lease, ended) == "succeeded"
    row = await _row(store, job_id)
    assert (row.prompt_tokens, row.completion_tokens, row.trained_tokens) == (11, 22, None)

    job_id = await _job(store, "a", JobKind.rollout)
    [claim] = await _claim(store)
    async with write_connection(store.engine) as conn:
        await conn.execute(update(jobs).where(jobs.c.id == job_id).values(cancel_requested=True))
    assert await store.apply(claim.lease, Retry(ERROR, 0, job=sampled)) == "cancelled"
    row = await _row(store, job_id)
    assert (row.prompt_tokens, row.completion_tokens) == (10, 20)


async def _expire(store: QueueStore, job_id: str) -> None:
    async with write_connection(store.engine) as conn:
        await conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id)
            .values(lease_expires_at=utcnow() - timedelta(seconds=1))
        )


async def test_recovery_writes_only_while_the_lease_is_still_expired(store: QueueStore) -> None:
    await _model(store, "a")
    job_id = await _job(store, "a")
    [claim] = await _claim(store)
    assert await store.expired() == []
    await _expire(store, job_id)
    [state] = await store.expired()
    assert state.lease == claim.lease and state.start_step == 3
    assert await store.lease_state(claim.lease) == state
    # Its worker renewed the lease after recovery read it: the recovery's write is void.
    await store.heartbeat(claim.lease, lease_seconds=300)
    assert await store.apply(claim.lease, Retry(ERROR, 0), only_if_expired=True) is None
    assert (await _row(store, job_id)).status == "running"
    assert await store.apply(claim.lease, Failed(ERROR), only_if_expired=True) is None
    await _expire(store, job_id)
    assert await store.apply(claim.lease, Failed(ERROR), only_if_expired=True) == "failed"


async def test_a_retried_job_keeps_its_place_in_the_queue(store: QueueStore) -> None:
    for name in "abc":
        await _model(store, name)
    a1 = await _job(store, "a")
    b1, c1 = await _job(store, "b"), await _job(store, "c")
    [claim] = await _claim(store)
    assert claim.lease.job_id == a1
    assert await store.apply(claim.lease, Retry(ERROR, delay_s=0)) == "queued"
    # Due again at once: it was submitted first, so it is taken first.
    assert [c.lease.job_id for c in await _claim(store, limit=3)] == [a1, b1, c1]


async def test_postgres_leases_run_on_the_database_clock(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    if store.clock is not LeaseClock.DATABASE:
        pytest.skip("SQLite runs on one host: its leases use the writer's clock")
    await _model(store, "a")
    job_id = await _job(store, "a")
    # This worker's host clock runs an hour ahead: it must neither see live leases as
    # expired nor stamp a lease that outlives its time.
    skewed = utcnow() + timedelta(hours=1)
    monkeypatch.setattr("app.jobs.store.utcnow", lambda: skewed)
    [claim] = await _claim(store)
    async with store.engine.connect() as conn:
        lease_left = await conn.scalar(
            select(type_coerce(jobs.c.lease_expires_at - func.clock_timestamp(), Interval())).where(
                jobs.c.id == job_id
            )
        )
    assert timedelta(seconds=25) < lease_left <= timedelta(seconds=30)
    assert await store.expired() == []
    await store.heartbeat(claim.lease, lease_seconds=30)
    assert await store.apply(claim.lease, Failed(ERROR), only_if_expired=True) is None
    assert (await _row(store, job_id)).status == "running"
