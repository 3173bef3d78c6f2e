"""The queue store: the database side of the job lifecycle, and the only code that writes a
job's status or its events.

`QueueStore` holds the dialect-neutral algorithm (heartbeats, start records, recovery
reads, the transaction form of a final write) and `store_for` picks its dialect once,
where the engine is built: `SqliteStore` takes jobs inside one `BEGIN IMMEDIATE`
transaction (one process writes); `PostgresStore` makes the hot path, a claim and a final
write, one statement each (`app.jobs.statements`), run outside a transaction so it commits
by itself. Paths that are not hot (enqueueing, cancel, a child job, work joined to a final
write: a run's move) have one implementation for both.

Every write to a running job is guarded by its lease token: a worker that lost its lease
(another recovered the job) matches zero rows, and stops.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, ClassVar, Protocol, cast

from sqlalchemy import Row, exists, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from app.backends.base import ModelSpec
from app.db import is_unavailable, json_dumps, utcnow, write_connection
from app.jobs import statements
from app.jobs.events import Executor, add_events, append_event
from app.jobs.lifecycle import (
    Cancelled,
    Event,
    EventType,
    FinalWrite,
    JobKind,
    JobStatus,
    JobUpdate,
    ModelUpdate,
    NewJob,
    Outcome,
    Retry,
    plan,
)
from app.jobs.outbox import webhook_type
from app.jobs.payloads import Payload
from app.jobs.pools import Capabilities
from app.jobs.statements import RUNNING, jobs, models, workers
from app.models import JobRow

log = logging.getLogger(__name__)
# How long a final write keeps trying while the database is away.
FINAL_WRITE_RETRY_SECONDS = 15.0
# Times a claim looks again after colliding with another worker's on the same model.
CLAIM_COLLISIONS = 8


@dataclass(frozen=True)
class Lease:
    job_id: str
    token: str
    owner: str
    model_name: str
    kind: JobKind
    attempt: int


@dataclass(frozen=True)
class Claim:
    """A claimed job with all a worker needs to run it, read in the claiming statement."""

    lease: Lease
    model: ModelSpec
    backend: str
    payload: Payload
    hyperparameters: dict[str, Any]
    max_attempts: int
    # The model's step as recorded with the claim (None: not known; the worker reads the
    # backend's and records it before training). Recovery compares the backend against it.
    start_step: int | None = None
    # Where the trajectories came from, and how stale they may be (see TrainingJobCreate).
    policy_step: int | None = None
    max_steps_off_policy: int | None = None


@dataclass(frozen=True)
class Heartbeat:
    alive: bool  # False: the lease is gone, stop and discard the work
    cancel_requested: bool


@dataclass(frozen=True)
class LeaseState:
    """What settling a job whose worker is gone needs to know of it."""

    lease: Lease
    start_step: int | None
    cancel_requested: bool
    max_attempts: int


# -- new jobs (both dialects) ---------------------------------------------------------------


class Joined(Protocol):
    """Work joined to a job's final write, in its transaction, so that the two commit
    together: a run's next move when its child ends (`app.runs.driver.JoinedMove`)."""

    async def lock(self, conn: AsyncConnection) -> None:
        """First in the transaction, before the job's row: the locks the work takes that
        other writers take before a job's row (a run's row comes before its children's).
        Not called where the transaction holds the whole database (`locks_rows`)."""

    async def then(self, conn: AsyncConnection) -> Callable[[], None]:
        """Last, only where the job's write matched. Returns what to do once the
        transaction has committed. Raises `LeftOut` where it cannot be done: the
        transaction rolls back and the job's write is made again without it."""


class LeftOut(Exception):
    """Joined work that cannot be done in this write (`Joined.then`)."""


def new_job_id() -> str:
    """Time-ordered ids, so listing newest-first is an index scan on the primary key."""
    return f"job_{time.time_ns() // 1000:014x}{secrets.token_hex(5)}"


def new_job(
    kind: JobKind,
    *,
    model: str,
    payload: Payload,
    summary: dict[str, Any],
    request_hash: str,
    max_attempts: int,
    hyperparameters: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    policy_step: int | None = None,
    max_steps_off_policy: int | None = None,
    queued_event: dict[str, Any] | None = None,
    job_id: str | None = None,
) -> NewJob:
    """The one factory of job rows, for every creator (the API, a job's child, a run).
    `job_id`: a given id (a run's children have deterministic ones); default a new one."""
    return NewJob(
        id=job_id or new_job_id(),
        kind=kind,
        model_name=model,
        payload=payload.data,
        payload_format=payload.format,
        payload_bytes=payload.size,
        hyperparameters=hyperparameters or {},
        metadata=metadata or {},
        summary=summary,
        request_hash=request_hash,
        max_attempts=max_attempts,
        created_at=utcnow(),
        idempotency_key=idempotency_key,
        policy_step=policy_step,
        max_steps_off_policy=max_steps_off_policy,
        queued_event=queued_event if queued_event is not None else {"summary": summary},
    )


def _row_values(job: NewJob) -> dict[str, Any]:
    values = asdict(job)
    del values["queued_event"]
    return values | {
        "kind": job.kind.value,
        "status": JobStatus.queued.value,
        "attempts": 0,
        "not_before": job.created_at,
        "updated_at": job.created_at,
        "progress_step": 0,
        "cancel_requested": False,
        "recovered": False,
        "last_event_seq": 1,  # its first event, job_queued
    }


async def enqueue(executor: Executor, job: NewJob) -> JobRow:
    """Insert a queued job and its `job_queued` event in the caller's transaction; returns
    the row as a read would (no second query). An IntegrityError means its idempotency key
    is taken."""
    values = _row_values(job)
    await executor.execute(statements.enqueue_job(tuple(values)), values)
    await add_events(executor, job.id, 1, [(EventType.job_queued, job.queued_event)])
    return JobRow(
        id=job.id,
        kind=job.kind.value,
        model_name=job.model_name,
        status=JobStatus.queued.value,
        hyperparameters=job.hyperparameters,
        meta=job.metadata,
        summary=job.summary,
        attempts=0,
        max_attempts=job.max_attempts,
        cancel_requested=False,
        progress_step=0,
        policy_step=job.policy_step,
        max_steps_off_policy=job.max_steps_off_policy,
        created_at=job.created_at,
    )


async def enqueue_new(conn: AsyncConnection, job: NewJob) -> bool:
    """Insert a queued job unless a job of its id exists; True where it inserted. Its
    `job_queued` event is the caller's to add (`queued_event`), with others in one insert."""
    values = _row_values(job)
    statement = statements.enqueue_job_once(conn.dialect.name, tuple(values))
    return (await conn.execute(statement, values)).first() is not None


def queued_event(job: NewJob) -> tuple[str, int, list[Event]]:
    """The `job_queued` event of a job `enqueue_new` inserted, as `add_events_of` takes it."""
    return (job.id, 1, [(EventType.job_queued, job.queued_event)])


async def request_cancel(session: AsyncSession, job: JobRow) -> None:
    """Queued: cancelled now. Running: flagged; its worker interrupts it and applies the
    outcome. Caller holds the row (`FOR UPDATE`) in a write transaction and checked that
    the job is not final."""
    await cancel_job_now(session, job.id)
    await session.refresh(job)


async def cancel_job_now(executor: Executor, job_id: str) -> None:
    """The one way a job is asked to stop, for a route and for a run's driver alike:
    queued, cancelled at once; running, flagged (its worker, or its run's driver, ends
    it); final or gone, nothing. In the caller's write transaction."""
    row = (
        await executor.execute(
            select(jobs.c.status, jobs.c.cancel_requested).where(jobs.c.id == job_id)
        )
    ).one_or_none()
    if row is None or JobStatus(row.status).is_final:
        return
    if row.status == JobStatus.queued.value:
        now = utcnow()
        await executor.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status == JobStatus.queued.value)
            .values(status=JobStatus.cancelled.value, finished_at=now, updated_at=now)
        )
        await append_event(executor, job_id, (EventType.job_cancelled, {"while": "queued"}))
    elif not row.cancel_requested:
        await executor.execute(
            update(jobs)
            .where(jobs.c.id == job_id)
            .values(cancel_requested=True, updated_at=utcnow())
        )
        await append_event(executor, job_id, (EventType.cancel_requested, {}))


# -- the store ------------------------------------------------------------------------------


def _lease_params(lease: Lease) -> dict[str, Any]:
    return {"g_id": lease.job_id, "g_token": lease.token}


def _write_params(
    lease: Lease, values: JobUpdate, events: Sequence[Event]
) -> tuple[tuple[str, ...], dict[str, Any]]:
    columns = cast(dict[str, Any], values)
    keys = tuple(sorted(columns))
    params = {f"v_{key}": columns[key] for key in keys}
    params |= _lease_params(lease) | {"g_events": len(events), "g_now": utcnow()}
    return keys, params


def _model_params(name: str, values: ModelUpdate) -> tuple[tuple[str, ...], dict[str, Any]]:
    columns = cast(dict[str, Any], values)
    keys = tuple(sorted(columns))
    return keys, {"m_name": name} | {f"m_{key}": columns[key] for key in keys}


def _claim(
    look: Row[Any], taken: Row[Any], *, token: str, owner: str, start_step: int | None
) -> Claim:
    """`look`: the job's id, kind and model as the claim read them; `taken`: the taken job
    (on Postgres, one row holds both)."""
    return Claim(
        lease=Lease(look.id, token, owner, look.model_name, JobKind(look.kind), taken.attempts),
        model=ModelSpec(look.model_name, look.project, look.base_model, look.config),
        backend=look.backend,
        payload=Payload(taken.payload_format, taken.payload, taken.payload_bytes),
        hyperparameters=taken.hyperparameters,
        max_attempts=taken.max_attempts,
        start_step=start_step,
        policy_step=taken.policy_step,
        max_steps_off_policy=taken.max_steps_off_policy,
    )


class QueueStore(ABC):
    """Claims, leases and guarded writes. Subclasses override only what differs per
    dialect: `claim`, the one-statement final write, and the clock leases run on
    (`statements.LeaseClock`)."""

    clock: ClassVar[statements.LeaseClock] = statements.LeaseClock.WRITER
    locks_rows: ClassVar[bool] = True
    """Whether a write transaction locks rows one by one (`Joined.lock`); False where it
    holds the whole database from its start (SQLite's `BEGIN IMMEDIATE`)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def _lease_for(self, seconds: float) -> dict[str, Any]:
        """Parameters of a lease taken or renewed now for `seconds`."""
        return self.clock.lease_params(seconds)

    @abstractmethod
    async def claim(
        self,
        *,
        owner: str,
        lease_seconds: float,
        limit: int = 1,
        capabilities: Capabilities | None = None,
    ) -> list[Claim]:
        """Take up to `limit` of the oldest eligible queued jobs, at most one per model.
        Never two running jobs per model. Fewer than `limit`: no other job is eligible.
        `capabilities`: only jobs a worker with them can run (`app.jobs.pools`); None:
        any job."""

    @abstractmethod
    async def claim_in(
        self,
        conn: AsyncConnection,
        *,
        owner: str,
        lease_seconds: float,
        limit: int = 1,
        capabilities: Capabilities | None = None,
        retry: bool = True,
    ) -> list[Claim]:
        """`claim` inside the caller's open write transaction (a run's move claims the
        children it queues in its own): the claims hold once it commits. `retry` False:
        one look, where a collision with another worker's claim raises IntegrityError and
        aborts the caller's transaction (Postgres: no savepoint, two round trips fewer;
        `JoinedMove`'s write is then made again without the move)."""

    async def heartbeat(
        self,
        lease: Lease,
        *,
        lease_seconds: float,
        progress: tuple[int, int | None] | None = None,
        events: Sequence[Event] = (),
    ) -> Heartbeat:
        """Extend the lease, record progress and events, learn whether cancel was asked."""
        params = _lease_params(lease) | self._lease_for(lease_seconds)
        params |= {"g_events": len(events), "g_now": utcnow()}
        if progress is not None:
            params["v_step"], params["v_total"] = progress
        async with write_connection(self.engine) as conn:
            statement = statements.heartbeat(with_progress=progress is not None, clock=self.clock)
            row = (await conn.execute(statement, params)).one_or_none()
            if row is None:
                return Heartbeat(alive=False, cancel_requested=False)
            await add_events(conn, lease.job_id, row.last_event_seq, events)
            return Heartbeat(alive=True, cancel_requested=row.cancel_requested)

    async def record_start(self, lease: Lease, *, start_step: int, event: Event) -> bool:
        """Write the model's step, as the backend just reported it, before the work:
        recovery compares against it. The model row learns it too, so later claims record
        it at once. False: the lease was lost."""
        async with write_connection(self.engine) as conn:
            job = JobUpdate(start_step=start_step)
            if await self._write_job(conn, lease, job, [event]) is None:
                return False
            model = ModelUpdate(current_step=start_step, step_known=True)
            await self._write_model(conn, lease.model_name, model)
            return True

    async def apply(
        self,
        lease: Lease,
        outcome: Outcome,
        *,
        earlier: Sequence[Event] = (),
        only_if_expired: bool = False,
        joined: Joined | None = None,
    ) -> JobStatus | None:
        """Apply a run's outcome in one write, guarded by the lease token. Returns the
        status written; None when the lease was lost.

        `only_if_expired` (recovery): write only if the lease is still expired by the
        lease clock, i.e. its worker did not come back and renew it meanwhile. A retry that
        finds a cancel asked meanwhile cancels the job instead. `joined`: more work in the
        same transaction, done once the job's write matched.
        """
        written = await self._apply(lease, outcome, earlier, only_if_expired, joined)
        if written is None and isinstance(outcome, Retry):
            cancelled = Cancelled("retrying", error=outcome.error, job=outcome.job)
            written = await self._apply(lease, cancelled, earlier, only_if_expired, joined)
        return written

    async def _apply(
        self,
        lease: Lease,
        outcome: Outcome,
        earlier: Sequence[Event],
        only_if_expired: bool,
        joined: Joined | None,
    ) -> JobStatus | None:
        write = plan(lease.kind, outcome, attempt=lease.attempt, now=utcnow(), earlier=earlier)
        return write.status if await self._final(lease, write, only_if_expired, joined) else None

    async def _final(
        self, lease: Lease, write: FinalWrite, only_if_expired: bool, joined: Joined | None
    ) -> bool:
        # A database that is away for a moment (restart, failover, a busy SQLite file) must
        # not cost a finished job its result: try again for a while. Safe to repeat: once a
        # write committed, the lease token is gone and a repeat matches nothing.
        delay, deadline = 0.1, time.monotonic() + FINAL_WRITE_RETRY_SECONDS
        while True:
            try:
                return await self._final_once(lease, write, only_if_expired, joined)
            except LeftOut as exc:  # rolled back: the job's write again, alone
                log.info("job %s: final write without its joined work: %s", lease.job_id, exc)
                joined = None
            except Exception as exc:
                if not is_unavailable(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning("job %s: final write failed (%s); retrying", lease.job_id, exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

    async def _final_once(
        self, lease: Lease, write: FinalWrite, only_if_expired: bool, joined: Joined | None
    ) -> bool:
        """The transaction form: guarded job update and events, a child job, the model,
        then the joined work."""
        committed: Callable[[], None] | None = None
        async with write_connection(self.engine) as conn:
            if joined is not None and self.locks_rows:
                await joined.lock(conn)
            if not await self._write_final(conn, lease, write, only_if_expired):
                return False
            if write.child is not None:
                await enqueue(conn, write.child)
            if joined is not None:
                committed = await joined.then(conn)
        if committed is not None:
            committed()
        return True

    async def _write_final(
        self, conn: AsyncConnection, lease: Lease, write: FinalWrite, only_if_expired: bool
    ) -> bool:
        """The job's guarded update, its events and its model's row; False where the job's
        update matched nothing (the lease is lost)."""
        seq = await self._write_job(
            conn,
            lease,
            write.job,
            write.events,
            only_if_expired=only_if_expired,
            unless_cancel_requested=write.unless_cancel_requested,
        )
        if seq is None:
            return False
        if write.model:
            await self._write_model(conn, lease.model_name, write.model)
        return True

    async def _write_job(
        self,
        conn: AsyncConnection,
        lease: Lease,
        values: JobUpdate,
        events: Sequence[Event],
        *,
        only_if_expired: bool = False,
        unless_cancel_requested: bool = False,
    ) -> int | None:
        """Guarded update of a running job that also numbers its new events; None if
        nothing matched (the lease is lost)."""
        keys, params = _write_params(lease, values, events)
        statement = statements.job_update(
            keys, only_if_expired, unless_cancel_requested, self.clock
        )
        seq = (await conn.execute(statement, params)).scalar_one_or_none()
        if seq is not None:
            await add_events(conn, lease.job_id, seq, events)
        return cast(int | None, seq)

    async def _write_model(self, conn: AsyncConnection, name: str, values: ModelUpdate) -> None:
        keys, params = _model_params(name, values)
        await conn.execute(statements.model_update(keys), params)

    async def set_inference(
        self, name: str, *, base_url: str | None, model_name: str, api_key: str | None
    ) -> None:
        """Where a model is served, and the key that endpoint takes for it (the step stays
        the jobs' to write)."""
        async with write_connection(self.engine) as conn:
            values = ModelUpdate(
                inference_base_url=base_url,
                inference_model_name=model_name,
                inference_api_key=api_key,
            )
            await self._write_model(conn, name, values)

    async def withdraw_inference(self, name: str, *, base_url: str) -> None:
        """A stopping worker no longer serves `name` at `base_url`: forget that endpoint,
        unless another worker has put its own there meanwhile."""
        async with write_connection(self.engine) as conn:
            await conn.execute(
                update(models)
                .where(models.c.name == name, models.c.inference_base_url == base_url)
                .values(inference_base_url=None, inference_api_key=None)
            )

    async def expired(self, *, limit: int = 20) -> list[LeaseState]:
        """Running jobs whose worker stopped renewing its lease (by the lease clock)."""
        now = self.clock.now()
        query = (
            statements.lease_state()
            .where(jobs.c.status == RUNNING, jobs.c.lease_expires_at < now)
            .order_by(jobs.c.lease_expires_at)
            .limit(limit)
        )
        async with self.engine.connect() as conn:
            rows = await conn.execute(query, {"g_now": utcnow()})
            return [_lease_state(row) for row in rows]

    async def lease_state(self, lease: Lease) -> LeaseState | None:
        """The job held by `lease`, if the lease still holds."""
        query = statements.lease_state().where(
            jobs.c.id == lease.job_id, jobs.c.lease_token == lease.token
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).one_or_none()
        return None if row is None else _lease_state(row)

    async def model_spec(self, name: str) -> tuple[ModelSpec, str]:
        """A model's spec and its backend's name."""
        query = select(
            models.c.project, models.c.base_model, models.c.config, models.c.backend
        ).where(models.c.name == name)
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).one()
        return ModelSpec(name, row.project, row.base_model, row.config), row.backend

    async def beat_worker(
        self,
        *,
        worker_id: str,
        hostname: str,
        pid: int,
        stopped: bool = False,
        draining: bool = False,
        registration: dict[str, Any] | None = None,
    ) -> bool:
        """Record a worker's heartbeat (registering it the first time, with
        `registration`: `app.jobs.pools.registration`). Returns whether a drain was asked
        of it."""
        now = utcnow()
        values: dict[str, Any] = {"heartbeat_at": now}
        if stopped:
            values["stopped_at"] = now
        if draining:
            values["draining"] = True
        async with write_connection(self.engine) as conn:
            row = (
                await conn.execute(
                    update(workers)
                    .where(workers.c.id == worker_id)
                    .values(**values)
                    .returning(workers.c.drain_requested)
                )
            ).one_or_none()
            if row is None:
                await conn.execute(
                    insert(workers).values(
                        id=worker_id,
                        hostname=hostname,
                        pid=pid,
                        started_at=now,
                        **values,
                        **(registration or {}),
                    )
                )
                return False
            return row.drain_requested is not None


def _lease_state(row: Row[Any]) -> LeaseState:
    lease = Lease(
        row.id,
        row.lease_token or "",
        row.lease_owner or "",
        row.model_name,
        JobKind(row.kind),
        row.attempts,
    )
    return LeaseState(lease, row.start_step, row.cancel_requested, row.max_attempts)


class SqliteStore(QueueStore):
    """One process writes: a claim looks and takes inside one BEGIN IMMEDIATE transaction."""

    locks_rows = False

    async def claim(
        self,
        *,
        owner: str,
        lease_seconds: float,
        limit: int = 1,
        capabilities: Capabilities | None = None,
    ) -> list[Claim]:
        for _ in range(CLAIM_COLLISIONS):
            try:
                async with write_connection(self.engine) as conn:
                    return await self._claim_once(
                        conn,
                        owner=owner,
                        lease_seconds=lease_seconds,
                        limit=limit,
                        capabilities=capabilities,
                    )
            except IntegrityError:
                # Another worker started a job of the same model between our read and write
                # (the partial unique index refused ours); look again.
                continue
        return []

    async def claim_in(
        self,
        conn: AsyncConnection,
        *,
        owner: str,
        lease_seconds: float,
        limit: int = 1,
        capabilities: Capabilities | None = None,
        retry: bool = True,
    ) -> list[Claim]:
        # The caller's BEGIN IMMEDIATE holds the file's write lock: no claim can collide.
        return await self._claim_once(
            conn, owner=owner, lease_seconds=lease_seconds, limit=limit, capabilities=capabilities
        )

    async def _claim_once(
        self,
        conn: AsyncConnection,
        *,
        owner: str,
        lease_seconds: float,
        limit: int,
        capabilities: Capabilities | None,
    ) -> list[Claim]:
        now = utcnow()
        fits = statements.fits_on_sqlite if capabilities is not None else None
        query = statements.claim_query(fits=fits, quota=statements.Quota.ALL)
        fit: dict[str, Any] = {}
        if capabilities is not None:
            fit = {
                "w_pool": capabilities.pool,
                "w_backends": list(capabilities.backends),
                "w_labels": capabilities.label_pairs(),
            }
        claims: list[Claim] = []
        while len(claims) < limit:
            wanted = limit - len(claims)
            rows = (await conn.execute(query, {"now": now, "page": wanted * 4, **fit})).all()
            picked: dict[str, Row[Any]] = {}
            room: dict[str, int] = {}  # what is left of each project's running quota
            for row in rows:
                if row.model_name in picked:
                    continue
                if row.room is not None:
                    left = room.setdefault(row.project_id, row.room)
                    if left <= 0:
                        continue
                    room[row.project_id] = left - 1
                picked[row.model_name] = row
                if len(picked) == wanted:
                    break
            for row in picked.values():
                claims.append(
                    await self._take(conn, row, owner=owner, now=now, lease_seconds=lease_seconds)
                )
            if len(rows) < wanted * 4:
                break  # every eligible job was seen; fewer than `limit` means none is left
            # The page held several jobs of one model: look past them (the models just
            # claimed are busy now, so they drop out).
        return claims

    async def _take(
        self,
        conn: AsyncConnection,
        row: Row[Any],
        *,
        owner: str,
        now: datetime,
        lease_seconds: float,
    ) -> Claim:
        token = secrets.token_hex(16)
        # Nothing trained the model since a worker last read its step from the backend (the
        # model row is locked with this claim): that step is where this job starts.
        start_step = row.current_step if row.step_known else None
        params = {
            "g_id": row.id,
            "v_token": token,
            "v_owner": owner,
            "v_expires": now + timedelta(seconds=lease_seconds),
            "v_now": now,
            "v_start_step": start_step,
        }
        job = (await conn.execute(statements.TAKE, params)).one()
        claimed = {"worker": owner, "attempt": job.attempts}
        await add_events(conn, row.id, job.last_event_seq, [(EventType.job_claimed, claimed)])
        return _claim(row, job, token=token, owner=owner, start_step=start_step)


def _postgres_fit(capabilities: Capabilities | None) -> dict[str, Any]:
    """A Postgres claim's parameters for the worker's pool, backends and labels (none: any
    job)."""
    if capabilities is None:
        return {}
    return {
        "w_pool": capabilities.pool,
        "w_backends": list(capabilities.backends),
        "w_labels": dict(capabilities.labels),
    }


class PostgresStore(QueueStore):
    """Many processes: a claim and a final write are one statement each, outside a
    transaction, each committed by itself in one round trip. Leases run on the database's
    clock."""

    clock = statements.LeaseClock.DATABASE
    quota_check_seconds: ClassVar[float] = 2.0
    """How long a process trusts its read of whether any project has a running quota."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
        self._quotas_read_at = -float("inf")
        self._quotas = False

    def forget_quotas(self) -> None:
        """Read whether any project has a running quota at the next claim (this process
        has just set one)."""
        self._quotas_read_at = -float("inf")

    async def _any_running_quota(self) -> bool:
        """Whether some project has a running quota (read again every few seconds). While
        a new one is not yet seen, that project's jobs wait: the claim without locks takes
        only projects that have none, read fresh by each claim."""
        now = time.monotonic()
        if now - self._quotas_read_at >= self.quota_check_seconds:
            async with self.engine.connect() as conn:
                self._quotas = bool(
                    await conn.scalar(
                        select(exists().where(statements.projects.c.max_running_jobs.is_not(None)))
                    )
                )
            self._quotas_read_at = now
        return self._quotas

    async def claim(
        self,
        *,
        owner: str,
        lease_seconds: float,
        limit: int = 1,
        capabilities: Capabilities | None = None,
    ) -> list[Claim]:
        """Each look is one statement (`statements.claim_statement`), committed by itself,
        so what one look claimed stays claimed if a later look collides. Where a project
        has a running quota, the statement also locks those projects' rows and checks that
        its count of their running jobs is current (`statements.capped_rows_as_seen`)."""
        async with self.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            statement = await self._claim_statement(capabilities)
            fit = _postgres_fit(capabilities)
            return await self._looks(conn, statement, owner, lease_seconds, limit, fit)

    async def claim_in(
        self,
        conn: AsyncConnection,
        *,
        owner: str,
        lease_seconds: float,
        limit: int = 1,
        capabilities: Capabilities | None = None,
        retry: bool = True,
    ) -> list[Claim]:
        """`claim`'s looks, each in a savepoint of the caller's transaction (a capped
        project's row stays locked until it commits); `retry` False: one look, in none."""
        statement = await self._claim_statement(capabilities)
        fit = _postgres_fit(capabilities)
        return await self._looks(
            conn, statement, owner, lease_seconds, limit, fit, savepoints=retry, once=not retry
        )

    async def _claim_statement(self, capabilities: Capabilities | None) -> Any:
        """Without a running quota anywhere, the statement that joins no project row."""
        capped = await self._any_running_quota()
        quota = statements.Quota.LOCKED if capped else statements.Quota.UNLIMITED
        return statements.claim_statement(capabilities is not None, quota)

    async def _looks(
        self,
        conn: AsyncConnection,
        statement: Any,
        owner: str,
        lease_seconds: float,
        limit: int,
        fit: dict[str, Any],
        *,
        savepoints: bool = False,
        once: bool = False,
    ) -> list[Claim]:
        """Claim statements until `limit` jobs are claimed or none is left. `savepoints`:
        `conn` is in a transaction, and each look runs in a savepoint, so a look that
        collides leaves what earlier looks claimed. `once`: one look, whose collision
        raises."""
        claims: list[Claim] = []
        collisions = 0
        while len(claims) < limit:
            wanted = limit - len(claims)
            params = {
                "now": utcnow(),
                "page": wanted * 4,
                "wanted": wanted,
                "v_secret": secrets.token_hex(16),
                "v_owner": owner,
                "v_lease_seconds": lease_seconds,
                **fit,
            }
            try:
                if savepoints:
                    async with conn.begin_nested():
                        rows = (await conn.execute(statement, params)).all()
                else:
                    rows = (await conn.execute(statement, params)).all()
            except IntegrityError:
                if once:
                    raise
                collisions += 1  # as in SqliteStore: another worker, same model
                if collisions == CLAIM_COLLISIONS:
                    break
                continue
            for row in sorted(rows, key=lambda r: r.id):
                claims.append(
                    _claim(row, row, token=row.lease_token, owner=owner, start_step=row.start_step)
                )
            if once or not rows or rows[0].candidates < wanted * 4:
                break  # every eligible job was seen (see `SqliteStore._claim_once`)
        return claims

    async def _final_once(
        self, lease: Lease, write: FinalWrite, only_if_expired: bool, joined: Joined | None
    ) -> bool:
        if write.child is not None or joined is not None:
            return await super()._final_once(lease, write, only_if_expired, joined)
        # One statement outside a transaction, so it commits by itself: one round trip
        # where BEGIN, three statements and COMMIT took five.
        async with self.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            return await self._write_final(conn, lease, write, only_if_expired)

    async def _write_final(
        self, conn: AsyncConnection, lease: Lease, write: FinalWrite, only_if_expired: bool
    ) -> bool:
        # One statement (`statements.write_in_one`) where three took a round trip each: by
        # itself, or first in a transaction that goes on (a child job, a run's move).
        keys, params = _write_params(lease, write.job, write.events)
        model_keys, model_params = _model_params(lease.model_name, write.model or ModelUpdate())
        hooks = [webhook_type(type_, lease.kind) for type_, _ in write.events]
        statement = statements.write_in_one(
            keys, only_if_expired, write.unless_cancel_requested, model_keys, any(hooks)
        )
        params |= model_params | {
            "e_types": [type_.value for type_, _ in write.events],
            "e_data": [json_dumps(data) for _, data in write.events],
            "e_hooks": hooks,
        }
        return (await conn.execute(statement, params)).scalar_one_or_none() is not None


def store_for(engine: AsyncEngine) -> QueueStore:
    """The store of the engine's dialect, chosen once where the engine is built."""
    return PostgresStore(engine) if engine.dialect.name == "postgresql" else SqliteStore(engine)
