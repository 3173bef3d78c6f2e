"""A training run's orchestration overhead, on SQLite and on Postgres.

measured: a run of 20 steps (4 examples x 8 answers a step, a validation every 5 steps)
on the cpu backend's tiny model, served by `trainyard serve`'s app with its in-process
worker: the run's wall time, from its start to its end. Baseline: the sum of its child
jobs' own times (each from its claim to its end), from the same run. The ratio is what
driving the run costs on top of its work: deciding, writing, waking, claiming. Where that
time goes is printed too: the gaps between one child's end and the next one's claim, by
the kind of hand-over (`r>t`: a rollout's end to its training job's claim, ...), and the
run's start and end. (The dry-run backend serves no model to sample, so a run needs the
cpu backend.) Postgres: TRAINYARD_BENCH_POSTGRES_URL, whose `public` schema is dropped.
On each database a first run warms the process up, not counted: its children took ~50%
longer than the next runs' (torch's first passes), which made its ratio look ~0.03-0.04
better. Then RUNS runs one after another (BENCH_RUNS_REPEAT, 3): the ratio reported is
their median, each run's printed.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
from collections import defaultdict
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from sqlalchemy import select

from app.backends.tiny_model import make_tiny_model
from app.main import create_app
from app.models import JobRow
from app.settings import Settings
from bench.common import report
from bench.queue import POSTGRES, _reset

STEPS = 20
GOAL = 1.05
RUNS = int(os.environ.get("BENCH_RUNS_REPEAT", "3"))


async def run() -> dict[str, float]:
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_tiny_model(root / "models" / "tiny")
        for dialect, url in (
            ("SQLite", f"sqlite+aiosqlite:///{root / 'bench.db'}"),
            ("Postgres", POSTGRES),
        ):
            ratio = await one(dialect, url, root / dialect, base)
            figures[f"run_overhead_{dialect.lower()}"] = ratio
    return figures


async def one(dialect: str, url: str, data_dir: Path, base: Path) -> float:
    """One run on one database; prints its figures and returns its ratio."""
    await _reset(url)
    settings = Settings(
        database_url=url, data_dir=data_dir, model_roots=[base.parent], log_level="warning"
    )
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            await _register(c, str(base))
            warm = await _measure(c, app)  # not counted: the process's first children
            runs = [await _measure(c, app) for _ in range(RUNS)]
    finally:
        server.should_exit = True
        await task
    ratios = [figures["wall"] / figures["children"] for figures in runs]
    ratio = statistics.median_low(ratios)
    middle = runs[ratios.index(ratio)]
    wall, children, count = middle["wall"], middle["children"], middle["count"]
    gaps = [
        (f"  gap {name}", f"{1000 * total:.0f} ms ({n:.0f}, median {1000 * median:.1f} ms)")
        for name, (total, n, median) in sorted(_gaps(middle).items())
    ]
    report(
        f"training run: {STEPS} steps on the cpu backend (tiny model), {dialect}",
        [
            (
                "warm-up run, not counted",
                f"{warm['wall'] / warm['children']:.3f} "
                f"({warm['wall']:.2f} / {warm['children']:.2f} s)",
            ),
            (
                "runs: ratio (wall / children)",
                ", ".join(
                    f"{r:.3f} ({f['wall']:.2f} / {f['children']:.2f} s)"
                    for r, f in zip(ratios, runs, strict=True)
                ),
            ),
            ("the median run:", ""),
            (
                "  baseline: sum of its child jobs' own times",
                f"{children:.2f} s ({count:.0f} jobs)",
            ),
            ("  the run's wall time", f"{wall:.2f} s"),
            ("ratio run / children (orchestration), median", f"{ratio:.3f}x (goal <= {GOAL})"),
            ("the rest of the median run, where it goes:", ""),
            *gaps,
        ],
    )
    return ratio


def _gaps(figures: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    by: dict[str, list[float]] = defaultdict(list)
    for name, seconds in figures["gaps"]:
        by[name].append(seconds)
    return {name: (sum(s), len(s), statistics.median(s)) for name, s in by.items()}


async def _register(client: httpx.AsyncClient, base: str) -> None:
    body = {"name": "bench", "project": "bench", "base_model": base, "backend": "cpu"}
    assert (await client.post("/v1/models", json=body)).status_code == 201
    for _ in range(600):
        if (await client.get("/v1/models/bench")).json().get("inference_base_url"):
            break
        await asyncio.sleep(0.05)


async def _measure(client: httpx.AsyncClient, app: Any) -> dict[str, Any]:
    """One run of the model registered (each run goes on from the step the last ended at)."""
    examples = [
        {"id": i, "messages": [{"role": "user", "content": f"say a number {i}"}]} for i in range(8)
    ]
    examples.append({**examples[0], "id": "v", "split": "validation"})
    response = await client.post(
        "/v1/runs",
        json={
            "model": "bench",
            "examples": examples,
            "recipe": {
                "num_generations": 8,
                "sampling": {"max_tokens": 1},
                "grader": {"type": "regex", "pattern": "^[0-9]$"},
            },
            "schedule": {"max_steps": STEPS, "examples_per_step": 4},
            "hyperparameters": {"learning_rate": 0.01},
            "validation": {"every_steps": 5, "num_generations": 4},
        },
    )
    assert response.status_code == 202, response.text
    run_id = response.json()["id"]
    while (await client.get(f"/v1/runs/{run_id}")).json()["status"] not in (
        "succeeded",
        "failed",
        "cancelled",
    ):
        await asyncio.sleep(0.1)
    async with app.state.sessions() as session:
        run = await session.get(JobRow, run_id)
        children = (
            await session.scalars(select(JobRow).where(JobRow.meta["run"].as_string() == run_id))
        ).all()
    assert run is not None and run.status == "succeeded", run and run.error
    assert run.started_at is not None and run.finished_at is not None
    spans = sorted(
        (c.started_at, c.finished_at, c.id.rpartition("-")[2][0])
        for c in children
        if c.started_at is not None and c.finished_at is not None
    )
    return {
        "wall": (run.finished_at - run.started_at).total_seconds(),
        "children": sum((end - start).total_seconds() for start, end, _ in spans),
        "count": float(len(children)),
        "gaps": _spans_gaps(run.started_at, run.finished_at, spans),
    }


def _spans_gaps(
    start: datetime, end: datetime, spans: list[tuple[datetime, datetime, str]]
) -> list[tuple[str, float]]:
    """The time between the run's start, its children one after another, and its end."""
    gaps = [("start", (spans[0][0] - start).total_seconds())]
    for (_, ended, was), (began, _, then) in pairwise(spans):
        gaps.append((f"{was}>{then}", (began - ended).total_seconds()))
    gaps.append(("end", (end - spans[-1][1]).total_seconds()))
    return gaps


if __name__ == "__main__":
    asyncio.run(run())
