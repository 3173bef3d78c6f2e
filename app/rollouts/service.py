"""Rollout jobs: accept, show, and hand out what they built as a NAT TrajectoryCollection."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from app.backends import SPECS
from app.db import begin_write, json_dumps
from app.egress import EgressPolicy
from app.errors import ConflictError, InvalidInputError, field_errors, format_path
from app.ingest import jsontext
from app.jobs.exclusive import ensure_no_run
from app.jobs.lifecycle import JobKind, NewJob
from app.jobs.payloads import decompress
from app.jobs.service import JobView, enqueue_once, job_fields, replay
from app.jobs.store import new_job
from app.jobs.usage import Pricing
from app.models import JobRow, ModelRow
from app.rollouts import spec
from app.schemas.common import FieldError
from app.schemas.jobs import TrainingJobCreate
from app.schemas.rollouts import (
    RolloutJob,
    RolloutJobCreate,
    RolloutSummary,
    duplicate_ids,
    missing_expected,
    refused_destinations,
)
from app.schemas.trajectories import ArtTrajectoryGroup, TrajectoryCollection
from app.settings import Settings
from app.training import spec as training_spec
from app.training.service import check_trajectories, hyperparameters_of
from app.trajectories import groups_to_collection


@dataclass(frozen=True)
class Prepared:
    """What a rollout job keeps of its request, read and checked off the event loop."""

    body: RolloutJobCreate  # without its examples (`examples` is empty): see below
    num_examples: int
    examples: bytes  # the examples as the spec stores them (JSON, UTF-8)
    errors: list[dict[str, Any]]  # examples without the answer their grader needs
    request_hash: str


def prepare(body: RolloutJobCreate, raw: bytes, settings: Settings) -> Prepared:
    """Check the examples and encode them (in a thread for a large body)."""
    return Prepared(
        body=body.model_copy(update={"examples": []}),
        num_examples=len(body.examples),
        examples=spec.examples_json(body.examples),
        errors=missing_expected(body) + duplicate_ids(body.examples, what="a job's examples"),
        request_hash=hashlib.sha256(raw).hexdigest(),
    )


def limits(data: Any, settings: Settings) -> list[FieldError]:
    """Messages per example and tools, in a parsed request (not yet validated), within
    TRAINYARD_MAX_ITEMS_PER_TRAJECTORY: each becomes the start of a trajectory."""
    limit = settings.max_items_per_trajectory
    if not isinstance(data, dict):
        return []
    lists: list[tuple[tuple[str | int, ...], Any]] = []
    examples = data.get("examples")
    for i, example in enumerate(examples if isinstance(examples, list) else []):
        if isinstance(example, dict):
            lists.append((("examples", i, "messages"), example.get("messages")))
    sampling = data.get("sampling")
    if isinstance(sampling, dict):
        lists.append((("sampling", "tools"), sampling.get("tools")))
    return [
        FieldError(
            location="body",
            path=format_path(loc),
            message=f"{len(value)} items; at most {limit} (TRAINYARD_MAX_ITEMS_PER_TRAJECTORY)",
            type="too_many_items",
        )
        for loc, value in lists
        if isinstance(value, list) and len(value) > limit
    ][:100]


async def create_rollout_job(
    session: AsyncSession,
    *,
    job: Prepared,
    max_attempts: int,
    idempotency_key: str | None = None,
    egress: EgressPolicy | None = None,
    project_id: str | None = None,
    key_id: str | None = None,
) -> tuple[JobRow, bool]:
    """Store a prepared rollout job; (job, replayed). `egress`: the policy its agent or
    webhook URL must pass (as far as it can be judged before the call: an address literal,
    a denied name). A request repeated with its Idempotency-Key gets the job it made."""
    if idempotency_key is not None:
        earlier = await replay(session, idempotency_key, job.request_hash)
        if earlier is not None:
            return earlier, True
    body = job.body
    errors = list(job.errors)
    if egress is not None:
        errors += refused_destinations(body.agent, body.grader, egress)
    # Read the model first, and end that read: the spec is encoded before the write.
    model = await session.get(ModelRow, body.model)
    if model is not None and project_id is not None and model.project_id != project_id:
        model = None  # another project's: as if there were none
    backend = model.backend if model is not None else None
    await session.rollback()
    train_hyperparameters: dict[str, Any] = {}
    if backend is None:
        errors.insert(0, {"loc": ("model",), "msg": "no such model", "type": "unknown_model"})
    else:
        if not SPECS[backend].serves:
            errors.insert(
                0,
                {
                    "loc": ("model",),
                    "type": "not_served",
                    "msg": f"backend {backend!r} serves no model to sample",
                },
            )
        if body.train is not None:
            train_hyperparameters, bad = hyperparameters_of(
                backend,
                body.train.hyperparameters,
                loc=("train", "hyperparameters"),
            )
            errors += bad
    if errors:
        raise InvalidInputError(
            f"{len(errors)} problem(s) in the request; nothing was stored",
            errors=field_errors(errors),
        )
    summary = RolloutSummary(
        num_examples=job.num_examples,
        num_generations=body.num_generations,
        num_samples=job.num_examples * body.num_generations,
    )
    recipe = spec.RolloutSpec.of(body)
    if recipe.train is not None:  # stored normalized, as the training job will hold them
        train = recipe.train.model_copy(update={"hyperparameters": train_hyperparameters})
        recipe = recipe.model_copy(update={"train": train})
    if len(job.examples) > _THREAD_BYTES:
        payload = await asyncio.to_thread(spec.encode, recipe, job.examples)
    else:
        payload = spec.encode(recipe, job.examples)
    await begin_write(session)
    if recipe.train is not None:
        await ensure_no_run(session, body.model, what="a rollout job that trains")
    new = new_job(
        JobKind.rollout,
        model=body.model,
        payload=payload,
        hyperparameters=train_hyperparameters,
        metadata=body.metadata,
        summary=summary.model_dump(),
        request_hash=job.request_hash,
        max_attempts=max_attempts,
        idempotency_key=idempotency_key,
    )
    return await enqueue_once(session, new, idempotency_key, key_id)


# Specs above this are compressed in a thread, so the event loop keeps serving.
_THREAD_BYTES = 1 << 20


def training_child(
    model: str,
    groups: list[dict[str, Any]],
    hyperparameters: dict[str, Any],
    *,
    parent: str,
    max_attempts: int,
    policy_step: int,
    max_steps_off_policy: int | None,
    job_id: str | None = None,
    labels: dict[str, Any] | None = None,
) -> NewJob:
    """The training job a rollout enqueues with what it built, checked like a POST.
    Tagged with the step the rollout sampled. Raises ValueError if the groups cannot be
    trained on."""
    metadata = {**(labels or {}), "rollout_job": parent}
    body = TrainingJobCreate.model_validate_json(
        json_dumps({"model": model, "groups": groups, "hyperparameters": hyperparameters})
    )
    summary, errors = check_trajectories(body)
    if errors:
        raise ValueError(f"the rollout built untrainable groups: {errors[:3]}")
    payload = training_spec.encode(groups)
    return new_job(
        JobKind.training,
        job_id=job_id,
        model=model,
        payload=payload,
        hyperparameters=hyperparameters,
        metadata=metadata,
        summary=summary.model_dump(),
        request_hash=hashlib.sha256(payload.data).hexdigest(),
        max_attempts=max_attempts,
        policy_step=policy_step,
        max_steps_off_policy=max_steps_off_policy,
        queued_event={"after": parent},
    )


def load_output(job: JobRow) -> list[ArtTrajectoryGroup]:
    if job.output is None or job.output_bytes is None:
        raise ConflictError(
            f"rollout job {job.id} is {job.status}; its trajectories are ready "
            "when it has succeeded"
        )
    raw = decompress(job.output, job.output_bytes)
    return [ArtTrajectoryGroup.model_validate(g) for g in jsontext.load_stored(raw)]


def to_collection(job: JobRow) -> TrajectoryCollection:
    """The built groups as NeMo Agent Toolkit's TrajectoryCollection (run_id: the job id)."""
    return groups_to_collection(load_output(job), run_id=job.id)


def to_wire(job: JobView, pricing: Pricing) -> RolloutJob:
    return RolloutJob(
        **job_fields(job, pricing),
        summary=RolloutSummary.model_validate({**job.summary, **(job.metrics or {})}),
        training_job_id=job.next_job_id,
    )
