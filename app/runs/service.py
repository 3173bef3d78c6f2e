"""Training runs: accept, show, pause, resume, cancel, and their curves (`run_metrics`).

A run is a `jobs` row of kind `run` with its schedule's state in `runs`; the driver
(`app.runs.driver`) advances it between its child jobs. Everything here is a short
transaction of the API.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

from pydantic import BaseModel
from sqlalchemy import Executable, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.backends import SPECS
from app.datasets import decode_splits, get_dataset
from app.db import Reader, begin_write, utcnow
from app.egress import EgressPolicy
from app.errors import ConflictError, InvalidInputError, field_errors
from app.jobs.exclusive import ensure_model_free
from app.jobs.lifecycle import JobKind, JobStatus, RunTransitionError, plan_pause, run_status
from app.jobs.payloads import Payload
from app.jobs.runs import apply_pause
from app.jobs.service import enqueue_once, get_job, missing_job, replay
from app.jobs.store import new_job
from app.jobs.usage import Pricing
from app.models import JobRow, ModelRow, RunMetricRow, RunRow
from app.runs import spec
from app.runs import usage as run_usage
from app.runs.schedule import initial_state, waiting_id
from app.runs.state import decode as decode_state
from app.schemas.graders import NEEDS_EXPECTED
from app.schemas.jobs import JobError
from app.schemas.rollouts import duplicate_ids, refused_destinations
from app.schemas.runs import (
    BestCheckpoint,
    DatasetRef,
    Run,
    RunCreate,
    RunMetric,
    RunProgress,
    RunSettings,
)
from app.schemas.usage import JobCost, JobUsage
from app.settings import Settings
from app.training import methods
from app.training.service import hyperparameters_of

RUN = JobKind.run


@dataclass(frozen=True)
class Prepared:
    body: RunCreate
    request_hash: str
    size: int = 0  # the request body's bytes


def prepare(body: RunCreate, raw: bytes, settings: Settings) -> Prepared:
    return Prepared(body, hashlib.sha256(raw).hexdigest(), len(raw))


def new_run_id() -> str:
    """Time-ordered like job ids; its children's ids derive from it."""
    return f"run_{time.time_ns() // 1000:014x}{secrets.token_hex(5)}"


# Inline examples above this count, or in a body above this size, are split and encoded
# off the event loop (a few examples of many messages each are as much work as many).
THREAD_EXAMPLES = 500
THREAD_BYTES = 64 * 1024


async def _examples(
    session: AsyncSession,
    body: RunCreate,
    errors: list[dict[str, Any]],
    *,
    large: bool,
    project_id: str | None = None,
) -> tuple[dict[str, list[dict[str, Any]]], DatasetRef | None]:
    """The run's examples by split (inline or the dataset's), and the dataset reference
    with its validation split resolved. `project_id`: the dataset must be that project's."""
    if body.examples is not None:
        examples = body.examples
        if large:
            return await asyncio.to_thread(spec.split_examples, examples), None
        return spec.split_examples(examples), None
    assert body.dataset is not None
    ref = body.dataset
    try:
        row = await get_dataset(session, ref.id, project_id)
    except Exception:
        errors.append(
            {"loc": ("dataset", "id"), "msg": "no such dataset", "type": "unknown_dataset"}
        )
        return {}, ref
    await session.refresh(row, ["payload"])
    splits = await decode_splits(row.payload, row.payload_bytes)
    if ref.validation_split is None and body.validation is not None:
        ref = ref.model_copy(update={"validation_split": "validation"})
    return splits, ref


def _split_errors(
    body: RunCreate, splits: dict[str, list[dict[str, Any]]], ref: DatasetRef | None
) -> list[dict[str, Any]]:
    train = ref.train_split if ref else "train"
    validation = (ref.validation_split if ref else "validation") if body.validation else None
    at = ("dataset",) if ref else ("examples",)
    # Inline examples' ids are unique, as a dataset's are.
    errors = duplicate_ids(body.examples or (), what="a run's examples")
    for name, field in ((train, "train_split"), (validation, "validation_split")):
        if name is not None and not splits.get(name):
            loc = (*at, field) if ref else at
            have = ", ".join(sorted(splits)) or "none"
            errors.append(
                {
                    "loc": loc,
                    "msg": f"no examples in split {name!r} (splits: {have})",
                    "type": "missing_split",
                }
            )
    grader = body.recipe.grader
    if grader is None or grader.type not in NEEDS_EXPECTED:
        return errors
    msg = f"the {grader.type} grader needs it"
    used = {name for name in (train, validation) if name is not None}
    if body.examples is not None:
        for i, example in enumerate(body.examples):
            if example.split in used and example.expected is None:
                errors.append({"loc": ("examples", i, "expected"), "msg": msg, "type": "missing"})
        return errors[:100]
    for name in sorted(used):
        lacking = sum(1 for e in splits.get(name, []) if e.get("expected") is None)
        if lacking:
            errors.append(
                {
                    "loc": ("dataset", "id"),
                    "msg": f"{lacking} example(s) of split {name!r} have no `expected`: {msg}",
                    "type": "missing",
                }
            )
    return errors


def _warmup(backend: str, body: RunCreate) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The run's SFT warm-up as its spec keeps it (its keywords checked for the model's
    backend), or the errors naming `warmup`."""
    if body.warmup is None:
        return None, []
    hyperparameters, bad = hyperparameters_of(
        backend,
        body.warmup.hyperparameters,
        loc=("warmup", "hyperparameters"),
        method="sft",
        method_loc=("warmup",),
    )
    examples = [methods.example_json(e) for e in body.warmup.examples]
    return {"examples": examples, "hyperparameters": hyperparameters}, bad


@dataclass(frozen=True)
class Checked:
    """A run request that passed every check: what storing it needs, and what pricing it
    does (`app.runs.estimate`)."""

    model: ModelRow
    stored: spec.RunSpec
    train: list[dict[str, Any]]
    hyperparameters: dict[str, Any]
    num_validation: int
    dataset: Any
    large: bool


async def check_run(
    session: AsyncSession, *, job: Prepared, settings: Settings, project_id: str | None
) -> Checked:
    """Every check a run request passes before it is stored (422 naming each problem, 404
    no such model, 409 the model is busy), in the caller's write transaction."""
    body = job.body
    errors: list[dict[str, Any]] = []
    model = await session.get(ModelRow, body.model)
    if model is not None and project_id is not None and model.project_id != project_id:
        model = None  # another project's: as if there were none
    hyperparameters: dict[str, Any] = {}
    warmup = None
    if model is None:
        errors.append({"loc": ("model",), "msg": "no such model", "type": "unknown_model"})
    elif not SPECS[model.backend].serves:
        msg = f"backend {model.backend!r} serves no model to sample"
        errors.append({"loc": ("model",), "msg": msg, "type": "not_served"})
    else:
        hyperparameters, bad = hyperparameters_of(model.backend, body.hyperparameters)
        errors += bad
        warmup, bad = _warmup(model.backend, body)
        errors += bad
        await ensure_model_free(session, model.name)
    policy = EgressPolicy.from_settings(settings)
    errors += refused_destinations(body.recipe.agent, body.recipe.grader, policy, at=("recipe",))
    large = len(body.examples or ()) > THREAD_EXAMPLES or job.size > THREAD_BYTES
    splits, ref = await _examples(session, body, errors, large=large, project_id=project_id)
    if not errors:
        errors += _split_errors(body, splits, ref)
    if errors:
        raise InvalidInputError(
            f"{len(errors)} problem(s) in the request; nothing was stored",
            errors=field_errors(errors),
        )
    assert model is not None
    train_split = ref.train_split if ref else "train"
    validation_split = ref.validation_split if ref else "validation"
    num_validation = len(splits.get(validation_split or "", [])) if body.validation else 0
    stored = spec.RunSpec.of(
        body,
        hyperparameters=hyperparameters,
        num_train=len(splits[train_split]),
        num_validation=num_validation,
        dataset=ref,
        examples=splits if body.examples is not None else None,
        warmup=warmup,
    )
    return Checked(model, stored, splits[train_split], hyperparameters, num_validation, ref, large)


async def create_run(
    session: AsyncSession,
    *,
    job: Prepared,
    idempotency_key: str | None,
    settings: Settings,
    project_id: str | None = None,
    key_id: str | None = None,
) -> tuple[JobRow, bool]:
    """Store a run, its spec and its state (queued); (row, replayed). `project_id`: the
    model must be that project's (another's is no such model)."""
    body = job.body
    await begin_write(session)
    if idempotency_key is not None:
        earlier = await replay(session, idempotency_key, job.request_hash)
        if earlier is not None:
            return earlier, True
    checked = await check_run(session, job=job, settings=settings, project_id=project_id)
    model, stored, ref = checked.model, checked.stored, checked.dataset
    hyperparameters, num_validation = checked.hyperparameters, checked.num_validation
    if checked.large:
        payload = await asyncio.to_thread(spec.encode, stored)
    else:
        payload = spec.encode(stored)
    run_id = new_run_id()
    new = new_job(
        RUN,
        job_id=run_id,
        model=body.model,
        payload=payload,
        hyperparameters=hyperparameters,
        metadata=body.metadata,
        summary={"dataset": ref.id if ref else None, "num_train": stored.num_train},
        request_hash=job.request_hash,
        max_attempts=1,
        idempotency_key=idempotency_key,
        queued_event={"num_train": stored.num_train, "num_validation": num_validation},
    )
    row, again = await enqueue_once(session, new, idempotency_key, key_id)
    if again:
        return row, True
    session.add(
        RunRow(
            id=run_id,
            version=0,
            paused=False,
            state=initial_state(stored.plan()).encode(),
            waiting_on=None,
            # The job's project: its model's (checked above: the model exists).
            project_id=model.project_id,
        )
    )
    await session.flush()
    return row, False


async def get_run(
    session: AsyncSession, run_id: str, *, for_update: bool = False, project_id: str | None = None
) -> tuple[JobRow, RunRow]:
    """The run; with `project_id`, only if it is that project's (another's: 404)."""
    job = await get_job(session, run_id, kind=RUN, for_update=for_update, project_id=project_id)
    state = await session.get(RunRow, run_id, with_for_update=for_update or None)
    assert state is not None
    return job, state


async def read_run(
    reader: Reader, run_id: str, project_id: str | None = None
) -> tuple[JobRow, RunRow]:
    """A run as a request reads it alone (`Reader`: one trip off the event loop). With
    `project_id`: only that project's (another's: 404)."""
    row = await reader.first(
        select(JobRow, RunRow)
        .join(RunRow, RunRow.id == JobRow.id)
        .where(JobRow.id == run_id, JobRow.kind == RUN.value)
    )
    if row is None or (project_id is not None and row[0].project_id != project_id):
        raise missing_job(RUN, run_id)
    return row[0], row[1]


async def set_paused(
    session: AsyncSession, run_id: str, *, paused: bool, project_id: str | None = None
) -> tuple[JobRow, RunRow]:
    """Pause: no new child job starts (the one under way finishes). Resume: go on."""
    await begin_write(session)
    job, run = await get_run(session, run_id, for_update=True, project_id=project_id)
    current = run_status(JobStatus(job.status), run.paused)
    if current.is_final:  # as a cancel says it: `run run_x already succeeded; ...`
        verb = "paused" if paused else "resumed"
        raise ConflictError(f"run {run_id} already {current.value}; it cannot be {verb}")
    try:
        write = plan_pause(current, paused=paused, step=decode_state(run.state).step)
    except RunTransitionError as exc:
        raise ConflictError(f"run {run_id}: {exc}") from exc
    if write is not None:
        await apply_pause(session, run, write)
    return job, run


async def list_runs(
    reader: Reader,
    *,
    status: JobStatus | None,
    model: str | None,
    after: str | None,
    limit: int,
    project_id: str | None = None,
) -> tuple[list[tuple[JobRow, RunRow]], bool]:
    query = (
        select(JobRow, RunRow)
        .join(RunRow, RunRow.id == JobRow.id)
        .where(JobRow.kind == RUN.value)
        .order_by(JobRow.id.desc())
        .limit(limit + 1)
    )
    if project_id is not None:
        query = query.where(JobRow.project_id == project_id)
    if status is not None:
        query = query.where(JobRow.status == status.value)
    if model is not None:
        query = query.where(JobRow.model_name == model)
    if after:
        query = query.where(JobRow.id < after)
    rows = [(job, run) for job, run in await reader.all(query)]
    return rows[:limit], len(rows) > limit


async def metrics(
    session: AsyncSession, run_id: str, *, after: int, limit: int, kind: str | None
) -> tuple[list[RunMetric], bool]:
    await get_job(session, run_id, kind=RUN)
    query = (
        select(RunMetricRow)
        .where(RunMetricRow.run_id == run_id, RunMetricRow.seq > after)
        .order_by(RunMetricRow.seq)
        .limit(limit + 1)
    )
    if kind is not None:
        query = query.where(RunMetricRow.kind == kind)
    rows = list((await session.scalars(query)).all())
    items = [
        RunMetric(
            seq=r.seq,
            kind=r.kind,
            step=r.step,
            epoch=r.data.get("epoch"),
            data={k: v for k, v in r.data.items() if k != "epoch"},
            created_at=r.created_at,
        )
        for r in rows[:limit]
    ]
    return items, len(rows) > limit


async def run_settings(session: AsyncSession, run_id: str) -> RunSettings:
    """A run's settings from its stored spec (what the dashboard compares side by side)."""
    job, run = await get_run(session, run_id)
    await session.refresh(job, ["payload"])
    payload = Payload(job.payload_format, job.payload, job.payload_bytes)
    if payload.size > THREAD_BYTES:  # inline examples: decoded off the event loop
        stored = await asyncio.to_thread(spec.decode, payload)
    else:
        stored = spec.decode(payload)
    return RunSettings(
        dataset=_dump(stored.dataset),
        num_train=stored.num_train,
        num_validation=stored.num_validation,
        recipe=_shown(stored.recipe.model_dump(mode="json")),
        schedule=stored.schedule.model_dump(mode="json"),
        hyperparameters=stored.hyperparameters,
        learning_rate_schedule=_dump(stored.learning_rate_schedule),
        validation=_dump(stored.validation),
        checkpoints=stored.checkpoints.model_dump(mode="json"),
        early_stopping=_dump(stored.early_stopping),
        curriculum=_dump(stored.curriculum),
        max_steps_off_policy=stored.max_steps_off_policy,
        warmup=_warmup_shown(stored.warmup),
        start_step=decode_state(run.state).start_step,
    )


def _warmup_shown(warmup: dict[str, Any] | None) -> dict[str, Any] | None:
    if warmup is None:
        return None
    return {
        "hyperparameters": warmup.get("hyperparameters") or {},
        "num_examples": len(warmup.get("examples") or ()),
    }


def _dump(part: BaseModel | None) -> dict[str, Any] | None:
    return part.model_dump(mode="json") if part is not None else None


def _shown(recipe: dict[str, Any]) -> dict[str, Any]:
    """A recipe as a route may show it: a grader's or agent's `headers` are write-only
    (credentials), and a URL's query may hold a token too."""
    for part in ("grader", "agent"):
        outbound = recipe.get(part)
        if not isinstance(outbound, dict):
            continue
        outbound.pop("headers", None)
        if isinstance(outbound.get("url"), str) and "?" in outbound["url"]:
            outbound["url"] = outbound["url"].split("?", 1)[0] + "?…"
    return recipe


Read: TypeAlias = Callable[[Executable], Awaitable[Sequence[Any]]]
"""Runs a statement and returns its rows: a `Reader`'s `all`, or a session's."""


def session_read(session: AsyncSession) -> Read:
    async def read(statement: Executable) -> Sequence[Any]:
        rows: Sequence[Any] = (await session.execute(statement)).all()
        return rows

    return read


async def wired(read: Read, rows: Sequence[tuple[JobRow, RunRow]], pricing: Pricing) -> list[Run]:
    """The runs on the wire, each with its children's usage and its estimated cost."""
    if not rows:
        return []
    jobs = [job for job, _ in rows]
    used = run_usage.usage_by_run(jobs, await read(run_usage.children_query(jobs)))
    names = {job.model_name for job in jobs}
    models = {
        row.name: row
        for row in await read(
            select(ModelRow.name, ModelRow.backend, ModelRow.base_model).where(
                ModelRow.name.in_(names)
            )
        )
    }
    wire = []
    for job, run in rows:
        model = models.get(job.model_name)
        backend, base = (model.backend, model.base_model) if model else (None, None)
        cost = pricing.cost(used[job.id], backend=backend, base_model=base)
        wire.append(to_wire(job, run, used[job.id], cost))
    return wire


def to_wire(job: JobRow, run: RunRow, usage: JobUsage, cost: JobCost) -> Run:
    state = decode_state(run.state)
    status = JobStatus(job.status)
    step, total = state.step, state.total_steps
    phase: str = state.phase
    if status is JobStatus.queued:
        phase = "queued"
    elif status.is_final:
        phase = "done"
    elif run.paused:
        phase = "paused"
    best = state.best
    waiting = waiting_id(job.id, state) if not status.is_final else None
    return Run(
        id=job.id,
        model=job.model_name,
        status=status,
        paused=run.paused and not status.is_final,  # a run that ended is not paused
        progress=RunProgress(
            step=step,
            total_steps=total,
            epoch=state.epoch + 1 if job.started_at else 0,
            epochs=state.epochs,
            percent=round(100.0 * step / total, 2) if total else 0.0,
            phase=phase,
            eta_seconds=_eta(job.started_at, step, total, status),
        ),
        best_checkpoint=BestCheckpoint(**best) if best else None,
        # A run cancelled before it started never had a driver write its reason.
        stop_reason=state.stop_reason or ("cancelled" if status is JobStatus.cancelled else None),
        current_jobs=[waiting] if waiting else [],
        error=JobError.model_validate(job.error) if job.error else None,
        metadata=job.meta,
        cancel_requested=job.cancel_requested,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        usage=usage,
        cost=cost,
    )


def _eta(started: datetime | None, step: int, total: int, status: JobStatus) -> float | None:
    if started is None or step == 0 or status.is_final:
        return None
    elapsed = (utcnow() - started).total_seconds()
    return round(elapsed / step * max(0, total - step), 1)
