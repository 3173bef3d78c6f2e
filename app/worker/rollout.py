"""Run one claimed rollout job: sample (or call the agent), grade, group per example, and
optionally enqueue a training job with the groups, in the same final write.

Sampling and grading failures of single answers are recorded and skipped; the job fails
only when the model's endpoint itself stays unreachable, or nothing at all came back.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import zstandard
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.backends import Backends
from app.backends.base import BackendError, Inference, classify
from app.models import JobStatus
from app.rollouts.graders import grade
from app.rollouts.sampling import SamplingClient, SamplingError
from app.schemas.rollouts import Example, RolloutJobCreate
from app.schemas.trajectories import ArtTrajectory, NatTrajectory, TrajectoryCollection
from app.services.jobs import _compressor
from app.services.rollouts import training_job_values
from app.settings import Settings
from app.trajectories import collection_to_art
from app.worker import queue
from app.worker.queue import Claim
from app.worker.training import Progress, failed, supervise

log = logging.getLogger(__name__)
MAX_ERRORS_KEPT = 20


@dataclass
class Collected:
    groups: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    num_errors: int = 0
    untrainable: list[str | int] = field(default_factory=list)

    def error(self, message: str) -> None:
        self.num_errors += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(message)

    def stats(self) -> dict[str, Any]:
        mean = sum(self.rewards) / len(self.rewards) if self.rewards else None
        return {
            "num_graded": len(self.rewards),
            "num_errors": self.num_errors,
            "mean_reward": mean,
            "untrainable_groups": self.untrainable,
            "errors": self.errors,
        }


async def run_rollout(
    claim: Claim,
    *,
    engine: AsyncEngine,
    backends: Backends,
    settings: Settings,
    signal: Callable[[], None] = lambda: None,
) -> None:
    lease = claim.lease
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            claim.payload, max_output_size=claim.payload_bytes
        )
        body = RolloutJobCreate.model_validate_json(raw)
        adapter = backends.get(claim.backend)
        inference = await adapter.inference(claim.model)
        api_key = (await adapter.model(claim.model)).inference_api_key
        if not inference.base_url:
            raise BackendError(f"backend {claim.backend!r} serves no endpoint", transient=False)
    except Exception as exc:
        await failed(engine, claim, classify(exc), settings)
        signal()
        return
    total = len(body.examples) * body.num_generations
    if not await queue.record_start(
        engine,
        lease,
        start_step=inference.step,
        data={"model": inference.model_name, "samples": total},
    ):
        return
    signal()
    progress = Progress(event="rollout_progress", coalesce=True)
    work = asyncio.create_task(
        _collect(body, inference, api_key, progress), name=f"rollout:{lease.job_id}"
    )
    try:
        outcome = await supervise(work, lease, progress, engine, settings, signal)
    except SamplingError as exc:
        await failed(
            engine,
            claim,
            BackendError(str(exc), transient=exc.transient),
            settings,
            progress.take(),
        )
        signal()
        return
    finally:
        if not work.done():
            work.cancel()
    if outcome == "lost":
        return
    if outcome == "cancelled":
        await queue.finish(
            engine,
            lease,
            status=JobStatus.cancelled,
            event="job_cancelled",
            data={"while": "running", "samples": progress.step},
            earlier_events=progress.take(),
        )
        signal()
        return
    await _finish(engine, claim, body, work.result(), progress, settings)
    signal()


async def _finish(
    engine: AsyncEngine,
    claim: Claim,
    body: RolloutJobCreate,
    collected: Collected,
    progress: Progress,
    settings: Settings,
) -> None:
    lease = claim.lease
    stats = collected.stats()
    if not collected.groups:
        error = {
            "type": "NothingCollected",
            "transient": False,
            "message": "no answer could be sampled and graded: " + "; ".join(collected.errors[:3]),
        }
        await queue.finish(
            engine,
            lease,
            status=JobStatus.failed,
            event="rollout_failed",
            data={"error": error, **stats},
            error=error,
            metrics=stats,
            earlier_events=progress.take(),
        )
        return
    new_job = None
    if body.train is not None:
        new_job = training_job_values(
            claim.model.name,
            collected.groups,
            body.train.hyperparameters,
            parent=lease.job_id,
            max_attempts=settings.max_attempts,
        )
    output = json.dumps(collected.groups).encode()
    await queue.finish(
        engine,
        lease,
        status=JobStatus.succeeded,
        event="rollout_ended",
        data={
            **stats,
            "groups": len(collected.groups),
            "training_job_id": new_job["id"] if new_job else None,
        },
        earlier_events=progress.take(),
        output=_compressor.compress(output),
        output_bytes=len(output),
        metrics=stats,
        next_job_id=new_job["id"] if new_job else None,
        new_job=new_job,
        progress_step=progress.step,
        progress_total=progress.total,
        error=None,
    )


async def _collect(
    body: RolloutJobCreate, inference: Inference, api_key: str | None, progress: Progress
) -> Collected:
    collected = Collected()
    total = len(body.examples) * body.num_generations
    done = 0

    def advance(count: int) -> None:
        nonlocal done
        done += count
        mean = sum(collected.rewards) / len(collected.rewards) if collected.rewards else 0.0
        progress(done, total, {"mean_reward": mean, "errors": collected.num_errors})

    async with httpx.AsyncClient(timeout=60) as http:
        if body.agent is not None:
            agent_calls = asyncio.Semaphore(body.concurrency)
            results = await asyncio.gather(
                *(
                    _agent_example(
                        body, example, inference, api_key, http, agent_calls, collected, advance
                    )
                    for example in body.examples
                )
            )
        else:
            grading = asyncio.Semaphore(body.concurrency)  # webhook graders are services too
            async with SamplingClient(
                inference.base_url or "", api_key, concurrency=body.concurrency, timeout=600
            ) as sampler:
                results = await asyncio.gather(
                    *(
                        _sample_example(
                            body, example, inference, sampler, http, grading, collected, advance
                        )
                        for example in body.examples
                    )
                )
    for example, trajectories in zip(body.examples, results, strict=True):
        if not trajectories:
            continue
        if len({t["reward"] for t in trajectories}) < 2:
            collected.untrainable.append(example.id)
        collected.groups.append(
            {"trajectories": trajectories, "metadata": {"example_id": str(example.id)}}
        )
    return collected


async def _sample_example(
    body: RolloutJobCreate,
    example: Example,
    inference: Inference,
    sampler: SamplingClient,
    http: httpx.AsyncClient,
    grading: asyncio.Semaphore,
    collected: Collected,
    advance: Callable[[int], None],
) -> list[dict[str, Any]]:
    request: dict[str, Any] = {
        "model": inference.model_name,
        "messages": example.messages,
        "n": body.num_generations,
        "logprobs": True,
        **body.sampling.model_dump(exclude_none=True),
    }
    try:
        response = await sampler.chat(request)
    except SamplingError as exc:
        if exc.transient:
            raise  # the endpoint is away: retry the whole job later
        collected.error(f"example {example.id}: {exc}")
        advance(body.num_generations)
        return []
    assert body.grader is not None
    example_json = example.model_dump(mode="json")
    trajectories = []
    for generation, choice in enumerate(response.get("choices", [])):
        answer = (choice.get("message") or {}).get("content") or ""
        async with grading:
            result = await grade(
                body.grader,
                example=example_json,
                answer=answer,
                generation=generation,
                client=http,
            )
        if result.reward is None:
            collected.error(f"example {example.id} generation {generation}: {result.error}")
        else:
            collected.rewards.append(result.reward)
            metadata: dict[str, Any] = {"example_id": str(example.id), "generation": generation}
            if result.reasoning:
                metadata["reasoning"] = result.reasoning[:2000]
            trajectories.append(
                {
                    "messages_and_choices": [*example.messages, choice],
                    "tools": body.sampling.tools,
                    "reward": result.reward,
                    "metadata": metadata,
                }
            )
        advance(1)
    return trajectories


async def _agent_example(
    body: RolloutJobCreate,
    example: Example,
    inference: Inference,
    api_key: str | None,
    http: httpx.AsyncClient,
    calls: asyncio.Semaphore,
    collected: Collected,
    advance: Callable[[int], None],
) -> list[dict[str, Any]]:
    assert body.agent is not None
    agent = body.agent
    model = {"base_url": inference.base_url, "api_key": api_key, "name": inference.model_name}

    async def one(generation: int) -> dict[str, Any] | None:
        payload = {
            "example": example.model_dump(mode="json"),
            "generation": generation,
            "model": model,
        }
        try:
            async with calls:
                response = await http.post(
                    str(agent.url), json=payload, headers=agent.headers, timeout=agent.timeout_s
                )
            response.raise_for_status()
            return _agent_trajectory(response.json(), example, generation)
        except (httpx.HTTPError, ValueError, ValidationError) as exc:
            collected.error(f"example {example.id} generation {generation}: agent: {exc}")
            return None
        finally:
            advance(1)

    results = await asyncio.gather(*(one(g) for g in range(body.num_generations)))
    trajectories = [t for t in results if t is not None]
    collected.rewards += [t["reward"] for t in trajectories]
    return trajectories


def _agent_trajectory(answer: Any, example: Example, generation: int) -> dict[str, Any]:
    """An agent's {trajectory: NAT or ART, reward?} as one ART-style trajectory dict."""
    if not isinstance(answer, dict) or not isinstance(answer.get("trajectory"), dict):
        raise ValueError('the agent must answer {"trajectory": {...}, "reward": number}')
    raw = answer["trajectory"]
    reward = answer.get("reward", raw.get("reward"))
    if "episode" in raw:
        nat = NatTrajectory.model_validate({**raw, "reward": reward})
        collection = TrajectoryCollection(trajectories=[[nat]], run_id="agent")
        (group,) = collection_to_art(collection)
        trajectory = group.trajectories[0].model_dump(mode="json")
        art = ArtTrajectory.model_validate({**trajectory, "metadata": {}})
    else:
        art = ArtTrajectory.model_validate({**raw, "reward": reward})
    data = art.model_dump(mode="json")
    data["metadata"] = {
        **data.get("metadata", {}),
        "example_id": str(example.id),
        "generation": generation,
    }
    return data
