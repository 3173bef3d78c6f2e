"""Real `trainyard worker` processes: killed mid-training, and side by side on Postgres."""

from __future__ import annotations

import asyncio
import signal

import pytest
from sqlalchemy import func, select

from app.models import JobRow, WorkerRow
from tests.processes import (
    check_one_claim_and_no_overlap,
    claim_owners,
    event_rows,
    start_worker,
    stop,
    until,
)
from tests.processes import checkpoints as checkpoint_dirs
from tests.test_worker import Env, _env

pytestmark = pytest.mark.slow


def checkpoints(env: Env, model: str) -> list[str]:
    return checkpoint_dirs(env.settings.data_dir, model)


@pytest.fixture
async def plain_env(make_settings, tmp_path):
    from app.backends.dry_run import DryRunBackend

    # The test process only reads the backend's directory; the workers train.
    async for env in _env(make_settings, DryRunBackend(tmp_path / "data" / "dry-run")):
        yield env


@pytest.mark.parametrize("round_", range(3))
async def test_sigkill_mid_training_then_a_new_worker_finishes_it_once(plain_env, round_) -> None:
    env = plain_env
    # Even rounds: killed while the trainer works (not advanced: retried).
    # Odd rounds: killed after the step landed but before the worker applied it (counted).
    after_step = round_ % 2 == 1
    model = f"agent{round_}"
    await env.model(model, seconds_per_step=0.25, seconds_after_step=5.0 if after_step else 0)
    job_id = await env.job(model, collection=f_collection())
    first = start_worker(env.settings)
    try:
        await until(lambda: _has_event(env, job_id, "training_started"), what="training start")
        if after_step:
            await until(
                lambda: _async(checkpoints(env, model) == ["0000", "0001"]), what="the step to land"
            )
        else:
            await asyncio.sleep(0.3)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        stop(first)
    second = start_worker(env.settings)
    try:
        row = await until(lambda: _final(env, job_id), what="the job to finish")
    finally:
        stop(second)
    assert row.status == "succeeded", row.error
    assert checkpoints(env, model) == ["0000", "0001"]  # the step advanced exactly once
    events = await env.events(job_id)
    assert events.count("training_ended") == 1
    assert row.final_step == 1
    assert row.recovered is after_step
    assert row.attempts == (1 if after_step else 2)


def f_collection() -> dict:
    from tests.factories import nat_collection

    return nat_collection([[1.0, 0.0]] * 4)


async def _async(value):
    return value


async def _has_event(env: Env, job_id: str, type_: str) -> bool:
    return type_ in await env.events(job_id)


async def _final(env: Env, job_id: str) -> JobRow | None:
    row = await env.row(job_id)
    return row if row.status in {"succeeded", "failed", "cancelled"} else None


async def test_two_workers_on_postgres_share_a_burst_without_overlap(
    plain_env, database_url
) -> None:
    if not database_url.startswith("postgresql"):
        pytest.skip("many worker processes need Postgres; SQLite is one process")
    env = plain_env
    models = [f"m{i}" for i in range(4)]
    for name in models:
        await env.model(name, seconds_per_step=0.02)
    # Two slots each for four models: neither worker can take the whole burst alone.
    workers = [start_worker(env.settings, TRAINYARD_WORKER_CONCURRENCY="2") for _ in range(2)]
    try:

        async def both_started() -> bool:  # a slow start would leave the burst to the other
            async with env.sessions() as session:
                started = await session.scalar(
                    select(func.count()).select_from(WorkerRow).where(WorkerRow.pid.in_(pids))
                )
            return started == len(workers)

        pids = [worker.pid for worker in workers]
        await until(both_started, timeout=120, what="both workers to start")
        job_ids = [await env.job(models[i % 4]) for i in range(40)]

        async def all_done() -> bool:
            async with env.sessions() as session:
                done = await session.scalar(
                    select(func.count()).where(JobRow.status == "succeeded")
                )
            return done == len(job_ids)

        await until(all_done, timeout=60, what="every job to succeed")
    finally:
        for worker in workers:
            stop(worker)
    rows = await event_rows(env.sessions)
    check_one_claim_and_no_overlap(rows)
    assert len(claim_owners(rows)) == 2
    for name in models:
        assert checkpoints(env, name) == [f"{i:04d}" for i in range(11)]
