"""A fleet of separate processes on Postgres, run as an operator runs one (README "Run a
fleet"): the API alone (`trainyard serve`, no worker in it), workers in two pools
(`default` x2 and, later, one more; `gpu` x1 with a label), each with a data directory and
checkpoint cache of its own and no shared disk, checkpoints only in an S3 object store
(moto's server, a process of its own), and a serving pool (`trainyard serve-pool`) for
the base model behind the gateway.

One default worker is killed (SIGKILL) mid-step and the other drained (SIGTERM) mid-step:
each is stopped (SIGSTOP) once it is seen mid-step and looked at again while stopped, so
the signal lands in the state that was seen however busy the machine. Leases
are 30 s, so no live worker's lapses; the dead worker's lease and heartbeat are played
forward by the test (its own clock control), not waited for. Then: every job ran on a
worker of its pool, exactly once (each step has one job, each job one step, the steps
contiguous), and the gateway serves old and new steps through the pool; the `gpu` model
waited, said why, and ran once a worker of its pool started."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.backends.tiny_model import make_tiny_model
from app.db import create_engine
from tests.backends import wait_final
from tests.conftest import POSTGRES_URL
from tests.processes import TRAINYARD, free_port, stop, until, wait_ready

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch,
    pytest.mark.postgres,  # `-k postgres` (CI's Postgres leg) selects it
    pytest.mark.skipif(
        not POSTGRES_URL, reason="needs TRAINYARD_TEST_DATABASE_URL (a Postgres server)"
    ),
]
S3_KEY = "test"  # moto takes any key
PROMPT = [{"role": "user", "content": "say yes"}]
JOBS = {"alpha": 3, "beta": 3, "gamma": 2}  # training jobs per model
# Copies of the sampled group in a default-pool job: each trains long enough (a step over
# 128 answers) that a look every 10 ms sees its worker mid-step on any machine, fast or busy.
WIDE = 16
DEFAULT_MODELS = ("alpha", "beta")  # pool `default`; gamma is in pool `gpu`


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fleet-models") / "tiny")


@pytest.fixture
def object_store() -> Iterator[str]:
    """moto's S3 server in a process of its own, with a bucket made as an operator would
    (boto3); its endpoint."""
    import boto3

    port = free_port()
    moto = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):  # a minute
            assert moto.poll() is None, "moto_server exited"
            try:
                httpx.get(endpoint, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        else:
            raise AssertionError("moto_server never answered")
        keys = {"aws_access_key_id": S3_KEY, "aws_secret_access_key": S3_KEY}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys).create_bucket(
            Bucket="fleet"
        )
        yield endpoint
    finally:
        stop(moto)


class Fleet:
    """The fleet's processes, started with one environment (database, object store, model
    roots) and a data directory each."""

    def __init__(self, root: Path, database_url: str, endpoint: str, tiny: Path) -> None:
        self.root = root
        self.tiny = tiny
        self.processes: list[subprocess.Popen[bytes]] = []
        self.pool_port, self.api_port = free_port(), free_port()
        self.pool_url = f"http://127.0.0.1:{self.pool_port}/v1"
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        self.env = {
            "TRAINYARD_DATABASE_URL": database_url,
            "TRAINYARD_MIGRATE_ON_START": "false",  # the test database is at head
            "TRAINYARD_CHECKPOINT_URL": "s3://fleet/checkpoints",
            "TRAINYARD_CHECKPOINT_S3_ENDPOINT": endpoint,
            "TRAINYARD_CHECKPOINT_S3_REGION": "us-east-1",
            "TRAINYARD_CHECKPOINT_S3_ACCESS_KEY_ID": S3_KEY,
            "TRAINYARD_CHECKPOINT_S3_SECRET_ACCESS_KEY": S3_KEY,
            "TRAINYARD_MODEL_ROOTS": str(tiny.parent),
            "TRAINYARD_SERVING_POOLS": f'{{"{tiny}": ["{self.pool_url}"]}}',
            "TRAINYARD_CPU_DEVICE": "cpu",
            # Long enough that no live worker's lease lapses on a busy machine; the killed
            # worker's is expired by the test.
            "TRAINYARD_LEASE_SECONDS": "30",
            "TRAINYARD_HEARTBEAT_SECONDS": "0.5",
            "TRAINYARD_POLL_SECONDS": "0.2",
            "TRAINYARD_RETRY_BASE_SECONDS": "0.05",
            "TRAINYARD_LOG_LEVEL": "warning",
        }

    def start(self, name: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
        data_dir = self.root / name  # its own: database rows and the store are all it shares
        environ = {
            **os.environ,
            **self.env,
            "TRAINYARD_DATA_DIR": str(data_dir),
            **env,
        }
        process = subprocess.Popen([TRAINYARD, *args], env=environ)
        self.processes.append(process)
        return process

    def worker(self, name: str, pool: str, *labels: str) -> subprocess.Popen[bytes]:
        extra = ["--labels", ",".join(labels)] if labels else []
        return self.start(
            name,
            *("worker", "--pool", pool, "--backends", "cpu", *extra),
            TRAINYARD_WORKER_CONCURRENCY="1",
        )

    def stop_all(self) -> None:
        for process in self.processes:
            stop(process)


async def stop_in(
    process: subprocess.Popen[bytes], condition: Callable[[], Awaitable[bool]], *, what: str
) -> None:
    """Stop `process` (SIGSTOP) in a state where `condition` holds: read while it runs,
    then again once it is stopped, so what the caller does next lands in that state however
    busy the machine. Start it before the work that gets there: a worker whose jobs all end
    before the first look is never seen in them. The caller continues it (SIGCONT)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 180
    while True:
        assert process.poll() is None, f"{process.args} exited with {process.returncode}"
        assert loop.time() < deadline, f"timed out waiting for {what}"
        if await condition():
            process.send_signal(signal.SIGSTOP)
            await asyncio.sleep(0.05)  # what it sent before it stopped is written
            if await condition():
                return
            process.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.01)


class MidStep:
    """Whether a worker is training a step now: a job under its lease whose trainer was
    called (`training_started`, or progress) and has not ended; which job."""

    def __init__(self, engine: AsyncEngine, worker_id: str) -> None:
        self.engine, self.worker_id = engine, worker_id
        self.job_id = ""

    async def seen(self) -> bool:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    text(
                        "SELECT j.id, (SELECT e.type FROM job_events e WHERE e.job_id = j.id "
                        "ORDER BY e.seq DESC LIMIT 1) AS last FROM jobs j "
                        "WHERE j.status = 'running' AND j.lease_owner = :worker"
                    ),
                    {"worker": self.worker_id},
                )
            ).first()
        self.job_id = row.id if row and row.last in {"training_started", "gradient_step"} else ""
        return bool(self.job_id)


async def play_forward(engine: AsyncEngine, worker_id: str) -> None:
    """The lease time passes for a dead worker: its jobs' leases expire and it stops
    counting as live (as 30 s of silence would do)."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE jobs SET lease_expires_at = now() - interval '1 second' "
                "WHERE lease_owner = :worker AND status = 'running'"
            ),
            {"worker": worker_id},
        )
        await conn.execute(
            text("UPDATE workers SET heartbeat_at = now() - interval '1 hour' WHERE id = :worker"),
            {"worker": worker_id},
        )


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_a_fleet_of_processes_on_postgres(
    database_url: str, object_store: str, tiny_model: Path, tmp_path: Path
) -> None:
    fleet = Fleet(tmp_path, database_url, object_store, tiny_model)
    engine = create_engine(database_url)
    try:
        pool = fleet.start(
            "pool", "serve-pool", "--base-model", str(tiny_model), "--port", str(fleet.pool_port)
        )
        api = fleet.start(
            "api", "serve", TRAINYARD_WORKER_ENABLED="false", TRAINYARD_PORT=str(fleet.api_port)
        )
        first, second = fleet.worker("a", "default"), fleet.worker("b", "default")
        async with httpx.AsyncClient(base_url=fleet.api_url, timeout=120) as client:
            await wait_ready(fleet.api_url, [api])
            await _run(fleet, client, engine, pool=pool, first=first, second=second)
    finally:
        fleet.stop_all()
        await engine.dispose()


async def _run(
    fleet: Fleet,
    client: httpx.AsyncClient,
    engine: AsyncEngine,
    *,
    pool: subprocess.Popen[bytes],
    first: subprocess.Popen[bytes],
    second: subprocess.Popen[bytes],
) -> None:
    base = str(fleet.tiny)
    for name in DEFAULT_MODELS:
        await _model(client, name, base)
    await _model(client, "gamma", base, pool="gpu", labels={"gpu": "h200"})
    groups = await _groups(fleet.pool_url, base, pool)
    workers = {name: await _registered(client, p) for name, p in (("a", first), ("b", second))}
    # Watched from before its jobs are submitted: on a fast machine they all end quickly.
    killed = MidStep(engine, workers["a"]["id"])
    stopping = asyncio.create_task(stop_in(first, killed.seen, what="worker a mid-step"))
    jobs: dict[str, list[str]] = {name: [] for name in JOBS}
    for i in range(max(JOBS.values())):  # interleaved: each model's queue has work at once
        for name, count in JOBS.items():
            if i < count:
                wide = groups if name == "gamma" else groups * WIDE
                jobs[name].append(await _submit(client, name, wide))

    # The gpu model waits, and says why, until a worker of its pool with its label starts.
    for job_id in jobs["gamma"]:
        assert await _waiting(client, job_id) == "no live worker in pool `gpu`"
    gpu = fleet.worker("g", "gpu", "gpu=h200", "zone=a")

    # kill -9 one default worker mid-step; the test plays its lease time forward.
    await stopping
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    # Drain the other mid-step: SIGTERM lands while it trains; it finishes or hands back
    # that job, claims nothing more, and exits 0. Its work after the kill: the killed job
    # once its lease has lapsed, and one more job (it may have ended all the others).
    drained = MidStep(engine, workers["b"]["id"])
    draining = asyncio.create_task(stop_in(second, drained.seen, what="worker b mid-step"))
    await play_forward(engine, workers["a"]["id"])
    jobs["beta"].append(await _submit(client, "beta", groups * WIDE))
    await draining
    second.send_signal(signal.SIGTERM)
    second.send_signal(signal.SIGCONT)
    assert await asyncio.to_thread(second.wait, 120) == 0
    listed = {w["id"] for w in (await client.get("/v1/workers")).json()}
    assert not listed & {workers["a"]["id"], workers["b"]["id"]}

    # No live default worker now: its queued jobs say so, a new one too; then one starts.
    jobs["alpha"].append(await _submit(client, "alpha", groups))

    async def says_none_is_live() -> bool:
        return await _waiting(client, jobs["alpha"][-1]) == "no live worker in pool `default`"

    # The API reads the live workers at most once a second (`LIVE_WORKERS_TTL`).
    await until(says_none_is_live, 60, "the new job to say no default worker is live")
    for name in DEFAULT_MODELS:
        for job_id in jobs[name]:
            job = (await client.get(f"/v1/training-jobs/{job_id}")).json()
            if job["status"] == "queued":
                assert job["waiting_for"] == "no live worker in pool `default`", job
    third = fleet.worker("c", "default")
    workers |= {"g": await _registered(client, gpu), "c": await _registered(client, third)}
    done = {job_id: await wait_final(client, job_id) for name in JOBS for job_id in jobs[name]}
    assert {job_id: job["status"] for job_id, job in done.items()} == dict.fromkeys(
        done, "succeeded"
    )

    await _check_claims(engine, jobs, workers)
    await _check_steps_once(client, engine, jobs, done)
    events = await _events(engine)
    claims = [(job_id, data["worker"]) for job_id, type_, data in events if type_ == "job_claimed"]

    def claimed(job: str) -> list[str]:
        return [worker for job_id, worker in claims if job_id == job]

    a, b, c = (workers[name]["id"] for name in "abc")
    # The killed job: trained again by another worker, or (its step had landed) counted.
    assert claimed(killed.job_id)[0] == a
    assert done[killed.job_id]["result"]["recovered"] or len(claimed(killed.job_id)) > 1
    # The drained worker claimed nothing after: the job it ran when told (maybe the killed
    # one, retried) was its last; it finished it or handed it back (`job_released`) to c.
    assert [job_id for job_id, worker in claims if worker == b][-1] == drained.job_id
    released = (drained.job_id, "job_released") in {(job_id, t) for job_id, t, _ in events}
    before = [a] if drained.job_id == killed.job_id else []
    assert claimed(drained.job_id) == [*before, b, *([c] if released else [])]
    await _check_served(client, fleet.pool_url, jobs)


async def _model(client: httpx.AsyncClient, name: str, base: str, **placement: Any) -> None:
    body = {"name": name, "project": "fleet", "base_model": base, "backend": "cpu", **placement}
    created = await client.post("/v1/models", json=body)
    assert created.status_code == 201, created.text


async def _groups(pool_url: str, base: str, pool: subprocess.Popen[bytes]) -> list[dict]:
    """One group of eight answers sampled from the base model through the serving pool,
    rewarded alternately (so it trains)."""
    async with httpx.AsyncClient(timeout=120) as direct:

        async def listening() -> bool:
            assert pool.poll() is None, "the serving pool exited"
            try:
                return (await direct.get(f"{pool_url}/models")).status_code == 200
            except httpx.TransportError:
                return False

        await until(listening, 180, "the serving pool")
        sampled = await direct.post(
            f"{pool_url}/chat/completions",
            json={"model": base, "messages": PROMPT, "n": 8, "max_tokens": 2, "logprobs": True},
        )
    assert sampled.status_code == 200, sampled.text
    choices = sampled.json()["choices"]
    return [
        {
            "trajectories": [
                {"messages_and_choices": [*PROMPT, choice], "reward": float(i % 2)}
                for i, choice in enumerate(choices)
            ]
        }
    ]


async def _submit(client: httpx.AsyncClient, model: str, groups: list[dict]) -> str:
    body = {"model": model, "groups": groups, "hyperparameters": {"learning_rate": 0.05}}
    answer = await client.post("/v1/training-jobs", json=body)
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


async def _waiting(client: httpx.AsyncClient, job_id: str) -> str | None:
    job = (await client.get(f"/v1/training-jobs/{job_id}")).json()
    assert job["status"] == "queued", job
    return job["waiting_for"]


async def _registered(client: httpx.AsyncClient, process: subprocess.Popen[bytes]) -> dict:
    async def seen() -> dict | None:
        assert process.poll() is None, f"{process.args} exited with {process.returncode}"
        return {w["pid"]: w for w in (await client.get("/v1/workers")).json()}.get(process.pid)

    return await until(seen, 180, f"{process.args} to register")


async def _events(engine: AsyncEngine) -> list[Any]:
    async with engine.connect() as conn:
        return list(
            (
                await conn.execute(text("SELECT job_id, type, data FROM job_events ORDER BY id"))
            ).all()
        )


async def _check_claims(
    engine: AsyncEngine, jobs: dict[str, list[str]], workers: dict[str, dict]
) -> None:
    """Every claim of a job went to a worker of its model's pool (claim events name the
    worker; /v1/workers named its pool), the gpu model's to the labelled worker only."""
    pools = {w["id"]: w["pool"] for w in workers.values()}
    model_of = {job_id: name for name, ids in jobs.items() for job_id in ids}
    claims: dict[str, list[str]] = {job_id: [] for job_id in model_of}
    for job_id, type_, data in await _events(engine):
        if type_ == "job_claimed":
            claims[job_id].append(data["worker"])
    for job_id, owners in claims.items():
        want = "gpu" if model_of[job_id] == "gamma" else "default"
        assert owners and {pools[owner] for owner in owners} == {want}, (job_id, owners)
    assert {o for j in jobs["gamma"] for o in claims[j]} == {workers["g"]["id"]}
    default_owners = {o for n in DEFAULT_MODELS for j in jobs[n] for o in claims[j]}
    assert default_owners == {workers[k]["id"] for k in ("a", "b", "c")}


async def _check_steps_once(
    client: httpx.AsyncClient,
    engine: AsyncEngine,
    jobs: dict[str, list[str]],
    done: dict[str, dict],
) -> None:
    """Nothing lost or trained twice: each model's steps in the store are 0..N, step n was
    made by exactly one job and each job made exactly one step, ended once."""
    ended = [job_id for job_id, type_, _ in await _events(engine) if type_ == "training_ended"]
    assert sorted(ended) == sorted(done)
    for name, ids in jobs.items():
        listed = (await client.get(f"/v1/models/{name}/checkpoints", params={"limit": 100})).json()
        steps = {c["step"]: c["job_id"] for c in listed["data"]}
        assert sorted(steps) == list(range(len(ids) + 1)), (name, steps)
        assert sorted(done[job_id]["result"]["final_step"] for job_id in ids) == list(
            range(1, len(ids) + 1)
        )
        assert {steps[n] for n in range(1, len(ids) + 1)} == set(ids)
        # Real steps: each changed the weights (a recovered one is not known).
        assert all(done[j]["result"]["trained"] in {True, None} for j in ids)
        model = (await client.get(f"/v1/models/{name}")).json()
        assert model["current_step"] == len(ids)


async def _check_served(client: httpx.AsyncClient, pool_url: str, jobs: dict) -> None:
    """The gateway serves an old and the newest step of a model, and a model's latest, from
    the pool: the pool holds each as `name@N`, loaded from the object store, and answers as
    the gateway did."""
    last = len(jobs["alpha"])
    greedy = {"messages": PROMPT, "max_tokens": 2, "temperature": 0, "logprobs": True}
    answers = {}
    for name in ("alpha@1", f"alpha@{last}", "gamma"):
        answer = await client.post("/openai/v1/chat/completions", json={"model": name, **greedy})
        assert answer.status_code == 200, answer.text
        answers[answer.json()["model"]] = answer.json()
    served = {"alpha@1", f"alpha@{last}", f"gamma@{len(jobs['gamma'])}"}
    assert set(answers) == served
    async with httpx.AsyncClient(timeout=120) as direct:
        listed = (await direct.get(f"{pool_url}/models")).json()["data"]
        roots = {m["id"]: m["root"] for m in listed if m["parent"] is not None}
        assert served <= set(roots), roots
        for name in served:
            model, step = name.split("@")
            assert roots[name] == (
                f"s3://fleet/checkpoints/cpu/fleet/models/{model}/checkpoints/{int(step):04d}"
            )
            asked = await direct.post(
                f"{pool_url}/chat/completions", json={"model": name, **greedy}
            )
            assert _logprobs(asked.json()) == _logprobs(answers[name])
    assert _logprobs(answers["alpha@1"]) != _logprobs(answers[f"alpha@{last}"])  # steps differ


def _logprobs(answer: dict) -> list[float]:
    return [t["logprob"] for t in answer["choices"][0]["logprobs"]["content"]]
