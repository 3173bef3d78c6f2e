"""Real `trainyard worker` processes: killed mid-training, and side by side on Postgres."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Awaitable, Callable

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


@pytest.mark.parametrize("round_", range(2))
async def test_sigkill_mid_training_then_a_new_worker_finishes_it_once(plain_env, round_) -> None:
    env = plain_env
    # Round 0: killed while the trainer works (not advanced: retried).
    # Round 1: killed after the step landed but before the worker applied it (counted).
    # The worker runs in slices and is looked at while stopped (SIGSTOP), so the kill lands
    # in the state it was seen in however busy the machine (no sleep racing the trainer).
    after_step = round_ % 2 == 1
    model = f"agent{round_}"
    await env.model(model, seconds_per_step=0.5, seconds_after_step=30.0 if after_step else 0)
    job_id = await env.job(model, collection=f_collection())

    async def killable() -> bool:
        if after_step:
            landed = checkpoints(env, model) == ["0000", "0001"]
            return landed and "training_ended" not in await env.events(job_id)
        started = await _has_event(env, job_id, "training_started")
        return started and checkpoints(env, model) == ["0000"]

    first = start_worker(env.settings)
    try:
        # Sliced only once training runs (the start-up is slow in slices); a step takes 2 s.
        # A worker's start-up (imports) took over 30 s on a 2-core machine at load 12.
        await until(
            lambda: _has_event(env, job_id, "training_started"), timeout=180, what="training start"
        )
        await kill_when(first, killable, what="the state to kill in")
    finally:
        stop(first)
    second = start_worker(env.settings)
    try:
        row = await until(lambda: _final(env, job_id), timeout=180, what="the job to finish")
    finally:
        stop(second)
    assert row.status == "succeeded", row.error
    assert checkpoints(env, model) == ["0000", "0001"]  # the step advanced exactly once
    events = await env.events(job_id)
    assert events.count("training_ended") == 1
    assert row.final_step == 1
    assert row.recovered is after_step
    assert row.attempts == (1 if after_step else 2)


async def kill_when(
    process: subprocess.Popen[bytes],
    condition: Callable[[], Awaitable[bool]],
    *,
    what: str,
    slice_s: float = 0.002,
    timeout: float = 120.0,
) -> None:
    """SIGKILL `process` in a state where `condition` holds: it runs in slices of
    `slice_s` and is stopped (SIGSTOP) while `condition` is read."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        process.send_signal(signal.SIGSTOP)
        try:
            if await condition():
                process.send_signal(signal.SIGKILL)
                process.wait(10)
                return
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        assert process.poll() is None, f"the worker exited with {process.returncode}"
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(slice_s)


def f_collection() -> dict:
    from tests.factories import nat_collection

    return nat_collection([[1.0, 0.0]] * 4)


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
