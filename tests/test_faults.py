"""Faults under load: the trainer goes away for a while, Postgres restarts, two API and two
worker processes share one Postgres, another connection holds SQLite's write lock.

Real parts throughout: the app over loopback HTTP, `trainyard serve` and `trainyard worker`
processes, SQLite files and the Postgres server. The only double is the trainer, a dry-run
backend (the same `art.Backend` Protocol and data as the real ones) behind a connection
that can be refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import art
import httpx
import pytest
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from app.backends.dry_run import DryRunBackend
from app.db import create_engine, create_sessionmaker
from app.main import create_app
from app.models import JobRow, ModelRow
from app.settings import Settings
from tests import factories as f
from tests.backends import FINAL, wait_final
from tests.conftest import POSTGRES_URL, LiveServer, reset_postgres
from tests.processes import (
    check_one_claim_and_no_overlap,
    checkpoints,
    claim_owners,
    event_rows,
    free_port,
    start_api,
    start_worker,
    stop,
    until,
    wait_ready,
)
from tests.test_notify import listen_pids

PROBLEM_JSON = "application/problem+json"
needs_postgres = pytest.mark.skipif(
    not POSTGRES_URL, reason="needs TRAINYARD_TEST_DATABASE_URL (a Postgres server)"
)
restarts_the_server = pytest.mark.skipif(
    bool(os.environ.get("TRAINYARD_TEST_SHARED_POSTGRES")),
    reason="TRAINYARD_TEST_SHARED_POSTGRES: another copy of the suite uses this Postgres server "
    "now (scripts/stress_suite.sh); restarting it would fail that copy's tests",
)


# -- shared checks ---------------------------------------------------------------------------


def assert_unavailable(response: httpx.Response) -> dict[str, Any]:
    """503 problem+json with a Retry-After header: a client knows to come back later."""
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    assert int(response.headers["retry-after"]) >= 1
    body: dict[str, Any] = response.json()
    assert body["status"] == 503
    return body


async def job_rows(sessions: async_sessionmaker[AsyncSession]) -> list[JobRow]:
    async with sessions() as session:
        return list(await session.scalars(select(JobRow).order_by(JobRow.id)))


async def count_unfinished(sessions: async_sessionmaker[AsyncSession]) -> int:
    async with sessions() as session:
        count = await session.scalar(
            select(func.count()).select_from(JobRow).where(JobRow.status.not_in(FINAL))
        )
    return int(count or 0)


def check_one_step_per_job(rows: Iterable[JobRow], model_steps: dict[str, int]) -> None:
    """Every job succeeded with a step of its own: per model, the jobs' final steps are
    exactly 1..n and the model stands at n."""
    by_model: defaultdict[str, list[int]] = defaultdict(list)
    for row in rows:
        assert row.status == "succeeded", (row.id, row.status, row.error)
        assert row.final_step is not None
        by_model[row.model_name].append(row.final_step)
    assert set(by_model) == set(model_steps)
    for model, steps in by_model.items():
        assert sorted(steps) == list(range(1, len(steps) + 1)), f"{model}: steps {steps}"
        assert model_steps[model] == len(steps), f"{model} is at {model_steps[model]}"


# -- 1. the trainer goes away for a while, under load ----------------------------------------


class OutageBackend(DryRunBackend):
    """The dry-run trainer behind a connection that can go away, as when a trainer server
    restarts: while `down`, every call is refused, and a call in flight when it goes down
    fails before its step lands. Records every step it applies with the rewards it trained
    on, so a test can tell which job each step came from."""

    def __init__(self, path: Path, latency: float = 0.01) -> None:
        super().__init__(path)
        self.latency = latency
        self.down = False
        self.refused = 0
        self.applied: list[tuple[str, int, tuple[float, ...]]] = []

    def _connect(self) -> None:
        if self.down:
            self.refused += 1
            raise ConnectionRefusedError(111, "Connection refused")

    async def healthcheck(self) -> None:
        self._connect()

    async def register(self, model: art.Model) -> None:
        self._connect()
        await super().register(model)

    async def _get_step(self, model: art.TrainableModel) -> int:
        self._connect()
        return await super()._get_step(model)

    async def train(
        self,
        model: art.TrainableModel,
        trajectory_groups: Iterable[art.TrajectoryGroup],
        **kwargs: Any,
    ) -> art.TrainResult:
        self._connect()
        groups = list(trajectory_groups)
        await asyncio.sleep(self.latency)  # the request on its way to the trainer
        self._connect()  # the connection dropped meanwhile: nothing was trained
        result = await super().train(model, groups, **kwargs)
        rewards = tuple(t.reward for group in groups for t in group.trajectories)
        self.applied.append((model.name, result.step, rewards))
        return result


def check_backoff(rows: Iterable[Any], base: float) -> int:
    """Each retry waited the project's backoff: `delay_s` within [c/2, c] for
    c = base * 2^(attempt-1), and the job was not claimed again before the delay passed
    (counted from the event before the retry: the delay starts after it). Returns the
    number of retries."""
    retries = 0
    last_at: dict[str, datetime] = {}
    due: dict[str, datetime] = {}
    for job_id, type_, at, data, _ in rows:
        if type_ == "job_retrying":
            retries += 1
            ceiling = base * 2 ** (data["attempt"] - 1)
            assert ceiling / 2 - 0.001 <= data["delay_s"] <= ceiling + 0.001, data
            assert data["error"]["transient"] is True, data
            due[job_id] = last_at[job_id] + timedelta(seconds=data["delay_s"] - 0.001)
        elif type_ == "job_claimed" and job_id in due:
            assert at >= due.pop(job_id), f"{job_id} was claimed before its backoff passed"
        last_at[job_id] = at
    return retries


@pytest.mark.slow
async def test_trainer_outage_under_load_retries_every_job_and_trains_each_once(
    make_settings: Any, tmp_path: Path
) -> None:
    backend = OutageBackend(tmp_path / "trainer")
    settings = make_settings(
        worker_enabled=True, worker_concurrency=4, max_attempts=8, retry_base_seconds=0.1
    )
    # More models than worker slots: a job whose call was in flight when the trainer went
    # away holds its model until the trainer can say whether its step landed, so at most
    # four models wait on that; the others' jobs are retried meanwhile.
    models = [f"outage{i}" for i in range(8)]
    submitted: dict[str, tuple[str, tuple[float, ...]]] = {}  # job id -> (model, rewards)

    async def submit(client: httpx.AsyncClient, numbers: range) -> None:
        for n in numbers:
            model, rewards = models[n % len(models)], (1.0, -(n + 1) / 1000)
            response = await f.submit(client, model, collection=f.nat_collection([list(rewards)]))
            assert response.status_code == 202, response.text
            submitted[response.json()["id"]] = (model, rewards)

    async def load(client: httpx.AsyncClient, start: int, count: int) -> None:
        """Four clients submitting at once."""
        numbers = range(start, start + count)
        await asyncio.gather(*(submit(client, numbers[i::4]) for i in range(4)))

    app = create_app(settings, backend_overrides={"dry-run": backend})
    async with LiveServer(app) as live:
        client, sessions = live.client, app.state.sessions

        async def succeeded() -> int:
            async with sessions() as session:
                count = await session.scalar(
                    select(func.count()).select_from(JobRow).where(JobRow.status == "succeeded")
                )
            return int(count or 0)

        async def retried_while_down() -> bool:
            """Several jobs were refused, and some more than once (the backoff doubles)."""
            attempts = [
                data["attempt"]
                for _, type_, _, data, _ in await event_rows(sessions)
                if type_ == "job_retrying" and data["error"]["type"] == "ConnectionRefusedError"
            ]
            return len(attempts) >= 8 and max(attempts) >= 2

        assert (await client.get("/readyz")).status_code == 200
        for name in models:
            await f.create_model(client, name, seconds_per_step=0.005)
        await load(client, 0, 24)
        await until(lambda: _at_least(succeeded(), 6), what="jobs to be flowing")

        backend.down = True
        outage = asyncio.create_task(load(client, 24, 24))  # jobs keep arriving meanwhile
        body = assert_unavailable(await client.get("/readyz"))
        assert body["checks"]["backends"]["ok"] is False
        assert "Connection refused" in body["checks"]["backends"]["detail"]
        assert body["checks"]["database"]["ok"] is True
        await outage
        await until(retried_while_down, what="retries while it is down")
        assert_unavailable(await client.get("/readyz"))
        backend.down = False

        async def ready() -> bool:
            return (await client.get("/readyz")).status_code == 200

        await until(ready, timeout=10, what="/readyz to answer 200 again")
        await load(client, 48, 12)
        await until(
            lambda: _is_zero(count_unfinished(sessions)), timeout=60, what="every job to finish"
        )
        steps = {
            name: (await client.get(f"/v1/models/{name}")).json()["current_step"] for name in models
        }
        rows, jobs = await event_rows(sessions), await job_rows(sessions)

    assert len(jobs) == len(submitted) == 60
    assert Counter(model for model, _ in submitted.values()) == steps
    check_one_step_per_job(jobs, steps)
    # The trainer's own count: one step per job, each job's data trained exactly once.
    for name in models:
        applied = [step for model, step, _ in backend.applied if model == name]
        assert applied == list(range(1, steps[name] + 1))
        on_disk = tmp_path / "trainer" / "tests" / "models" / name / "checkpoints"
        assert len(list(on_disk.iterdir())) == steps[name] + 1  # 0000..n
    assert Counter(r for _, _, r in backend.applied) == Counter(r for _, r in submitted.values())
    # The event log: one end per job, a claim per attempt, every retry with backoff.
    ends = Counter(job_id for job_id, type_, *_ in rows if type_ == "training_ended")
    assert set(ends) == set(submitted) and set(ends.values()) == {1}
    assert not [r for r in rows if r.type == "training_failed"]
    claims = Counter(job_id for job_id, type_, *_ in rows if type_ == "job_claimed")
    assert all(claims[row.id] == row.attempts for row in jobs)
    assert check_backoff(rows, settings.retry_base_seconds) >= 8
    assert backend.refused > 0


async def _at_least(value: Any, minimum: int) -> bool:
    return int(await value) >= minimum


async def _is_zero(value: Any) -> bool:
    return int(await value) == 0


# -- 4. SQLite: another connection holds the write lock --------------------------------------


async def test_a_locked_sqlite_database_answers_503_stores_nothing_then_recovers(
    tmp_path: Path,
) -> None:
    path = tmp_path / "trainyard.db"
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{path}",
        data_dir=tmp_path / "data",
        worker_enabled=True,
        heartbeat_seconds=0.2,
        lease_seconds=2.0,
        poll_seconds=0.2,
        retry_base_seconds=0.05,
        sqlite_busy_timeout_seconds=0.25,  # the default (5 s) is what a service wants
    )
    app = create_app(settings)
    async with LiveServer(app) as live:
        client = live.client
        await f.create_model(client, "agent")
        done = (await f.submit(client)).json()["id"]
        assert (await wait_final(client, done))["status"] == "succeeded"
        body = {"model": "agent", "collection": f.nat_collection()}
        key = {"Idempotency-Key": "locked-1"}

        # It waits its turn for the write lock (the worker's heartbeat writes every 0.2 s),
        # in a thread: the writer it waits for may need this event loop to finish.
        holder = sqlite3.connect(path, isolation_level=None, timeout=10, check_same_thread=False)
        try:
            before = _row_counts(holder)
            # The write lock, held until rollback.
            await asyncio.to_thread(holder.execute, "BEGIN EXCLUSIVE")
            loop = asyncio.get_running_loop()
            writes: list[tuple[str, dict[str, Any]]] = [
                ("/v1/training-jobs", {"json": body, "headers": key}),
                ("/v1/models", {"json": f.model_body("second")}),
                (f"/v1/training-jobs/{done}/cancel", {}),
            ]
            for url, kwargs in writes:
                started = loop.time()
                problem = assert_unavailable(await client.post(url, **kwargs))
                assert problem["detail"] == "The database is busy", problem
                # It waited the configured busy timeout (0.25 s; 10x: 2.5 s), not the
                # default 5 s.
                assert loop.time() - started < 2.5, "the request hung on the lock"
            # WAL: readers never wait for the writer.
            read = await client.get(f"/v1/training-jobs/{done}")
            assert read.status_code == 200 and read.json()["status"] == "succeeded"
            assert _row_counts(holder) == before  # nothing half-written
        finally:
            holder.close()  # releases the lock

        again = await client.post("/v1/training-jobs", json=body, headers=key)
        assert again.status_code == 202, again.text
        assert "idempotent-replayed" not in again.headers  # the 503 stored nothing
        replay = await client.post("/v1/training-jobs", json=body, headers=key)
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.json()["id"] == again.json()["id"]
        assert (await client.post("/v1/models", json=f.model_body("second"))).status_code == 201
        assert (await client.post(f"/v1/training-jobs/{done}/cancel")).status_code == 409
        # The worker loop lived through the lock and runs the job accepted after it.
        assert (await wait_final(client, again.json()["id"]))["status"] == "succeeded"
        metrics = (await client.get("/metrics")).text
        assert 'status="500"' not in metrics
        assert 'status="503"' in metrics


def _row_counts(conn: sqlite3.Connection) -> tuple[int, ...]:
    return tuple(
        conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        for table in ("models", "jobs", "job_events")
    )


# -- Postgres processes ----------------------------------------------------------------------


async def sibling_database(url: str, suffix: str) -> str:
    """The URL of a database next to `url`'s, created if missing: minute-long process tests
    on it neither see nor disturb other users of the test database (their LISTENs, their
    schema resets)."""
    base = make_url(url)
    name = f"{base.database}_{suffix}"
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            query = text("SELECT 1 FROM pg_database WHERE datname = :name")
            if not await conn.scalar(query, {"name": name}):
                with contextlib.suppress(DBAPIError):  # created meanwhile by another run
                    await conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        await engine.dispose()
    return base.set(database=name).render_as_string(hide_password=False)


@pytest.fixture
async def pg(tmp_path: Path) -> AsyncIterator[tuple[Settings, AsyncEngine]]:
    """An empty database of these tests' own, settings for processes on it, and an engine
    to check it."""
    assert POSTGRES_URL
    url = await sibling_database(POSTGRES_URL, "faults")
    await reset_postgres(url)
    settings = Settings(database_url=url, data_dir=tmp_path / "data")
    engine = create_engine(url)
    try:
        yield settings, engine
    finally:
        await engine.dispose()


async def model_steps(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        rows = (await conn.execute(select(ModelRow.name, ModelRow.current_step))).all()
    return {name: step for name, step in rows}


# -- 2. Postgres restarted mid-load ----------------------------------------------------------


def pg_ctl(action: str) -> None:
    version = sorted(os.listdir("/etc/postgresql"))[0]
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", action],
        check=True,
        timeout=120,
    )


def pg_isready() -> bool:
    command = ["pg_isready", "-q", "-h", "127.0.0.1", "-p", "5432"]
    return subprocess.run(command, check=False).returncode == 0


async def ensure_postgres_up() -> None:
    """Whatever happened, leave the server running for everyone else."""
    for _ in range(50):  # a restart under way gets 5 s to finish
        if await asyncio.to_thread(pg_isready):
            return
        await asyncio.sleep(0.1)
    with contextlib.suppress(subprocess.SubprocessError):
        await asyncio.to_thread(pg_ctl, "start")
    await until(lambda: asyncio.to_thread(pg_isready), timeout=60, what="Postgres to be up")


async def listening_sessions(engine: AsyncEngine) -> int:
    """Each process's notifier connection; -1 while the server cannot say."""
    try:
        return len(await listen_pids(engine))
    except Exception:
        return -1


async def postmaster_start_time(engine: AsyncEngine) -> datetime:
    async with engine.connect() as conn:
        started = await conn.scalar(text("SELECT pg_postmaster_start_time()"))
    assert isinstance(started, datetime)
    return started


class Submitter:
    """Clients that keep submitting jobs over HTTP, read back the newest one and ask
    /readyz, and sort what comes back: accepted (2xx), refused for now (503 + Retry-After,
    problem+json), or anything else (a failure: a 500, a hung or dropped connection)."""

    def __init__(self, urls: list[str], models: list[str]) -> None:
        self.urls, self.models = urls, models
        self.accepted: dict[str, str] = {}  # job id -> model
        self.unavailable = 0
        self.wrong: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, clients: int) -> None:
        for i in range(clients):
            self._tasks.append(asyncio.create_task(self._run(self.urls[i % len(self.urls)], i)))

    def _sort(self, response: httpx.Response, ok: int) -> bool:
        """True when the request was served; False when it must be tried again later."""
        if response.status_code == ok:
            return True
        if response.status_code == 503:
            self.unavailable += 1
            try:
                assert_unavailable(response)
            except (AssertionError, KeyError, ValueError):
                self.wrong.append(f"bad 503: {response.headers} {response.text}")
        else:
            self.wrong.append(
                f"{response.request.url.path}: {response.status_code} {response.text}"
            )
        return False

    async def _run(self, url: str, index: int) -> None:
        # A short timeout: a request that hangs on a dead database is a failure.
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            n = index
            while not self._stop.is_set():
                model = self.models[n % len(self.models)]
                n += len(self._tasks)
                try:
                    served = self._sort(posted := await f.submit(client, model), 202)
                    if served:
                        job_id = posted.json()["id"]
                        self.accepted[job_id] = model
                        served = self._sort(await client.get(f"/v1/training-jobs/{job_id}"), 200)
                    if served and n % 5 == 0:
                        served = self._sort(await client.get("/readyz"), 200)
                except httpx.HTTPError as exc:
                    self.wrong.append(f"{type(exc).__name__}: {exc}")
                    served = False
                if not served:
                    await asyncio.sleep(0.1)

    async def count(self, n: int) -> bool:
        return len(self.accepted) >= n

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


@pytest.mark.slow
@needs_postgres
@restarts_the_server
async def test_postgres_restart_mid_load_loses_no_accepted_job(
    pg: tuple[Settings, AsyncEngine],
) -> None:
    settings, engine = pg
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The API with its in-process worker, and a worker of its own; leases outlive the
    # restart only sometimes, so both recovery paths are exercised.
    api = start_api(settings, port, TRAINYARD_WORKER_CONCURRENCY="2")
    worker = start_worker(settings, TRAINYARD_WORKER_CONCURRENCY="2")
    processes = [api, worker]
    models = [f"restart{i}" for i in range(3)]
    try:
        await wait_ready(url, processes)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            for name in models:
                await f.create_model(client, name, seconds_per_step=0.05)
            load = Submitter([url], models)
            load.start(clients=2)
            try:
                await until(lambda: load.count(10), what="jobs to be accepted")
                # One per process; the worker process may still be importing.
                await until(
                    lambda: _equals(listening_sessions(engine), 2),
                    what="a LISTEN session per process",
                )
                started = await postmaster_start_time(engine)
                await asyncio.to_thread(pg_ctl, "restart")
                before = len(load.accepted)
                await until(
                    lambda: load.count(before + 10),
                    timeout=60,
                    what="jobs to be accepted after the restart",
                )
            finally:
                await load.stop()
            assert load.wrong == [], load.wrong[:5]

            async def unfinished() -> bool:
                try:
                    return await count_unfinished(create_sessionmaker(engine)) == 0
                except Exception:  # the test's own pooled connections died in the restart
                    return False

            await until(unfinished, timeout=60, what="every accepted job to finish")

            async def ready() -> bool:
                return (await client.get("/readyz")).status_code == 200

            await until(ready, timeout=30, what="/readyz to answer 200 again")
            # Both notifiers listen again: wake-ups cross processes after the restart.
            await until(
                lambda: _equals(listening_sessions(engine), 2), what="LISTEN to be re-opened"
            )
            for process in processes:
                assert process.poll() is None, "a process died; nothing may need a restart"
            assert await postmaster_start_time(engine) > started  # it did restart, mid-load
    finally:
        for process in processes:
            stop(process)
        await ensure_postgres_up()
    sessions = create_sessionmaker(engine)
    jobs = await job_rows(sessions)
    assert set(load.accepted) <= {row.id for row in jobs}
    steps = await model_steps(engine)
    check_one_step_per_job(jobs, steps)
    for name in models:
        assert len(checkpoints(settings.data_dir, name)) == steps[name] + 1  # 0000..n
    ends = Counter(r.job_id for r in await event_rows(sessions) if r.type == "training_ended")
    assert set(ends.values()) == {1} and len(ends) == len(jobs)


async def _equals(value: Any, expected: int) -> bool:
    return int(await value) == expected


# -- 3. two API processes and two worker processes on one Postgres ---------------------------


@pytest.mark.slow
@needs_postgres
async def test_two_apis_and_two_workers_on_postgres_train_each_job_once(
    pg: tuple[Settings, AsyncEngine],
) -> None:
    settings, engine = pg
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    apis = [start_api(settings, port, TRAINYARD_WORKER_ENABLED="false") for port in ports]
    workers = [start_worker(settings, TRAINYARD_WORKER_CONCURRENCY="2") for _ in range(2)]
    processes = [*apis, *workers]
    models = [f"pair{i}" for i in range(6)]
    jobs_per_model = 50
    try:
        await asyncio.gather(*(wait_ready(url, processes) for url in urls))
        clients = [httpx.AsyncClient(base_url=url, timeout=30) for url in urls]
        try:
            for name in models:
                await f.create_model(clients[0], name)

            async def submit(index: int) -> None:
                client = clients[index % 2]
                for n in range(index, len(models) * jobs_per_model, 8):
                    response = await f.submit(client, models[n % len(models)])
                    assert response.status_code == 202, response.text

            await asyncio.gather(*(submit(i) for i in range(8)))
            sessions = create_sessionmaker(engine)
            await until(
                lambda: _is_zero(count_unfinished(sessions)),
                timeout=120,
                what="every job to finish",
            )
            api_steps = {
                name: (await clients[1].get(f"/v1/models/{name}")).json()["current_step"]
                for name in models
            }
        finally:
            for client in clients:
                await client.aclose()
    finally:
        for process in processes:
            stop(process)
    jobs = await job_rows(sessions)
    assert len(jobs) == len(models) * jobs_per_model
    check_one_step_per_job(jobs, api_steps)
    assert set(api_steps.values()) == {jobs_per_model}
    for name in models:
        assert len(checkpoints(settings.data_dir, name)) == jobs_per_model + 1  # 0000..n
    rows = await event_rows(sessions)
    check_one_claim_and_no_overlap(rows)
    assert len(claim_owners(rows)) == 2  # both workers took part
    ends = Counter(r.job_id for r in rows if r.type == "training_ended")
    assert set(ends.values()) == {1} and len(ends) == len(jobs)
