"""Backends for tests. They stand where a GPU would, and satisfy the same `art.Backend`
Protocol with the same data: the dry-run backend, recording what it was handed."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import art
import httpx

from app.backends.base import report_gradient_step
from app.backends.dry_run import DryRunBackend
from tests.processes import PATIENCE

FINAL = {"succeeded", "failed", "cancelled"}


class RecordingBackend(DryRunBackend):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.calls: list[tuple[str, list[art.TrajectoryGroup], dict[str, Any]]] = []
        self.started = asyncio.Event()

    async def train(
        self,
        model: art.TrainableModel,
        trajectory_groups: Iterable[art.TrajectoryGroup],
        **kwargs: Any,
    ) -> art.TrainResult:
        groups = list(trajectory_groups)
        self.calls.append((model.name, groups, kwargs))
        self.started.set()
        return await super().train(model, groups, **kwargs)


class FlakyBackend(DryRunBackend):
    """Refuses connections for its first `failures` training calls, like a restarting server."""

    def __init__(self, path: Path, failures: int) -> None:
        super().__init__(path)
        self.failures = failures
        self.attempts = 0

    async def train(self, model: Any, trajectory_groups: Any, **kwargs: Any) -> art.TrainResult:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise ConnectionRefusedError(111, "Connection refused")
        return await super().train(model, trajectory_groups, **kwargs)


class DivergingBackend(DryRunBackend):
    """Training that diverged: its gradient step and its result report NaN and infinite
    metrics, as a real trainer does when the loss blows up."""

    async def train(self, model: Any, trajectory_groups: Any, **kwargs: Any) -> art.TrainResult:
        report_gradient_step({"loss/train": math.nan, "grad_norm": math.inf, "step": 1})
        result = await super().train(model, trajectory_groups, **kwargs)
        result.metrics |= {"loss/train": math.nan, "grad_norm": -math.inf}
        return result


class UnwritableProgressBackend(DryRunBackend):
    """Reports a gradient step whose metrics cannot be stored, then trains on for long."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.stopped = asyncio.Event()

    async def train(self, model: Any, trajectory_groups: Any, **kwargs: Any) -> art.TrainResult:
        report_gradient_step({"loss/train": object(), "step": 1})
        try:
            await asyncio.sleep(60)
        finally:
            self.stopped.set()
        return await super().train(model, trajectory_groups, **kwargs)


async def wait_final(client: httpx.AsyncClient, job_id: str, timeout: float = PATIENCE) -> dict:
    """Poll a job until it is final (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        job = (await client.get(f"/v1/training-jobs/{job_id}")).json()
        if job["status"] in FINAL:
            return job
        assert loop.time() < deadline, f"job {job_id} still {job['status']}"
        await asyncio.sleep(0.05)


async def wait_status(
    client: httpx.AsyncClient, job_id: str, status: str, timeout: float = PATIENCE
) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        job = (await client.get(f"/v1/training-jobs/{job_id}")).json()
        if job["status"] == status:
            return job
        assert loop.time() < deadline, f"job {job_id} is {job['status']}, not {status}"
        await asyncio.sleep(0.05)


class LostReplyBackend(DryRunBackend):
    """Applies the step, then the reply is lost: the caller sees a connection reset."""

    async def train(self, model: Any, trajectory_groups: Any, **kwargs: Any) -> art.TrainResult:
        await super().train(model, trajectory_groups, **kwargs)
        raise ConnectionResetError(104, "Connection reset by peer")
