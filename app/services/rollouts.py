"""Rollout jobs: accept, read, and hand out what they built as a NAT TrajectoryCollection."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import zstandard
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

from app.backends import SPECS
from app.db import begin_write, utcnow
from app.errors import ConflictError, InvalidInputError, field_errors
from app.models import JobKind, JobRow, JobStatus, ModelRow
from app.schemas.jobs import TrainingJobCreate
from app.schemas.rollouts import RolloutJob, RolloutJobCreate, RolloutSummary, missing_expected
from app.schemas.trajectories import ArtTrajectoryGroup, TrajectoryCollection
from app.services.events import add_events
from app.services.jobs import (
    PAYLOAD_FORMAT,
    _check_trajectories,
    _compressor,
    job_fields,
    new_job_id,
)

ROLLOUT_FORMAT = "rollout-job-create+json;zstd"


async def create_rollout_job(
    session: AsyncSession, *, body: RolloutJobCreate, raw: bytes, max_attempts: int
) -> JobRow:
    errors = missing_expected(body)
    await begin_write(session)
    model = await session.get(ModelRow, body.model)
    if model is None:
        errors.insert(0, {"loc": ("model",), "msg": "no such model", "type": "unknown_model"})
    else:
        spec = SPECS[model.backend]
        if not spec.serves:
            errors.insert(
                0,
                {
                    "loc": ("model",),
                    "type": "not_served",
                    "msg": f"backend {model.backend!r} serves no model to sample",
                },
            )
        if body.train is not None:
            try:
                spec.hyperparameters.model_validate(body.train.hyperparameters)
            except ValidationError as exc:
                errors += [
                    {**e, "loc": ("train", "hyperparameters", *e["loc"])} for e in exc.errors()
                ]
    if errors:
        raise InvalidInputError(
            f"{len(errors)} problem(s) in the request; nothing was stored",
            errors=field_errors(errors),
        )
    summary = RolloutSummary(
        num_examples=len(body.examples),
        num_generations=body.num_generations,
        num_samples=len(body.examples) * body.num_generations,
    )
    job = JobRow(
        id=new_job_id(),
        kind=JobKind.rollout.value,
        model_name=body.model,
        status=JobStatus.queued.value,
        payload=_compressor.compress(raw),
        payload_format=ROLLOUT_FORMAT,
        payload_bytes=len(raw),
        hyperparameters=body.train.hyperparameters if body.train else {},
        meta=body.metadata,
        summary=summary.model_dump(),
        request_hash=hashlib.sha256(raw).hexdigest(),
        attempts=0,
        max_attempts=max_attempts,
        not_before=utcnow(),
        last_event_seq=1,  # its first event, job_queued
    )
    session.add(job)
    await session.flush()
    await add_events(session, job.id, 1, [("job_queued", {"summary": job.summary})])
    return job


def training_job_values(
    model: str,
    groups: list[dict[str, Any]],
    hyperparameters: dict[str, Any],
    *,
    parent: str,
    max_attempts: int,
) -> dict[str, Any]:
    """The training job a rollout enqueues with what it built, checked like a POST."""
    raw = json.dumps(
        {
            "model": model,
            "groups": groups,
            "hyperparameters": hyperparameters,
            "metadata": {"rollout_job": parent},
        }
    ).encode()
    body = TrainingJobCreate.model_validate_json(raw)
    summary, errors = _check_trajectories(body)
    if errors:
        raise ValueError(f"the rollout built untrainable groups: {errors[:3]}")
    now = utcnow()
    return {
        "id": new_job_id(),
        "kind": JobKind.training.value,
        "model_name": model,
        "status": JobStatus.queued.value,
        "payload": _compressor.compress(raw),
        "payload_format": PAYLOAD_FORMAT,
        "payload_bytes": len(raw),
        "hyperparameters": hyperparameters,
        "metadata": {"rollout_job": parent},
        "summary": summary.model_dump(),
        "request_hash": hashlib.sha256(raw).hexdigest(),
        "attempts": 0,
        "max_attempts": max_attempts,
        "not_before": now,
        "created_at": now,
        "updated_at": now,
        "progress_step": 0,
        "cancel_requested": False,
        "recovered": False,
    }


def load_output(job: JobRow) -> list[ArtTrajectoryGroup]:
    if job.output is None or job.output_bytes is None:
        raise ConflictError(
            f"rollout job {job.id} is {job.status}; its trajectories are ready "
            "when it has succeeded"
        )
    raw = zstandard.ZstdDecompressor().decompress(job.output, max_output_size=job.output_bytes)
    return [ArtTrajectoryGroup.model_validate(g) for g in json.loads(raw)]


def to_collection(job: JobRow) -> TrajectoryCollection:
    """The built groups as NeMo Agent Toolkit's TrajectoryCollection (run_id: the job id)."""
    groups = []
    for group in load_output(job):
        trajectories = []
        for trajectory in group.trajectories:
            episode = []
            for item in trajectory.messages_and_choices:
                if "finish_reason" in item and "message" in item:  # a sampled Choice
                    message = item["message"]
                    # NAT keeps a turn's finish reason and tool calls in its metadata.
                    metadata = {"finish_reason": item["finish_reason"]}
                    if message.get("tool_calls"):
                        metadata["tool_calls"] = message["tool_calls"]
                    episode.append(
                        {
                            "role": "assistant",
                            "content": _text(message.get("content")),
                            "logprobs": item.get("logprobs"),
                            "metadata": metadata,
                        }
                    )
                else:
                    content = item.get("content")
                    # Content that is not plain text (OpenAI content parts) stays whole in
                    # the metadata; the item's content is its text.
                    extra = {
                        k: v
                        for k, v in item.items()
                        if k != "role" and (k != "content" or not isinstance(v, str | None))
                    }
                    role = {"developer": "system"}.get(item["role"], item["role"])
                    episode.append(
                        {
                            "role": role,
                            "content": _text(content),
                            "logprobs": None,
                            "metadata": extra or None,
                        }
                    )
            trajectories.append(
                {
                    "episode": episode,
                    "reward": trajectory.reward,
                    "shaped_rewards": None,
                    "metadata": dict(trajectory.metadata),
                }
            )
        groups.append(trajectories)
    return TrajectoryCollection.model_validate({"trajectories": groups, "run_id": job.id})


def _text(content: Any) -> str:
    """An OpenAI message's content as NAT's text: a string as it is; of a list of content
    parts, the text parts, one per line; anything else as JSON."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return json.dumps(content)


def to_wire(job: JobRow) -> RolloutJob:
    return RolloutJob(
        **job_fields(job),
        summary=RolloutSummary.model_validate({**job.summary, **(job.metrics or {})}),
        training_job_id=job.next_job_id,
    )
