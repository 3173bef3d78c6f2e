"""`app.db.Reader`: the reads a request makes alone (one job, a page of jobs, a run).

On SQLite a read runs on a read-only connection, a lookup of one row on the event loop
(never waiting for a lock: one meets a lock, a reading thread reads it again) and every
other read in a small pool of reading threads: it must see every commit made before it,
return rows usable after the read, and never write. On Postgres the same calls go through
a connection or a session."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import event, select, update
from sqlalchemy.exc import OperationalError

from app.db import (
    Lookup,
    Reader,
    begin_write,
    create_engine,
    create_sessionmaker,
    utcnow,
    write_connection,
)
from app.errors import NotFoundError
from app.jobs import service as jobs
from app.jobs.lifecycle import JobKind, JobStatus
from app.jobs.statements import jobs as jobs_table
from app.jobs.statements import models
from app.jobs.store import enqueue, new_job
from app.models import JobRow, ModelRow
from app.training import spec
from tests import factories as f


@pytest.fixture
async def engine_and_reader(database_url: str) -> AsyncIterator[tuple[Any, Reader]]:
    engine = create_engine(database_url)
    reader = Reader(engine)
    try:
        yield engine, reader
    finally:
        await reader.aclose()
        await engine.dispose()


def _model_columns(name: str) -> dict[str, Any]:
    now = utcnow()
    return {
        "name": name,
        "project": "p",
        "base_model": "tiny/base",
        "backend": "dry-run",
        "config": {},
        "current_step": 0,
        "step_known": True,
        "created_at": now,
        "updated_at": now,
    }


async def _job(engine: Any, model: str = "m", **metadata: str) -> str:
    async with write_connection(engine) as conn:
        if (
            await conn.execute(select(models.c.name).where(models.c.name == model))
        ).first() is None:
            await conn.execute(models.insert().values(_model_columns(model)))
        job = new_job(
            JobKind.training,
            model=model,
            payload=spec.encode(f.art_groups([[1.0, 0.0]])),
            summary={"num_groups": 1},
            request_hash="h",
            max_attempts=2,
            metadata=metadata,
        )
        await enqueue(conn, job)
    return job.id


async def test_a_read_sees_every_commit_made_before_it(engine_and_reader: Any) -> None:
    engine, reader = engine_and_reader
    job_id = await _job(engine)
    first = await jobs.read_job(reader, job_id, kind=JobKind.training)
    assert (first.status, first.progress_step) == (JobStatus.queued.value, 0)
    # Changed many times between reads: a pooled reading connection must hold no snapshot
    # from the read before.
    for step in range(1, 6):
        async with write_connection(engine) as conn:
            await conn.execute(
                update(jobs_table)
                .where(jobs_table.c.id == job_id)
                .values(status=JobStatus.running.value, progress_step=step)
            )
        job = await jobs.read_job(reader, job_id, kind=JobKind.training)
        assert (job.status, job.progress_step) == (JobStatus.running.value, step)
    # The row is detached, and whole: what a route turns into its answer.
    assert job.summary == {"num_groups": 1}
    assert job.created_at.tzinfo is not None


async def test_a_missing_job_or_one_of_another_kind_is_not_found(engine_and_reader: Any) -> None:
    engine, reader = engine_and_reader
    job_id = await _job(engine)
    with pytest.raises(NotFoundError):
        await jobs.read_job(reader, "job_missing", kind=JobKind.training)
    with pytest.raises(NotFoundError):
        await jobs.read_job(reader, job_id, kind=JobKind.rollout)


async def test_pages_are_newest_first_and_filter_as_asked(engine_and_reader: Any) -> None:
    engine, reader = engine_and_reader
    ids = [await _job(engine, "m", team="a" if i % 2 else "b") for i in range(5)]
    await _job(engine, "other")
    page, more = await jobs.list_jobs(
        reader, kind=JobKind.training, status=None, model="m", after=None, limit=2
    )
    assert [j.id for j in page] == ids[::-1][:2] and more
    rest, more = await jobs.list_jobs(
        reader, kind=JobKind.training, status=None, model="m", after=page[-1].id, limit=10
    )
    assert [j.id for j in rest] == ids[::-1][2:] and not more
    team_a, _ = await jobs.list_jobs(
        reader,
        kind=JobKind.training,
        status=JobStatus.queued,
        model=None,
        after=None,
        limit=10,
        metadata={"team": "a"},
    )
    assert [j.id for j in team_a] == [ids[3], ids[1]]


async def test_a_read_job_shows_what_its_orm_row_holds(engine_and_reader: Any) -> None:
    """`read_job` reads columns with a plain statement: the values (JSON decoded, times
    aware of their zone, the model's backend and base model its prices follow) are those
    the ORM loads."""
    engine, reader = engine_and_reader
    job_id = await _job(engine, team="a")
    async with create_sessionmaker(engine)() as session:
        row = await session.get(JobRow, job_id)
        assert row is not None
        expected = await jobs.view_of(session, row)
    view = await jobs.read_job(reader, job_id, kind=JobKind.training)
    assert view == expected
    assert view.meta == {"team": "a"} and view.summary == {"num_groups": 1}
    assert view.created_at.tzinfo is not None
    page, _ = await jobs.list_jobs(
        reader, kind=JobKind.training, status=None, model=None, after=None, limit=5
    )
    assert page == [expected]
    # Ended: every column that a queued job leaves null holds something (an error, metrics,
    # times, flags), read as the ORM reads it.
    now = utcnow()
    async with write_connection(engine) as conn:
        await conn.execute(
            update(jobs_table)
            .where(jobs_table.c.id == job_id)
            .values(
                status="failed",
                error={"type": "Boom", "message": "ü", "transient": False},
                metrics={"loss": 0.5},
                started_at=now,
                finished_at=now,
                cancel_requested=True,
                trained=True,
                prompt_tokens=7,
            )
        )
    async with create_sessionmaker(engine)() as session:
        row = await session.get(JobRow, job_id)
        assert row is not None
        ended = await jobs.view_of(session, row)
    view = await jobs.read_job(reader, job_id, kind=JobKind.training)
    assert view == ended and view.error == {"type": "Boom", "message": "ü", "transient": False}
    assert view.finished_at == now and view.cancel_requested is True and view.trained is True


def _record_statements(reader: Reader) -> list[tuple[str, str]]:
    """(thread name, first word) of every statement the reader's connections run, as the
    driver sees them (SQLite's trace hook): a `Lookup` goes past SQLAlchemy's events."""
    seen: list[tuple[str, str]] = []

    def record(statement: str) -> None:
        seen.append((threading.current_thread().name, statement.split()[0].upper()))

    def traced(dbapi_connection: Any, *_: Any) -> None:
        dbapi_connection.set_trace_callback(record)

    event.listen(reader._sync, "checkout", traced)  # type: ignore[arg-type]
    if reader._on_loop is not None:
        traced(reader._on_loop.connection.driver_connection)
    return seen


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_on_sqlite_a_lookup_is_one_statement_on_the_loop_that_never_waits(
    engine_and_reader: Any,
) -> None:
    engine, reader = engine_and_reader
    job_id = await _job(engine)
    await jobs.read_job(reader, job_id, kind=JobKind.training)  # opens the loop's connection
    seen = _record_statements(reader)
    await jobs.read_job(reader, job_id, kind=JobKind.training)
    # One statement (no BEGIN, no second query), on the loop's own thread.
    assert seen == [(threading.current_thread().name, "SELECT")]
    # A lock fails it at once (no busy timeout) instead of holding the loop.
    on_loop = reader._on_loop
    assert on_loop is not None
    assert on_loop.exec_driver_sql("PRAGMA busy_timeout").scalar() == 0


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_on_sqlite_a_page_is_one_statement_in_a_reading_thread(
    engine_and_reader: Any,
) -> None:
    engine, reader = engine_and_reader
    await _job(engine)
    seen = _record_statements(reader)
    page, _ = await jobs.list_jobs(
        reader, kind=JobKind.training, status=None, model=None, after=None, limit=5
    )
    assert len(page) == 1
    assert len(seen) == 1, seen
    thread, verb = seen[0]
    assert verb == "SELECT"
    assert thread.startswith("trainyard-read") and thread != threading.main_thread().name


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("form", ["lookup", "statement"])
async def test_on_sqlite_a_lookup_that_meets_a_lock_is_read_again_in_a_reading_thread(
    engine_and_reader: Any, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """WAL readers wait for no writer; SQLite can still answer "database is locked" (a
    recovery, an exclusive-mode writer, neither of which a test can bring about while the
    service's own connections hold the file). On the loop that fails the read at once, and
    a reading thread, which may wait, reads it again. The lock is the driver's error,
    raised where the loop's read meets the driver: a `Lookup` (a job's GET) and a plain
    statement."""
    engine, reader = engine_and_reader
    job_id = await _job(engine)
    await jobs.read_job(reader, job_id, kind=JobKind.training)  # opens the loop's connection
    loop_thread = threading.current_thread().name
    statement: Any = select(jobs_table.c.id).where(jobs_table.c.id == job_id)
    if form == "lookup":
        statement = Lookup(statement)

        def locked(*_: Any) -> None:
            assert threading.current_thread().name == loop_thread
            raise sqlite3.OperationalError("database is locked")

        monkeypatch.setattr(Lookup, "first", locked)
    else:

        def locked_on_the_loop(_conn: Any, _cursor: Any, *_: Any) -> None:
            if threading.current_thread().name == loop_thread:
                raise sqlite3.OperationalError("database is locked")

        event.listen(reader._sync, "before_cursor_execute", locked_on_the_loop)
    seen = _record_statements(reader)
    assert tuple(await reader.row(statement)) == (job_id,)
    # The loop's attempt failed before the driver ran it; the thread's ran.
    assert len(seen) == 1 and seen[0][1] == "SELECT"
    assert seen[0][0].startswith("trainyard-read")
    if form == "statement":
        event.remove(reader._sync, "before_cursor_execute", locked_on_the_loop)
    monkeypatch.undo()
    seen.clear()
    await jobs.read_job(reader, job_id, kind=JobKind.training)  # on the loop again
    assert seen == [(loop_thread, "SELECT")]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_on_sqlite_the_reading_threads_wait_for_a_lock_the_loop_does_not(
    engine_and_reader: Any,
) -> None:
    engine, reader = engine_and_reader
    await jobs.read_job(reader, await _job(engine), kind=JobKind.training)
    threads = reader._sync.connect()  # type: ignore[union-attr]
    try:  # the threads' connections keep the busy timeout
        assert threads.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
    finally:
        threads.close()
    on_loop = reader._on_loop
    assert on_loop is not None
    assert on_loop.exec_driver_sql("PRAGMA busy_timeout").scalar() == 0


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_on_sqlite_the_reading_connections_cannot_write(engine_and_reader: Any) -> None:
    engine, reader = engine_and_reader
    job_id = await _job(engine)
    with pytest.raises(OperationalError, match="readonly"):
        await reader.scalar(
            update(JobRow).where(JobRow.id == job_id).values(status="failed").returning(JobRow.id)
        )
    assert (await jobs.read_job(reader, job_id, kind=JobKind.training)).status == "queued"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_begin_write_begins_a_writer_once_whatever_came_before_in_the_session(
    database_url: str,
) -> None:
    """`begin_write` begins the session's transaction as a writer (SQLite: BEGIN IMMEDIATE)
    even after `session.add` began it without a connection; called again in that
    transaction it does nothing; the next transaction begins afresh."""
    engine = create_engine(database_url)
    begun: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.startswith("BEGIN"):
            begun.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    try:
        async with create_sessionmaker(engine)() as session:
            # The transaction begins, without a connection yet.
            session.add(ModelRow(**_model_columns("w")))
            await begin_write(session)
            await begin_write(session)  # a helper's second call
            await session.commit()
            await begin_write(session)
            await session.rollback()
            await session.get(JobRow, "none")  # a reader: BEGIN
            await session.rollback()
    finally:
        await engine.dispose()
    assert begun == ["BEGIN IMMEDIATE", "BEGIN IMMEDIATE", "BEGIN"]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_on_sqlite_a_lookup_that_meets_another_driver_error_is_read_through_sqlalchemy(
    engine_and_reader: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a lock (a disk error, a broken connection): the loop's connection is given up
    and the read goes through SQLAlchemy, whose errors the service answers (503)."""
    engine, reader = engine_and_reader
    job_id = await _job(engine)
    await jobs.read_job(reader, job_id, kind=JobKind.training)  # opens the loop's connection
    broken = reader._on_loop

    def failing(*_: Any) -> None:
        raise sqlite3.DatabaseError("disk I/O error")

    monkeypatch.setattr(Lookup, "first", failing)
    assert (await jobs.read_job(reader, job_id, kind=JobKind.training)).id == job_id
    assert reader._on_loop is None and broken is not None and broken.invalidated
    monkeypatch.undo()
    assert (await jobs.read_job(reader, job_id, kind=JobKind.training)).id == job_id
    assert reader._on_loop is not None and reader._on_loop is not broken
