"""Real `trainyard serve` / `trainyard worker` processes for tests, and what the tests
check across them: bounded waits, checkpoints on disk, one running job per model."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.models import JobEventRow, JobRow
from app.settings import Settings

T = TypeVar("T")
PATIENCE = 300.0
"""Seconds a test waits for what must happen eventually (a job to end, a page to show it)
before it calls it hung: far above the time it takes on a loaded 2-core machine (the stress
run, README), since it costs nothing while things work."""
TRAINYARD = str(Path(sys.executable).parent / "trainyard")


def environment(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment of a process that shares `settings`' database and data directory."""
    return {
        **os.environ,
        "TRAINYARD_DATABASE_URL": settings.database_url,
        "TRAINYARD_DATA_DIR": str(settings.data_dir),
        "TRAINYARD_LEASE_SECONDS": "1.0",
        "TRAINYARD_HEARTBEAT_SECONDS": "0.2",
        "TRAINYARD_POLL_SECONDS": "0.2",
        "TRAINYARD_RETRY_BASE_SECONDS": "0.05",
        "TRAINYARD_LOG_LEVEL": "warning",
        **extra,
    }


def start_worker(settings: Settings, **extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([TRAINYARD, "worker"], env=environment(settings, **extra))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_api(
    settings: Settings, port: int, *, output: IO[bytes] | None = None, **extra: str
) -> subprocess.Popen[bytes]:
    """`trainyard serve` on 127.0.0.1:`port` (with its in-process worker unless `extra`
    says TRAINYARD_WORKER_ENABLED=false); `output` takes its stdout and stderr."""
    env = environment(settings, TRAINYARD_HOST="127.0.0.1", TRAINYARD_PORT=str(port), **extra)
    stderr = subprocess.STDOUT if output is not None else None
    return subprocess.Popen([TRAINYARD, "serve"], env=env, stdout=output, stderr=stderr)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def until(
    condition: Callable[[], Awaitable[T]], timeout: float = PATIENCE, what: str = "condition"
) -> T:
    """Poll `condition` until it returns something truthy (bounded); returns that."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (result := await condition()):
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return result


async def wait_ready(
    url: str, processes: Iterable[subprocess.Popen[bytes]], timeout: float = 180.0
) -> None:
    """Wait until `url`/readyz answers 200; fail at once if a process died meanwhile."""
    processes = list(processes)
    last = "no answer"
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:

        async def ready() -> bool:
            nonlocal last
            for process in processes:
                assert process.poll() is None, f"{process.args!r} exited with {process.returncode}"
            try:
                response = await client.get("/readyz")
            except httpx.TransportError as exc:
                last = repr(exc)
                return False
            last = f"{response.status_code} {response.text[:500]}"
            return response.status_code == 200

        try:
            await until(ready, timeout=timeout, what=f"{url} to be ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last answer: {last}") from None


def checkpoints(data_dir: Path, model: str, project: str = "tests") -> list[str]:
    """The dry-run backend's checkpoint directories of `model`: its steps, on disk."""
    root = data_dir / "dry-run" / project / "models" / model / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def check_one_claim_and_no_overlap(rows: Iterable[tuple[str, str, datetime, Any, str]]) -> None:
    """From the event log, rows of (job_id, type, created_at, data, model_name) in insertion
    order: every job was claimed once, and no two jobs of one model ran at the same time."""
    claims: defaultdict[str, list[str]] = defaultdict(list)
    spans: defaultdict[str, defaultdict[str, list[datetime]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for job_id, type_, at, data, model in rows:
        if type_ == "job_claimed":
            claims[job_id].append(data["worker"])
        if type_ in {"job_claimed", "training_ended"}:
            spans[model][job_id].append(at)
    assert all(len(owners) == 1 for owners in claims.values()), "a job was claimed twice"
    for model, jobs in spans.items():
        assert all(len(span) == 2 for span in jobs.values()), f"a job of {model} has no end"
        intervals = sorted((start, end) for start, end in jobs.values())
        for (_, end), (start, _) in itertools.pairwise(intervals):
            assert end <= start, f"two running jobs of {model} overlapped"


def claim_owners(rows: Iterable[tuple[str, str, datetime, Any, str]]) -> set[str]:
    """The workers that claimed jobs, from the same rows."""
    return {data["worker"] for _, type_, _, data, _ in rows if type_ == "job_claimed"}


async def event_rows(sessions: async_sessionmaker[AsyncSession]) -> list[Any]:
    """Every event with its job's model, in the order they were written."""
    async with sessions() as session:
        return list(
            (
                await session.execute(
                    select(
                        JobEventRow.job_id,
                        JobEventRow.type,
                        JobEventRow.created_at,
                        JobEventRow.data,
                        JobRow.model_name,
                    )
                    .join(JobRow, JobRow.id == JobEventRow.job_id)
                    .order_by(JobEventRow.id)
                )
            ).all()
        )


async def pieces(raw: bytes, size: int = 1 << 20) -> AsyncIterator[bytes]:
    """The body a megabyte at a time, as a client streams a file. Handed to the socket
    whole, asyncio copies what the socket does not take at once into its buffer: 50 MB
    held this process's event loop (and so the probe) for over 80 ms."""
    for start in range(0, len(raw), size):
        yield raw[start : start + size]
