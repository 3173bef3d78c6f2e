"""A training run's orchestration overhead.

measured: a run of 20 steps (4 examples x 8 answers a step, a validation every 5 steps)
on the cpu backend's tiny model, served by `trainyard serve`'s app with its in-process
worker over SQLite: the run's wall time, from its start to its end. Baseline: the sum of
its child jobs' own times (each from its claim to its end), from the same run. The ratio
is what driving the run costs on top of its work: deciding, writing, waking, claiming.
(The dry-run backend serves no model to sample, so a run needs the cpu backend.)
"""

from __future__ import annotations

import asyncio
import tempfile
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

STEPS = 20
GOAL = 1.05


async def run() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_tiny_model(root / "models" / "tiny")
        settings = Settings(
            database_url=f"sqlite+aiosqlite:///{root / 'bench.db'}",
            data_dir=root / "data",
            model_roots=[base.parent],
            log_level="warning",
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
                figures = await _measure(c, app, str(base))
        finally:
            server.should_exit = True
            await task
    wall, children, count = figures["wall"], figures["children"], figures["count"]
    ratio = wall / children
    report(
        f"training run: {STEPS} steps on the cpu backend (tiny model), SQLite",
        [
            ("baseline: sum of its child jobs' own times", f"{children:.2f} s ({count:.0f} jobs)"),
            ("the run's wall time", f"{wall:.2f} s"),
            ("ratio run / children (orchestration)", f"{ratio:.3f}x (goal <= {GOAL})"),
        ],
    )
    return {"run_overhead": ratio}


async def _measure(client: httpx.AsyncClient, app: Any, base: str) -> dict[str, float]:
    body = {"name": "bench", "project": "bench", "base_model": base, "backend": "cpu"}
    assert (await client.post("/v1/models", json=body)).status_code == 201
    for _ in range(600):
        if (await client.get("/v1/models/bench")).json().get("inference_base_url"):
            break
        await asyncio.sleep(0.05)
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
    wall = (run.finished_at - run.started_at).total_seconds()
    own = sum(
        (c.finished_at - c.started_at).total_seconds()
        for c in children
        if c.started_at is not None and c.finished_at is not None
    )
    return {"wall": wall, "children": own, "count": float(len(children))}


if __name__ == "__main__":
    asyncio.run(run())
