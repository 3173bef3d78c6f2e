"""The `/metrics` scrape with the per-project counters (`app.metrics.ProjectCounters`),
against the same scrape without them, on a database holding JOBS ended jobs.

measured: `Metrics.render` (what `GET /metrics` runs) on SQLite, medians over ROUNDS:
`idle`, nothing new since the last scrape; `busy`, BURST more jobs ended (their first and
last events) since the last scrape.
baseline: the same render with the counters' read left out (the scrape as it was before
them), the rounds alternating with the measured ones on the same database. The goal is on
the idle scrape (what most scrapes are); the busy one is reported as its cost per job
ended since the last scrape.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import insert, inspect

from app.db import create_engine, create_sessionmaker, utcnow
from app.metrics import Metrics, job_events, jobs
from app.migrate import migrate
from app.models import DEFAULT_PROJECT_ID, JobRow, ModelRow
from bench.common import report
from bench.queue import queued_job_rows

JOBS = 20_000
BURST = 1_000
ROUNDS = 9
IDLE_PAIRS = 5  # idle scrapes are cheap: more of them, the medians steadier
MODELS = 10
GOAL = 1.2  # an idle scrape (nothing new) within 20% of the scrape without the counters


async def _ended(sessions: Any, count: int) -> None:
    """`count` training jobs that ran a minute and succeeded, with their first and last
    events, as a worker's final write leaves them."""
    now = utcnow()
    rows = queued_job_rows(count, MODELS)
    values = []
    for row in rows:
        values.append(
            {
                attr.columns[0].name: getattr(row, attr.key)
                for attr in inspect(JobRow).column_attrs
                if getattr(row, attr.key) is not None
            }
            | {
                "status": "succeeded",
                "kind": "training",
                "project_id": DEFAULT_PROJECT_ID,
                "started_at": now - timedelta(seconds=60),
                "finished_at": now,
                "created_at": now,
                "updated_at": now,
                "not_before": now,
                "last_event_seq": 2,
            }
        )
    events = [
        {"job_id": v["id"], "seq": seq, "type": kind, "data": {}, "created_at": now}
        for v in values
        for seq, kind in ((1, "job_queued"), (2, "training_ended"))
    ]
    async with sessions() as session:
        await session.execute(insert(jobs), values)
        await session.execute(insert(job_events), events)
        await session.commit()


async def _render(metrics: Metrics, sessions: Any, *, counters: bool) -> float:
    read = metrics.projects.read
    if not counters:

        async def skip(session: Any) -> None:
            return None

        metrics.projects.read = skip  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        await metrics.render(sessions)
        return time.perf_counter() - started
    finally:
        metrics.projects.read = read  # type: ignore[method-assign]


async def measure(directory: Path) -> dict[str, float]:
    engine = create_engine(f"sqlite+aiosqlite:///{directory / 'scrape.db'}")
    await migrate(engine)
    sessions = create_sessionmaker(engine)
    async with sessions() as session:
        session.add_all(
            ModelRow(
                name=f"m{i}",
                project="bench",
                base_model="b",
                backend="dry-run",
                config={},
                current_step=0,
                project_id=DEFAULT_PROJECT_ID,
            )
            for i in range(MODELS)
        )
        await session.commit()
    await _ended(sessions, JOBS)
    metrics = Metrics()
    await metrics.render(sessions)  # the first scrape: the counters start here
    times: dict[str, list[float]] = {k: [] for k in ("idle", "idle_base", "busy", "busy_base")}
    for _ in range(ROUNDS):
        for _ in range(IDLE_PAIRS):
            times["idle_base"].append(await _render(metrics, sessions, counters=False))
            times["idle"].append(await _render(metrics, sessions, counters=True))
        await _ended(sessions, BURST)
        times["busy"].append(await _render(metrics, sessions, counters=True))
        await _ended(sessions, BURST)
        times["busy_base"].append(await _render(metrics, sessions, counters=False))
        async with sessions() as session:  # untimed: the next idle round has nothing new
            await metrics.projects.read(session)
    await engine.dispose()
    return {k: statistics.median(v) for k, v in times.items()}


def run() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(measure(Path(tmp)))
    rows = [
        (f"{name} scrape (ms)", f"{result[name] * 1000:.1f} vs {result[name + '_base'] * 1000:.1f}")
        for name in ("idle", "busy")
    ]
    ratio = result["idle"] / result["idle_base"]
    result["scrape_ratio_idle"] = ratio
    rows.append(("scrape_ratio_idle", f"{ratio:.2f} (goal <= {GOAL})"))
    result["scrape_ratio_busy"] = result["busy"] / result["busy_base"]
    per_job = (result["busy"] - result["busy_base"]) / BURST * 1e6
    rows.append(("scrape_ratio_busy", f"{result['scrape_ratio_busy']:.2f} ({BURST} jobs ended)"))
    rows.append(("per job ended (us)", f"{per_job:.0f}"))
    report(f"scrape: /metrics with per-project counters, {JOBS} ended jobs", rows)
    return result


if __name__ == "__main__":
    run()
