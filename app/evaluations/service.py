"""Evaluation jobs: accept (the model resolved to a step, a dataset's split copied in),
check, show."""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app.backends import SPECS, Backends
from app.checkpoints.service import resolve_alias
from app.datasets import decode_splits
from app.db import begin_write
from app.egress import EgressPolicy
from app.errors import InvalidInputError, NotFoundError, field_errors
from app.evaluations import spec
from app.gateway import LATEST, MAX_STEP
from app.jobs.lifecycle import JobKind
from app.jobs.service import JobView, enqueue_once, job_fields, replay
from app.jobs.store import new_job
from app.jobs.usage import Pricing
from app.models import DatasetRow, JobRow, ModelRow
from app.schemas.checkpoints import ALIAS_PATTERN
from app.schemas.evaluations import EvaluationJob, EvaluationJobCreate, EvaluationSummary
from app.schemas.graders import NEEDS_EXPECTED
from app.schemas.rollouts import Example, duplicate_ids, refused_destinations
from app.settings import Settings

# Examples above this many bytes are hashed, copied and compressed in a thread.
_THREAD_BYTES = 1 << 20


@dataclass(frozen=True)
class Prepared:
    """What an evaluation keeps of its request, read and checked off the event loop."""

    body: EvaluationJobCreate  # without its inline examples
    examples: list[Example] | None
    request_hash: str


def prepare(body: EvaluationJobCreate, raw: bytes, settings: Settings) -> Prepared:
    return Prepared(
        body=body.model_copy(update={"examples": None}),
        examples=body.examples,
        request_hash=hashlib.sha256(raw).hexdigest(),
    )


def _problem(loc: tuple[Any, ...], msg: str, kind: str) -> dict[str, Any]:
    return {"loc": loc, "msg": msg, "type": kind}


async def _step(
    session: AsyncSession, backends: Backends, requested: str, project_id: str | None
) -> tuple[ModelRow, int]:
    """The model and the step `name`, `name@N`, `name@latest` or `name@alias` names now;
    404 naming `model` for an unknown model (another project's, with `project_id`), step or
    alias; 422 for a model whose backend cannot sample."""
    name, at, selector = requested.partition("@")
    row = await session.get(ModelRow, name) if name else None
    if row is not None and project_id is not None and row.project_id != project_id:
        row = None  # another project's: as if there were none
    if row is None:
        raise NotFoundError(
            f"no model {name!r}",
            errors=field_errors([_problem(("model",), "no such model", "unknown_model")]),
        )
    if not SPECS[row.backend].serves:
        raise InvalidInputError(
            f"model {name!r} is on backend {row.backend!r}, which cannot sample: nothing "
            "to evaluate",
            errors=field_errors(
                [
                    _problem(
                        ("model",),
                        f"backend {row.backend!r} serves no model to sample",
                        "not_served",
                    )
                ]
            ),
        )
    if not at or selector == LATEST:
        return row, row.current_step
    if selector.isdigit() and selector.isascii() and int(selector) <= MAX_STEP:
        step = int(selector)
        if step > row.current_step:
            msg = f"no step {step}: {name!r} is at step {row.current_step}"
            raise NotFoundError(
                msg, errors=field_errors([_problem(("model",), msg, "unknown_step")])
            )
        return row, step
    aliased = None
    if re.fullmatch(ALIAS_PATTERN, selector):
        aliased = await resolve_alias(session, backends, row, selector)
    if aliased is None:
        msg = f"{name!r} has no alias {selector!r}; after `@` give a step, `latest` or an alias"
        raise NotFoundError(msg, errors=field_errors([_problem(("model",), msg, "unknown_alias")]))
    return row, aliased


async def _examples(
    session: AsyncSession, job: Prepared, project_id: str | None
) -> tuple[list[Example], DatasetRow | None]:
    body = job.body
    if job.examples is not None:
        return job.examples, None
    ref = body.dataset
    assert ref is not None
    query = select(DatasetRow)
    if ref.id is not None:
        query = query.where(DatasetRow.id == ref.id)
        loc: tuple[str, ...] = ("dataset", "id")
    else:
        query = query.where(DatasetRow.name == ref.name).order_by(DatasetRow.id.desc()).limit(1)
        loc = ("dataset", "name")
    if project_id is not None:
        query = query.where(DatasetRow.project_id == project_id)
    row = await session.scalar(query)
    if row is None:
        raise NotFoundError(
            "no such dataset",
            errors=field_errors([_problem(loc, "no such dataset", "unknown_dataset")]),
        )
    await session.refresh(row, ["payload"])
    splits = await decode_splits(row.payload, row.payload_bytes)
    stored = splits.get(ref.split) or []
    if not stored:
        have = ", ".join(sorted(splits)) or "none"
        msg = f"no examples in split {ref.split!r} (splits: {have})"
        raise InvalidInputError(
            msg, errors=field_errors([_problem(("dataset", "split"), msg, "missing_split")])
        )
    examples = [
        Example.model_construct(
            id=e["id"],
            messages=e["messages"],
            expected=e.get("expected"),
            metadata=e.get("metadata") or {},
        )
        for e in stored
    ]
    return examples, row


def _missing_expected(body: EvaluationJobCreate, examples: list[Example]) -> list[dict[str, Any]]:
    if body.grader.type not in NEEDS_EXPECTED:
        return []
    at = ("examples",) if body.dataset is None else ("dataset", "split")
    msg = f"the {body.grader.type} grader needs `expected`"
    lacking = [i for i, e in enumerate(examples) if e.expected is None]
    if body.dataset is not None:
        return (
            [_problem(at, f"{len(lacking)} examples lack it: {msg}", "missing")] if lacking else []
        )
    return [_problem((*at, i, "expected"), msg, "missing") for i in lacking[:100]]


async def create_evaluation_job(
    session: AsyncSession,
    backends: Backends,
    *,
    job: Prepared,
    max_attempts: int,
    idempotency_key: str | None = None,
    project_id: str | None = None,
    key_id: str | None = None,
    egress: EgressPolicy | None = None,
) -> tuple[JobRow, bool]:
    """Store an evaluation job; (job, replayed). The model's step is resolved now. With
    `project_id` (a key that is not admin), only that project's models and datasets.
    `egress`: the policy a webhook grader's URL must pass, as far as it can be judged
    before the call (an address literal, a denied name), as a rollout's."""
    if idempotency_key is not None:
        earlier = await replay(session, idempotency_key, job.request_hash)
        if earlier is not None:
            return earlier, True
    body = job.body
    model, step = await _step(session, backends, body.model, project_id)
    model_name = model.name
    examples, dataset = await _examples(session, job, project_id)
    dataset_id = dataset.id if dataset is not None else None
    await session.rollback()  # end the reads: the spec is encoded before the write
    errors = _missing_expected(body, examples)
    errors += duplicate_ids(job.examples or (), what="a job's examples")
    if egress is not None:
        errors += refused_destinations(None, body.grader, egress)
    if errors:
        raise InvalidInputError(
            f"{len(errors)} problem(s) in the request; nothing was stored",
            errors=field_errors(errors),
        )
    recipe = spec.EvaluationSpec.model_construct(
        step=step,
        examples=[],
        samples_per_example=body.samples_per_example,
        sampling=body.sampling,
        grader=body.grader,
        concurrency=body.concurrency,
    )

    def encode() -> tuple[Any, str]:
        raw = spec.examples_json(examples)
        return spec.encode(recipe, raw), hashlib.sha256(raw).hexdigest()

    if len(examples) > 1000:
        payload, digest = await asyncio.to_thread(encode)
    else:
        payload, digest = encode()
    summary = EvaluationSummary(
        model=body.model,
        step=step,
        dataset_id=dataset_id,
        split=body.dataset.split if body.dataset is not None else None,
        examples_sha256=digest,
        num_examples=len(examples),
        samples_per_example=body.samples_per_example,
        num_samples=len(examples) * body.samples_per_example,
    )
    await begin_write(session)
    new = new_job(
        JobKind.evaluation,
        model=model_name,
        payload=payload,
        hyperparameters={},
        metadata=body.metadata,
        summary=summary.model_dump(exclude_none=True),
        request_hash=job.request_hash,
        max_attempts=max_attempts,
        idempotency_key=idempotency_key,
        queued_event={"step": step},
    )
    return await enqueue_once(session, new, idempotency_key, key_id)


def to_wire(job: JobView, pricing: Pricing) -> EvaluationJob:
    return EvaluationJob(
        **job_fields(job, pricing),
        summary=EvaluationSummary.model_validate({**job.summary, **(job.metrics or {})}),
    )
