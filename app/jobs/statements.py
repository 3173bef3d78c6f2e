"""The workers' hot statements, built once per shape with bound parameters: SQLAlchemy then
reuses their cache keys and compiled SQL instead of rebuilding both for every job (building
and cache-keying an UPDATE cost ~0.6 ms).

Core tables, not ORM entities: these run per job and the ORM layer costs CPU here. On
Postgres a claim and a final write are each one statement (data-modifying CTEs) that the
worker runs outside a transaction, so it commits by itself: one round trip each.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    Float,
    Integer,
    String,
    Table,
    Text,
    and_,
    any_,
    bindparam,
    case,
    column,
    exists,
    func,
    insert,
    literal,
    literal_column,
    not_,
    or_,
    select,
    true,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, distinct_on
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.dml import Insert, ReturningUpdate, Update
from sqlalchemy.sql.functions import GenericFunction, ReturnTypeFromArgs
from sqlalchemy.sql.selectable import FromClause, Select

from app.db import utcnow
from app.jobs import outbox
from app.jobs.events import database_clock
from app.jobs.lifecycle import ADDED_COLUMNS, EventType, JobKind, JobStatus
from app.models import DEFAULT_PROJECT_ID, JobEventRow, JobRow, ModelRow, ProjectRow, WorkerRow
from app.settings import DEFAULT_POOL

RUNNING = JobStatus.running.value
QUEUED = JobStatus.queued.value
UNFINISHED = (QUEUED, RUNNING)
"""A job that may still run: queued (perhaps to be retried) or running."""
jobs = cast(Table, JobRow.__table__)
models = cast(Table, ModelRow.__table__)
workers = cast(Table, WorkerRow.__table__)
projects = cast(Table, ProjectRow.__table__)
job_events = cast(Table, JobEventRow.__table__)
_running = jobs.alias("running")
RUN = JobKind.run.value
# A run's row is running while its children are: it holds no model (migration 0007).
_busy_models = select(_running.c.model_name).where(
    _running.c.status == RUNNING, _running.c.kind != RUN
)


def running_in(project: ColumnElement[Any]) -> ColumnElement[int]:
    """How many of the project's jobs hold a worker now (a run holds none)."""
    held = jobs.alias("held")
    # What `ix_jobs_project_running` holds, as SQLite's planner must see it to choose that
    # index: the values written into the statement (bound, they do not prove that the
    # partial index holds every row asked for) and a range on its second column that every
    # job meets. Without them, SQLite (which keeps no statistics here) counted through
    # `ix_jobs_project_created`, reading every job the project ever had: ~0.3 s a claim at
    # 100,000 ended jobs, against ~0.2 ms (`test_quotas.py`, "not its history").
    return (
        select(func.count())
        .select_from(held)
        .where(
            held.c.project_id == project,
            held.c.status == literal_column(f"'{RUNNING}'"),
            held.c.kind != literal_column(f"'{RUN}'"),
            held.c.fair_seq >= literal_column(str(-(2**62))),
        )
        .scalar_subquery()
    )


def fair_place(project: ColumnElement[Any]) -> ColumnElement[int]:
    """A new job's place in the claim order (`jobs.fair_seq`; claims take the lowest
    first, then the oldest): one past its project's last queued job, or the place being
    served now (the highest of the running jobs'; with none running, the lowest queued) if
    that is later. So a project that queues 100 jobs holds places v..v+99, and one that
    queues 5 after it gets v'..v'+4 from the place then served: the two take turns, and
    neither waits behind the other's whole backlog (start-time fair queueing, a job per
    turn)."""
    mine = jobs.alias("mine")
    # Each one an index's first or last entry (the min/max of a partial index's prefix):
    # no scan of a project's backlog. A queued run's row counts as any job's (harmless: it
    # holds no worker); a running one would be stale, so `served` leaves runs out.
    own = (
        select(func.max(mine.c.fair_seq) + 1)
        .where(mine.c.project_id == project, mine.c.status == QUEUED)
        .scalar_subquery()
    )
    served = (
        select(func.max(mine.c.fair_seq))
        .where(mine.c.status == RUNNING, mine.c.kind != RUN)
        .scalar_subquery()
    )
    head = select(func.min(mine.c.fair_seq)).where(mine.c.status == QUEUED).scalar_subquery()
    zero = literal(0, Integer)
    return greatest(func.coalesce(own, zero), func.coalesce(served, head, zero))


class greatest(ReturnTypeFromArgs[Any]):
    """The larger of its arguments: `greatest` on Postgres, the scalar `max` on SQLite."""

    inherit_cache = True


@compiles(greatest, "sqlite")
def _greatest_on_sqlite(element: greatest, compiler: Any, **kw: Any) -> str:
    return f"max({compiler.process(element.clauses, **kw)})"


class least(ReturnTypeFromArgs[Any]):
    """The smaller of its arguments: `least` on Postgres, the scalar `min` on SQLite."""

    inherit_cache = True


@compiles(least, "sqlite")
def _least_on_sqlite(element: least, compiler: Any, **kw: Any) -> str:
    return f"min({compiler.process(element.clauses, **kw)})"


class seconds_between(GenericFunction[float]):
    """Seconds from its first timestamp to its second (negative if before)."""

    type = Float()
    inherit_cache = True


@compiles(seconds_between, "postgresql")
def _seconds_on_postgres(element: seconds_between, compiler: Any, **kw: Any) -> str:
    start, end = (compiler.process(c, **kw) for c in element.clauses)
    return f"EXTRACT(EPOCH FROM ({end} - {start}))"


@compiles(seconds_between, "sqlite")
def _seconds_on_sqlite(element: seconds_between, compiler: Any, **kw: Any) -> str:
    start, end = (compiler.process(c, **kw) for c in element.clauses)
    return f"((julianday({end}) - julianday({start})) * 86400.0)"


def last_counts() -> ColumnElement[bool]:
    """Whether a job's last attempt is not yet among its earlier ones (`earlier_seconds`):
    never sent back, or claimed again since (`attempts` past `returned_at_attempt`)."""
    return jobs.c.returned_at_attempt.is_(None) | (jobs.c.returned_at_attempt < jobs.c.attempts)


def ran_within(
    since: ColumnElement[Any], until: ColumnElement[Any], now: ColumnElement[Any]
) -> ColumnElement[float]:
    """Seconds a job ran within [since, until): its last attempt from its claim
    (`started_at`) to its end, or to `now` while it runs, clipped to the window; and its
    earlier attempts' (`earlier_seconds`) if that claim is in the window. The last attempt
    is among the earlier ones once it was sent back (`returned_at_attempt`, until a claim
    raises `attempts` past it): a job waiting for a retry, or cancelled while it waited,
    counts each attempt once. What a project's daily trainer-seconds quota counts
    (`app.jobs.quotas`) and what `GET /v1/usage` sums."""
    start = greatest(jobs.c.started_at, since)
    end = least(func.coalesce(jobs.c.finished_at, now), until)
    last = case(
        (last_counts() & (end > start), seconds_between(start, end)),
        else_=literal(0.0, Float),
    )
    claimed_within = (jobs.c.started_at >= since) & (jobs.c.started_at < until)
    return last + case((claimed_within, jobs.c.earlier_seconds), else_=literal(0.0, Float))


@functools.cache
def enqueue_job(columns: tuple[str, ...]) -> Insert:
    """The insert of a queued job: `columns` as bound parameters of their names, and two
    the database fills in: its project (its model's: a job a job or a run makes is its
    parent's project's, as its model is; migration 0014) and its place in the fair order
    (`fair_place`). Built once: building its subqueries per job cost about a millisecond."""
    return insert(jobs).values(_enqueued(columns))


@functools.cache
def enqueue_job_once(dialect: str, columns: tuple[str, ...]) -> Insert:
    """`enqueue_job` that inserts nothing where a job of that id exists, and returns the id
    where it inserted: a run's child, which a decision taken again finds made, in the one
    statement that would make it."""
    upsert = postgresql_insert if dialect == "postgresql" else sqlite_insert
    statement = upsert(jobs).values(_enqueued(columns))
    return statement.on_conflict_do_nothing(index_elements=[jobs.c.id]).returning(jobs.c.id)


def _enqueued(columns: tuple[str, ...]) -> dict[str, Any]:
    project = func.coalesce(
        select(models.c.project_id)
        .where(models.c.name == bindparam("model_name"))
        .scalar_subquery(),
        literal(DEFAULT_PROJECT_ID, String),
    )
    values: dict[str, Any] = {name: bindparam(name) for name in columns}
    return values | {"project_id": project, "fair_seq": fair_place(project)}


class Quota(enum.Enum):
    """Which projects' jobs a claim may take, by their running quota."""

    UNLIMITED = "unlimited"
    """Only projects without a running quota (the claim locks no project)."""
    LOCKED = "locked"
    """Those, and the projects with one whose row this claim's statement locks and finds
    as its snapshot read it (`capped_rows_as_seen`), up to the room each has left."""
    ALL = "all"
    """Every project, each up to its room (SQLite: one writer, nothing to lock)."""


def guarded(*extra: Any) -> ColumnElement[bool]:
    """The lease's job, still running under the same token."""
    return and_(
        jobs.c.id == bindparam("g_id"),
        jobs.c.lease_token == bindparam("g_token"),
        jobs.c.status == RUNNING,
        *extra,
    )


class LeaseClock(enum.Enum):
    """The clock leases run on, the one thing the two dialects' statements differ in
    besides their claim: the database's on Postgres, so a worker host whose clock is
    skewed can neither take a live job for dead nor hold a lease past its time; the
    writer's on SQLite (one host), bound as `g_now` and `v_expires`."""

    WRITER = "writer"
    DATABASE = "database"

    def now(self) -> ColumnElement[Any]:
        return database_clock() if self is LeaseClock.DATABASE else bindparam("g_now")

    def until(self) -> ColumnElement[Any]:
        """When a lease taken or renewed now expires."""
        if self is LeaseClock.WRITER:
            return bindparam("v_expires")
        seconds = bindparam("v_lease_seconds", type_=Float)
        return database_clock() + literal_column("interval '1 second'") * seconds

    def lease_params(self, seconds: float) -> dict[str, Any]:
        """Parameters of a lease taken or renewed now for `seconds`."""
        if self is LeaseClock.WRITER:
            return {"v_expires": utcnow() + timedelta(seconds=seconds)}
        return {"v_lease_seconds": seconds}


@functools.cache
def job_update(
    keys: tuple[str, ...], only_if_expired: bool, unless_cancel: bool, clock: LeaseClock
) -> ReturningUpdate[Any]:
    """Set `v_<key>` on the lease's job (add it, for `ADDED_COLUMNS`) and count `g_events`
    new events, returning the new counter (and the id and project, for `write_in_one`);
    matches nothing once the lease is lost.
    `only_if_expired`: only while the lease is expired by the lease clock (recovery: its
    worker did not come back); `unless_cancel`: only if no cancel was asked."""
    extra = []
    if only_if_expired:
        extra.append(jobs.c.lease_expires_at < clock.now())
    if unless_cancel:
        extra.append(jobs.c.cancel_requested.is_(False))
    now = bindparam("g_now", type_=jobs.c.updated_at.type)
    values: dict[Any, Any] = {
        key: func.coalesce(jobs.c[key], 0) + bindparam(f"v_{key}")
        if key in ADDED_COLUMNS
        else bindparam(f"v_{key}")
        for key in keys
    }
    values |= {"last_event_seq": jobs.c.last_event_seq + bindparam("g_events"), "updated_at": now}
    if "returned_at_attempt" in keys:
        # An attempt sent back to the queue (retried, handed back, recovered) keeps its
        # seconds: from its claim to now, or to its lease's end if that came first (a
        # worker that died ran no later than that). SET reads the row's old values.
        ran = seconds_between(
            jobs.c.started_at, least(now, func.coalesce(jobs.c.lease_expires_at, now))
        )
        values["earlier_seconds"] = jobs.c.earlier_seconds + case(
            (jobs.c.started_at.is_not(None), ran), else_=literal(0.0, Float)
        )
    return (
        update(jobs)
        .where(guarded(*extra))
        .values(values)
        .returning(jobs.c.last_event_seq, jobs.c.id, jobs.c.project_id)
    )


@functools.cache
def model_update(keys: tuple[str, ...]) -> Update:
    return (
        update(models)
        .where(models.c.name == bindparam("m_name"))
        .values({key: bindparam(f"m_{key}") for key in keys})
    )


def _in_pool(table: FromClause = models) -> ColumnElement[bool]:
    return func.coalesce(table.c.pool, literal(DEFAULT_POOL, String)) == bindparam(
        "w_pool", type_=String
    )


def fits_on_postgres() -> list[ColumnElement[bool]]:
    """The job's model is one the claiming worker can run: in its pool (`w_pool`; a model
    without one is in `default`), on one of its backends (`w_backends`, an array), asking
    only for labels it has (`w_labels`: a JSON object the model's labels are contained in).

    The fitting models are read once per statement, as an array the job's model must be
    in. Given as a filter on the joined model row instead, the planner guesses that few
    models fit (a JSON containment is opaque to it), starts from them, and reads and sorts
    every queued job of theirs: a claim then cost 5-25 ms with 3,000 jobs queued, growing
    with the queue, where the walk of the fair-order index costs under 1 ms."""
    fitting = models.alias("fitting")
    backend = fitting.c.backend == any_(bindparam("w_backends", type_=ARRAY(String)))
    labels = fitting.c.labels.op("<@")(bindparam("w_labels", type_=JSONB))
    names = select(func.array_agg(fitting.c.name)).where(
        _in_pool(fitting), backend, or_(fitting.c.labels.is_(None), labels)
    )
    # The cast makes it an array expression: `ANY (SELECT ...)` would compare each row.
    return [jobs.c.model_name == any_(sql_cast(names.scalar_subquery(), ARRAY(String)))]


def fits_on_sqlite() -> list[ColumnElement[bool]]:
    """`fits_on_postgres` in SQLite's terms: `w_backends` and `w_labels` (the worker's
    `key=value` texts; each of the model's labels must be one of them) are expanded lists."""
    backend = models.c.backend.in_(bindparam("w_backends", expanding=True))
    label = func.json_each(models.c.labels).table_valued(
        column("key", String), column("value", String)
    )
    unmet = select(literal(1)).select_from(label)
    unmet = unmet.where(
        (label.c.key + literal("=", String) + label.c.value).not_in(
            bindparam("w_labels", expanding=True)
        )
    )
    return [_in_pool(), backend, or_(models.c.labels.is_(None), ~exists(unmet))]


Fits = Callable[[], list[ColumnElement[bool]]]


@functools.cache
def claim_query(
    lock_models: bool = False, fits: Fits | None = None, quota: Quota = Quota.ALL
) -> Select[Any]:
    """A page of the first eligible queued jobs in fair order (due, their model not busy,
    their project under its running quota) with their models, and `room`: how many more
    of its project's jobs may start (NULL: no quota). `fits`: the dialect's filter to jobs
    the claiming worker can run (`fits_on_sqlite`, `fits_on_postgres`); `lock_models`: lock
    their models' rows too; `quota`: which projects (`Quota`)."""
    limit = projects.c.max_running_jobs
    running = running_in(jobs.c.project_id)  # read only for a project with a quota
    room: ColumnElement[Any]
    if quota is Quota.UNLIMITED:
        room = literal(None, Integer)
    elif quota is Quota.LOCKED:
        # Read for the page's rows only (NULL: no quota); no project row is joined, so
        # the page is the same index walk in fair order as without quotas.
        room = (
            select(limit - running_in(projects.c.id))
            .where(projects.c.id == jobs.c.project_id)
            .scalar_subquery()
        )
    else:
        room = case((limit.is_(None), None), else_=limit - running)
    query = (
        select(
            jobs.c.id,
            jobs.c.model_name,
            jobs.c.kind,
            jobs.c.project_id,
            jobs.c.fair_seq,
            room.label("room"),
            models.c.project,
            models.c.base_model,
            models.c.backend,
            models.c.config,
            models.c.current_step,
            models.c.step_known,
        )
        .join(models, models.c.name == jobs.c.model_name)
        .where(
            jobs.c.status == QUEUED,
            jobs.c.kind != RUN,  # runs are advanced by their driver, never claimed
            jobs.c.not_before <= bindparam("now"),
            jobs.c.model_name.not_in(_busy_models),
        )
        # Projects take turns (`fair_place`); within one, submission order, also for a
        # retried job (its not_before only gates it).
        .order_by(jobs.c.fair_seq, jobs.c.id)
        .limit(bindparam("page"))
    )
    if quota is Quota.UNLIMITED:
        # No project row joined or locked: the projects with a running quota, left out.
        capped = select(projects.c.id).where(limit.is_not(None))
        query = query.where(jobs.c.project_id.not_in(capped))
    elif quota is Quota.LOCKED:
        # The capped projects this claim may not take from, read once per statement.
        held_back = select(projects.c.id).where(
            limit.is_not(None),
            not_(and_(capped_rows_as_seen(), limit > running_in(projects.c.id))),
        )
        query = query.where(jobs.c.project_id.not_in(held_back))
    else:
        # An outer join: a job whose project has no row (none is deleted) has no quota.
        query = query.outerjoin(projects, projects.c.id == jobs.c.project_id)
        query = query.where(or_(limit.is_(None), limit > running))
    if fits is not None:
        query = query.where(*fits())
    if lock_models:
        # Postgres: locking the model row too makes a concurrent claimer skip every job of a model
        # that is being claimed right now, instead of colliding on the unique index.
        query = query.with_for_update(skip_locked=True, of=(jobs, models))
    return query


def capped_rows_as_seen() -> ColumnElement[bool]:
    """Postgres: the selected project's row, locked by this statement (SKIP LOCKED: a claim
    in flight holds it, and this one takes that project's jobs next time) and unchanged
    since the statement's snapshot.

    A claim counts a capped project's running jobs in its snapshot, taken when the statement
    starts. Another claim may commit jobs of that project after the snapshot and before
    this statement reaches the row; the lock then finds the row's newest version (READ
    COMMITTED follows the update), whose `claim_seq` that claim raised
    (`claim_statement`): the count is stale, and the project is passed over. So two claims
    never both take the last free slot, in one statement each and no transaction."""
    capped = projects.alias("capped")
    locked = (
        select(capped.c.id, capped.c.claim_seq)
        .where(capped.c.max_running_jobs.is_not(None))
        .with_for_update(skip_locked=True)
        .cte("locked")
    )
    return exists().where(locked.c.id == projects.c.id, locked.c.claim_seq == projects.c.claim_seq)


@functools.cache
def lease_state() -> Select[Any]:
    """What settling a job whose worker is gone reads of it."""
    return select(
        jobs.c.id,
        jobs.c.lease_token,
        jobs.c.lease_owner,
        jobs.c.model_name,
        jobs.c.kind,
        jobs.c.attempts,
        jobs.c.start_step,
        jobs.c.cancel_requested,
        jobs.c.max_attempts,
    )


TAKE = (
    update(jobs)
    .where(jobs.c.id == bindparam("g_id"), jobs.c.status == QUEUED)
    .values(
        status=RUNNING,
        lease_token=bindparam("v_token"),
        lease_owner=bindparam("v_owner"),
        lease_expires_at=bindparam("v_expires"),
        attempts=jobs.c.attempts + 1,
        started_at=bindparam("v_now"),
        progress_step=0,
        progress_total=None,
        start_step=bindparam("v_start_step"),
        last_event_seq=jobs.c.last_event_seq + 1,
    )
    .returning(
        jobs.c.attempts,
        jobs.c.last_event_seq,
        jobs.c.payload,
        jobs.c.payload_format,
        jobs.c.payload_bytes,
        jobs.c.hyperparameters,
        jobs.c.max_attempts,
        jobs.c.policy_step,
        jobs.c.max_steps_off_policy,
    )
)


@functools.cache
def heartbeat(*, with_progress: bool, clock: LeaseClock) -> ReturningUpdate[Any]:
    values: dict[str, Any] = {
        "lease_expires_at": clock.until(),
        "last_event_seq": jobs.c.last_event_seq + bindparam("g_events"),
    }
    if with_progress:
        values |= {"progress_step": bindparam("v_step"), "progress_total": bindparam("v_total")}
    return (
        update(jobs)
        .where(guarded())
        .values(values)
        .returning(jobs.c.cancel_requested, jobs.c.last_event_seq)
    )


@functools.cache
def write_in_one(
    keys: tuple[str, ...],
    only_if_expired: bool,
    unless_cancel: bool,
    model_keys: tuple[str, ...],
    hooks: bool = False,
) -> Select[Any]:
    """Postgres: `job_update`, its events and `model_update` as one statement
    (data-modifying CTEs). The events come as arrays and are numbered from the counter
    the job update returned; the model is updated only if the job update matched.
    `hooks`: some events are webhook events (`e_hooks`: each one's webhook type, or NULL):
    their deliveries are inserted too, as `app.jobs.outbox.fan_out` does."""
    job = job_update(keys, only_if_expired, unless_cancel, LeaseClock.DATABASE).cte("job")
    event = (
        func.unnest(
            bindparam("e_types", type_=ARRAY(Text)),
            bindparam("e_data", type_=ARRAY(Text)),
            bindparam("e_hooks", type_=ARRAY(Text)),
        )
        .table_valued("type", "data", "hook", with_ordinality="ord")
        .render_derived()
        .alias("event")
    )
    seq = job.c.last_event_seq - bindparam("g_events", type_=Integer) + event.c.ord
    numbered = select(
        job.c.id,
        seq,
        event.c.type,
        event.c.data.cast(JSONB),
        database_clock(),  # see `claim_statement`
    ).select_from(job.join(event, true()))
    statement = select(job.c.last_event_seq).add_cte(
        insert(job_events)
        .from_select(["job_id", "seq", "type", "data", "created_at"], numbered)
        .cte("events")
    )
    if hooks:
        statement = statement.add_cte(_deliveries(job, event, seq).cte("deliveries"))
    if model_keys:
        matched = exists(select(job.c.id))
        statement = statement.add_cte(model_update(model_keys).where(matched).cte("model"))
    return statement


def _deliveries(job: Any, event: Any, seq: ColumnElement[Any]) -> Any:
    """The outbox rows of a one-statement final write: per webhook event, one per enabled
    endpoint of the job's project subscribed to it."""
    subs, endpoints = outbox.subscriptions, outbox.endpoints
    now = database_clock()
    rows = select(
        subs.c.endpoint_id,
        literal("msg_", String) + job.c.id + literal("_", String) + seq.cast(Text),
        subs.c.event_type,
        job.c.id,
        seq,
        literal(outbox.PENDING, String),
        literal(0, Integer),
        now,
        now,
    ).select_from(
        job.join(event, true())
        .join(subs, subs.c.event_type == event.c.hook)
        .join(
            endpoints,
            and_(
                endpoints.c.id == subs.c.endpoint_id,
                endpoints.c.enabled,
                endpoints.c.project_id == job.c.project_id,
            ),
        )
    )
    return insert(outbox.deliveries).from_select(outbox.COLUMNS, rows)


@functools.cache
def claim_statement(fitted: bool = False, quota: Quota = Quota.UNLIMITED) -> Select[Any]:
    """Postgres: `SqliteStore._claim_once`'s look, `TAKE` and the claim events as one
    statement.

    The oldest eligible jobs are locked with their models (SKIP LOCKED: rows another
    claimer holds are passed over), the oldest job of each model is taken, up to
    `wanted`, each with its own lease token (md5 of a per-statement secret and the id),
    and each gets its `job_claimed` event. `candidates` tells whether the page was full.
    A project with a running quota gives at most its `room` (`quota`: see `Quota`); a
    claim that takes its jobs raises its `claim_seq` (see `capped_rows_as_seen`).
    """
    fits = fits_on_postgres if fitted else None
    candidate = claim_query(lock_models=True, fits=fits, quota=quota).cte("candidate")
    first = (
        select(candidate)
        .ext(distinct_on(candidate.c.model_name))
        .order_by(candidate.c.model_name, candidate.c.fair_seq, candidate.c.id)
        .cte("first")
    )
    if quota is Quota.UNLIMITED:
        picked = (
            select(first).order_by(first.c.fair_seq, first.c.id).limit(bindparam("wanted"))
        ).cte("picked")
    else:  # each capped project's jobs up to its room
        nth = (
            func.row_number()
            .over(partition_by=first.c.project_id, order_by=(first.c.fair_seq, first.c.id))
            .label("nth")
        )
        ranked = select(first, nth).cte("ranked")
        picked = (
            select(ranked)
            .where(or_(ranked.c.room.is_(None), ranked.c.nth <= ranked.c.room))
            .order_by(ranked.c.fair_seq, ranked.c.id)
            .limit(bindparam("wanted"))
        ).cte("picked")
    owner = bindparam("v_owner", type_=String)
    # The database's clock, read while the statement runs (not the worker's, read before
    # sending it): a claim that saw the model's previous job end is stamped after that
    # job's last event, so the event log orders them as the database did.
    now = database_clock()
    taken = (
        update(jobs)
        .where(jobs.c.id == picked.c.id, jobs.c.status == QUEUED)
        .values(
            status=RUNNING,
            lease_token=func.md5(bindparam("v_secret", type_=String) + jobs.c.id),
            lease_owner=owner,
            lease_expires_at=LeaseClock.DATABASE.until(),
            attempts=jobs.c.attempts + 1,
            started_at=now,
            # Set here: SQLAlchemy leaves this UPDATE's `onupdate` default out once the
            # statement has a second one (`seen`, with a running quota).
            updated_at=now,
            progress_step=0,
            progress_total=None,
            start_step=case((picked.c.step_known, picked.c.current_step)),
            last_event_seq=jobs.c.last_event_seq + 1,
        )
        .returning(
            jobs.c.id,
            jobs.c.model_name,
            jobs.c.kind,
            jobs.c.lease_token,
            jobs.c.attempts,
            jobs.c.last_event_seq,
            jobs.c.start_step,
            jobs.c.payload,
            jobs.c.payload_format,
            jobs.c.payload_bytes,
            jobs.c.hyperparameters,
            jobs.c.max_attempts,
            jobs.c.policy_step,
            jobs.c.max_steps_off_policy,
            jobs.c.project_id,
            picked.c.project,
            picked.c.base_model,
            picked.c.backend,
            picked.c.config,
        )
        .cte("taken")
    )
    claimed_event = func.jsonb_build_object("worker", owner, "attempt", taken.c.attempts)
    events = insert(job_events).from_select(
        ["job_id", "seq", "type", "data", "created_at"],
        select(
            taken.c.id,
            taken.c.last_event_seq,
            literal(EventType.job_claimed.value, String),
            claimed_event,
            now,
        ),
    )
    candidates = select(func.count()).select_from(candidate).scalar_subquery()
    statement = select(taken, candidates.label("candidates")).add_cte(events.cte("claimed"))
    if quota is Quota.UNLIMITED:
        return statement
    seen = (
        update(projects)
        .where(
            projects.c.id.in_(select(taken.c.project_id)),
            projects.c.max_running_jobs.is_not(None),
        )
        .values(claim_seq=projects.c.claim_seq + 1)
    )
    return statement.add_cte(seen.cte("seen"))
