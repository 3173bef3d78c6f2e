"""Runs survive what the worker fleet survives: real `trainyard worker` processes killed with
SIGKILL at random points of a multi-step run on the cpu backend (mid-rollout, mid-step,
mid-validation, between children, inside the driver), and two workers on Postgres sharing
runs of several models."""

from __future__ import annotations

import asyncio
import json
import random
import signal
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.backends.tiny_model import make_tiny_model
from app.db import create_engine, create_sessionmaker
from app.jobs.payloads import Payload
from app.models import JobEventRow, JobRow, RunMetricRow, WorkerRow
from app.registry.models import create_model
from app.rollouts import spec as rollout_spec
from app.runs import service as runs
from app.runs.schedule import epoch_order
from app.schemas.models import ModelCreate
from app.schemas.runs import RunCreate
from app.settings import Settings
from tests.processes import start_worker, stop, until

pytestmark = [pytest.mark.slow, pytest.mark.torch]

TRAIN, PER_STEP, EPOCHS, SEED = 12, 2, 2, 11  # 12 steps: 6 per epoch, time for every kill
ENDS = {
    "job_retrying",
    "job_released",
    "job_cancelled",
    "training_ended",
    "training_failed",
    "rollout_ended",
    "rollout_failed",
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
async def sessions(
    make_settings: Any, tiny_model: Path
) -> AsyncIterator[tuple[Settings, async_sessionmaker[AsyncSession]]]:
    settings = make_settings(model_roots=[tiny_model.parent])
    engine = create_engine(settings.database_url)
    try:
        yield settings, create_sessionmaker(engine)
    finally:
        await engine.dispose()


def worker(settings: Settings, **env: str) -> Any:
    # Enough attempts for a child killed several times; short leases: recovery is quick.
    return start_worker(
        settings,
        TRAINYARD_MAX_ATTEMPTS="20",
        TRAINYARD_MODEL_ROOTS=",".join(str(p) for p in settings.model_roots),
        **env,
    )


async def start_run(
    sessions: async_sessionmaker[AsyncSession], settings: Settings, model: str, base: Path
) -> str:
    async with sessions() as session:
        body = {"name": model, "project": "tests", "base_model": str(base), "backend": "cpu"}
        await create_model(
            session,
            body=ModelCreate.model_validate(body),
            model_roots=settings.allowed_model_roots(),
        )
        await session.commit()
    examples = [
        {"id": f"e{i}", "messages": [{"role": "user", "content": f"say a number {i}"}]}
        for i in range(TRAIN)
    ]
    examples += [{**examples[i], "id": f"v{i}", "split": "validation"} for i in range(3)]
    request = {
        "model": model,
        "examples": examples,
        "recipe": {
            "num_generations": 4,
            "sampling": {"max_tokens": 1},
            "grader": {"type": "regex", "pattern": "^[0-9]$"},
        },
        "schedule": {"epochs": EPOCHS, "examples_per_step": PER_STEP, "shuffle_seed": SEED},
        "hyperparameters": {"learning_rate": 0.01},
        "validation": {"every_steps": 2, "num_generations": 8},
        "checkpoints": {"prune": False},
    }
    raw = json.dumps(request).encode()
    async with sessions() as session:
        row, _ = await runs.create_run(
            session,
            job=runs.prepare(RunCreate.model_validate_json(raw), raw, settings),
            idempotency_key=None,
            settings=settings,
        )
        await session.commit()
    return row.id


async def run_status(sessions: async_sessionmaker[AsyncSession], run_id: str) -> str:
    async with sessions() as session:
        return str(await session.scalar(select(JobRow.status).where(JobRow.id == run_id)))


async def running_child(sessions: async_sessionmaker[AsyncSession], run_id: str, role: str) -> bool:
    async with sessions() as session:
        found = await session.scalar(
            select(JobRow.id).where(
                JobRow.meta["run"].as_string() == run_id,
                JobRow.meta["run_role"].as_string() == role,
                JobRow.status == "running",
            )
        )
    return found is not None


async def check_run(sessions: async_sessionmaker[AsyncSession], run_id: str, model: str) -> None:
    """Contiguous steps, each trained once by one training job; every step's rollout
    sampled the examples the seeded epoch order gives it."""
    total = EPOCHS * (TRAIN // PER_STEP)
    async with sessions() as session:
        run = await session.get(JobRow, run_id)
        children = (
            await session.scalars(
                select(JobRow).where(JobRow.meta["run"].as_string() == run_id).order_by(JobRow.id)
            )
        ).all()
        metrics = (
            await session.scalars(
                select(RunMetricRow).where(RunMetricRow.run_id == run_id).order_by(RunMetricRow.seq)
            )
        ).all()
        for child in children:
            await session.refresh(child, ["payload"])
    assert run is not None and run.status == "succeeded", (run and run.status, run and run.error)
    steps = [m.step for m in metrics if m.kind == "step"]
    assert steps == list(range(1, total + 1)), steps
    training = [c for c in children if c.meta["run_role"] == "training"]
    assert all(c.status == "succeeded" for c in children), [(c.id, c.status) for c in children]
    assert sorted(c.final_step for c in training) == list(range(1, total + 1))
    assert all(c.final_step == c.start_step + 1 for c in training if c.start_step is not None)
    # The epoch order, as a run that never crashed would have had it.
    expected: list[list[str]] = []
    for epoch in range(EPOCHS):
        order = epoch_order(list(range(TRAIN)), SEED, epoch)
        expected += [[f"e{i}" for i in order[k : k + PER_STEP]] for k in range(0, TRAIN, PER_STEP)]
    sampled = []
    for child in children:
        if child.meta["run_role"] == "rollout":
            recipe = rollout_spec.decode(
                Payload(child.payload_format, child.payload, child.payload_bytes)
            )
            sampled.append([e.metadata["example_id"] for e in recipe.examples])
    assert sampled == expected


@pytest.mark.parametrize("seed", [1])
async def test_a_run_killed_again_and_again_finishes_as_if_it_never_was(
    sessions: Any, tiny_model: Path, seed: int
) -> None:
    settings, make = sessions
    run_id = await start_run(make, settings, "crashy", tiny_model)
    rng = random.Random(seed)
    kills: list[str] = []
    # Kill it in each kind of child, and at a random moment of the run.
    for target in ["rollout", "training", "validation", None]:
        process = worker(settings)
        try:
            if target is None:
                await asyncio.sleep(rng.uniform(0.2, 2.0))
                await until(
                    lambda: _running_or_final(make, run_id, "rollout"),
                    timeout=90,
                    what="a rollout job of the run to run",
                )
                await asyncio.sleep(rng.uniform(0, 0.3))
                if await _final(make, run_id):
                    break
                process.send_signal(signal.SIGKILL)
                process.wait(10)
            elif not await kill_in_child(process, make, run_id, target):
                break  # the run ended first
            kills.append(target or "random")
        finally:
            stop(process)
    assert kills[:3] == ["rollout", "training", "validation"], kills
    process = worker(settings)
    try:
        await until(
            lambda: _final(make, run_id), timeout=120, what="the run to end after the kills"
        )
    finally:
        stop(process)
    await check_run(make, run_id, "crashy")


async def _final(make: async_sessionmaker[AsyncSession], run_id: str) -> bool:
    return await run_status(make, run_id) in ("succeeded", "failed", "cancelled")


async def _running_or_final(make: async_sessionmaker[AsyncSession], run_id: str, role: str) -> bool:
    return await running_child(make, run_id, role) or await _final(make, run_id)


async def kill_in_child(
    process: Any,
    make: async_sessionmaker[AsyncSession],
    run_id: str,
    role: str,
    *,
    slice_s: float = 0.002,
    timeout: float = 90.0,
) -> bool:
    """SIGKILL the worker `process` while a `role` child of the run is running; False if
    the run ended first. Once the worker has registered, it runs in slices of `slice_s`
    and is stopped (SIGSTOP) while the database is read. A child runs for several slices
    (the quickest, a training step of the tiny model, for 7.5-15 ms here), so it is seen
    however fast the machine, and the kill lands while it still runs. A poll every 50 ms
    of a running worker once missed every training step of a run."""

    async def registered() -> bool:
        async with make() as session:
            found = await session.scalar(
                select(WorkerRow.id).where(
                    WorkerRow.pid == process.pid, WorkerRow.stopped_at.is_(None)
                )
            )
        return found is not None or await _final(make, run_id)

    await until(registered, timeout=timeout, what="the worker to register")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        process.send_signal(signal.SIGSTOP)
        try:
            if await running_child(make, run_id, role):
                process.send_signal(signal.SIGKILL)
                process.wait(10)
                return True
            if await _final(make, run_id):
                return False
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        assert loop.time() < deadline, f"timed out waiting for a {role} job of the run to run"
        await asyncio.sleep(slice_s)


async def test_two_workers_share_runs_of_three_models_one_job_per_model_at_a_time(
    sessions: Any, tiny_model: Path
) -> None:
    settings, make = sessions
    if not settings.database_url.startswith("postgresql"):
        pytest.skip("several worker processes share a database on Postgres")
    run_ids = {
        name: await start_run(make, settings, name, tiny_model) for name in ("ma", "mb", "mc")
    }
    # Two slots each: three runs do not fit one worker. (A worker claims a run's next child
    # in the write that ends the last one, so one with room for every run keeps them all.)
    workers = [worker(settings, TRAINYARD_WORKER_CONCURRENCY="2") for _ in range(2)]
    try:
        for run_id in run_ids.values():
            await until(lambda r=run_id: _final(make, r), timeout=180, what=f"run {run_id}")
    finally:
        for process in workers:
            stop(process)
    for name, run_id in run_ids.items():
        await check_run(make, run_id, name)
    # From the event log: no two jobs of one model ever held it at once, and both workers
    # did some of the work.
    async with make() as session:
        rows = (
            await session.execute(
                select(JobEventRow.job_id, JobEventRow.type, JobEventRow.data, JobRow.model_name)
                .join(JobRow, JobRow.id == JobEventRow.job_id)
                .where(JobRow.kind != "run")
                .order_by(JobEventRow.created_at, JobEventRow.id)
            )
        ).all()
    holder: dict[str, str | None] = defaultdict(lambda: None)
    owners = set()
    for job_id, type_, data, model in rows:
        if type_ == "job_claimed":
            assert holder[model] is None, f"{job_id} claimed while {holder[model]} held {model}"
            holder[model] = job_id
            owners.add(data["worker"])
        elif type_ in ENDS and holder[model] == job_id:
            holder[model] = None
    assert len(owners) == 2, owners
