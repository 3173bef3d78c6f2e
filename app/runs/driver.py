"""The run driver: advances every active run from what its child jobs did.

Each worker runs it in its loop, after every wake-up (a child job ended, a run was
created, paused, resumed or cancelled) and every poll. Advancing a run is short and
touches only the database: read the run and the children its state names, `decide`
(pure, `app.runs.schedule`), then write the decision in one transaction guarded by the
run's `version`. Two drivers that decide at once cannot both write: the second matches
no row, rolls back (with any child job it inserted) and decides again from what the first
wrote. A crash between deciding and writing loses nothing but the decision, which the
next driver takes again; a child's deterministic id makes it the same job.

The slow work is the children's, claimed by workers like any job. Pruning checkpoints,
which calls the backend, runs after the write and is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, and_, bindparam, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, async_sessionmaker

from app.backends import Backends
from app.datasets import THREAD_BYTES, load_splits
from app.db import utcnow, write_connection
from app.errors import ProblemError
from app.jobs.events import append_event
from app.jobs.lifecycle import ErrorInfo, EventType, JobKind, JobStatus
from app.jobs.payloads import Payload
from app.jobs.statements import jobs
from app.jobs.store import QueueStore, enqueue, new_job
from app.models import RunMetricRow, RunRow
from app.notify import Notifier
from app.rollouts import spec as rollout_spec
from app.runs import spec as run_spec
from app.runs.schedule import Child, Create, Decision, Plan, child_id, decide, waiting_id
from app.schemas.rollouts import RolloutSummary
from app.settings import Settings

log = logging.getLogger(__name__)
runs = cast(Table, RunRow.__table__)
run_metrics = cast(Table, RunMetricRow.__table__)
ACTIVE = (JobStatus.queued.value, JobStatus.running.value)
FINAL = tuple(status.value for status in JobStatus if status.is_final)
MAX_MOVES = 8  # decisions followed in one advance (a finished child can unblock several)
_CACHED = 64


@dataclass(frozen=True)
class Loaded:
    """A run's spec and its splits' examples, read once per process (they never change)."""

    spec: run_spec.RunSpec
    plan: Plan
    train: list[dict[str, Any]]
    validation: list[dict[str, Any]]


class RunDriver:
    def __init__(
        self, *, store: QueueStore, backends: Backends, settings: Settings, notifier: Notifier
    ) -> None:
        self.store = store
        self.backends = backends
        self.settings = settings
        self.notifier = notifier
        self._loaded: OrderedDict[str, Loaded] = OrderedDict()
        self._sessions = async_sessionmaker(store.engine, expire_on_commit=False)
        self._pruning: dict[str, asyncio.Task[None]] = {}
        self._prune_again: dict[str, tuple[dict[str, Any], bool]] = {}

    async def advance_all(self) -> int:
        """Advance every run with something to do; returns how many moves were made. One
        query finds them: a run not started, asked to cancel, or whose child ended (or
        that waits on none and is not paused)."""
        async with self.store.engine.connect() as conn:
            ids = (await conn.scalars(_DUE)).all()
        moved = 0
        for run_id in ids:
            try:
                moved += await self.advance(run_id)
            except Exception:  # one run's trouble must not stop the others
                log.exception("run %s: advancing it failed; trying again later", run_id)
        return moved

    async def advance(self, run_id: str) -> int:
        moves = 0
        for _ in range(MAX_MOVES):
            moved, again = await self._move(run_id)
            moves += moved
            if not again:
                break
        return moves

    async def _move(self, run_id: str) -> tuple[bool, bool]:
        """One decision written (moved), and whether another may follow at once (again):
        the run now waits on a child that had already ended (a rollout started early), or
        another driver moved it first."""
        async with self.store.engine.connect() as conn:
            run = (await conn.execute(_RUN, {"run_id": run_id})).one()
            if JobStatus(run.status).is_final:
                return False, False
            loaded = await self._load(conn, run_id)
            state: dict[str, Any] = run.state
            children = await _children(conn, run_id, state)
        decision = decide(
            loaded.plan,
            run_id,
            state,
            children,
            paused=run.paused,
            cancel_requested=run.cancel_requested,
        )
        starting = run.status == JobStatus.queued.value
        if not decision.changed and decision.state == state and not starting:
            return False, False
        prune = decision.prune and loaded.spec.checkpoints.prune
        if prune and decision.status is not None:
            # A run that ends has pruned first: what its owner lists once it has ended is
            # what it keeps. Idempotent: redone if the write below loses to another driver.
            await self._prune_now(run.model_name, decision.state, loaded.spec.checkpoints.keep_best)
        seen = (run.status, run.cancel_requested)
        written = await self._write(
            run_id, run.model_name, run.version, seen, decision, loaded, starting
        )
        if not written:
            return False, True  # another driver moved it: decide again from its state
        if decision.create:
            self.notifier.jobs_changed()
        self.notifier.events_appended(run_id)
        for cancelled in decision.cancel:
            self.notifier.events_appended(cancelled)
        if prune and decision.status is None:
            self._prune_soon(run.model_name, decision.state, loaded.spec.checkpoints.keep_best)
        waiting = waiting_id(run_id, decision.state)
        ended = waiting in children and children[waiting].status.is_final
        return True, decision.status is None and (ended or starting)

    def _prune_soon(self, model: str, state: dict[str, Any], keep_best: bool) -> None:
        """Prune in the background: the run's next child does not wait on the backend's
        deletions. One pruning per model at a time; a later one reads the newer state."""
        if model in self._pruning:
            self._prune_again[model] = (state, keep_best)
            return

        async def prune() -> None:
            try:
                await self._prune(model, state, keep_best)
                while (again := self._prune_again.pop(model, None)) is not None:
                    await self._prune(model, *again)
            finally:
                self._pruning.pop(model, None)

        self._pruning[model] = asyncio.create_task(prune(), name=f"prune:{model}")

    async def _prune_now(self, model: str, state: dict[str, Any], keep_best: bool) -> None:
        """Prune after any pruning of the model under way."""
        running = self._pruning.get(model)
        if running is not None:
            self._prune_again.pop(model, None)  # this pruning reads the newer state
            with contextlib.suppress(Exception):
                await running
        await self._prune(model, state, keep_best)

    async def close(self) -> None:
        """Wait for pruning under way (each deletion is short), at shutdown."""
        for task in list(self._pruning.values()):
            with contextlib.suppress(Exception):
                await task

    async def _write(
        self,
        run_id: str,
        model: str,
        version: int,
        seen: tuple[str, bool],
        decision: Decision,
        loaded: Loaded,
        starting: bool,
    ) -> bool:
        """Write `decision`, made from the run at `version` whose job row said `seen`
        (status, cancel requested); False, and nothing written, if either has changed."""
        now = utcnow()
        state = decision.state
        for metric in decision.metrics:
            metric["seq"] = state["metric_seq"] = state.get("metric_seq", 0) + 1
        async with write_connection(self.store.engine) as conn:
            # The run's job row first, locked: the routes that change a run (cancel, pause)
            # lock it before the run's row too, so the two never wait on each other. A
            # cancel that came since the decision was made (a queued run cancelled at
            # once) is not overwritten: the decision is made again.
            now_seen = (
                await conn.execute(
                    select(jobs.c.status, jobs.c.cancel_requested)
                    .where(jobs.c.id == run_id)
                    .with_for_update()
                )
            ).one()
            if tuple(now_seen) != seen:
                await conn.rollback()
                return False
            if starting:
                state.setdefault("start_step", await _model_step(conn, model))
            moved = await conn.execute(
                update(runs)
                .where(runs.c.id == run_id, runs.c.version == version)
                .values(
                    state=state,
                    version=version + 1,
                    waiting_on=waiting_id(run_id, state),
                    updated_at=now,
                )
            )
            if moved.rowcount != 1:
                await conn.rollback()
                return False
            if starting:
                await conn.execute(
                    update(jobs)
                    .where(jobs.c.id == run_id)
                    .values(status=JobStatus.running.value, started_at=now, updated_at=now)
                )
                data = {"total_steps": state["total_steps"], "start_step": state["start_step"]}
                await append_event(conn, run_id, (EventType.run_started, data))
            for create in decision.create:
                await self._create(conn, run_id, model, create, loaded)
            for target in decision.cancel:
                await _cancel_child(conn, target)
            for metric in decision.metrics:
                data = {**metric["data"], "epoch": metric["epoch"]}
                await conn.execute(
                    insert(run_metrics).values(
                        run_id=run_id,
                        seq=metric["seq"],
                        kind=metric["kind"],
                        step=metric["step"],
                        data=data,
                        created_at=now,
                    )
                )
            for type_, data in decision.events:
                await append_event(conn, run_id, (type_, data))
            columns: dict[str, Any] = {
                "progress_step": state["step"],
                "progress_total": state["total_steps"],
                "updated_at": now,
            }
            if decision.status is not None:
                columns |= {"status": decision.status.value, "finished_at": now}
                await append_event(conn, run_id, _end_event(decision, state))
                if decision.error is not None:
                    columns["error"] = decision.error
            await conn.execute(update(jobs).where(jobs.c.id == run_id).values(columns))
        return True

    async def _create(
        self, conn: AsyncConnection, run_id: str, model: str, create: Create, loaded: Loaded
    ) -> None:
        """Insert a child job, unless it exists (a decision taken again)."""
        job_id = child_id(run_id, create.role, create.step)
        exists = await conn.scalar(select(jobs.c.id).where(jobs.c.id == job_id))
        if exists is not None:
            return
        spec = loaded.spec
        labels = {"run": run_id, "run_step": create.step, "run_role": create.role}
        if create.role == "validation":
            examples = [run_spec.as_rollout_example(i, e) for i, e in enumerate(loaded.validation)]
            recipe = run_spec.rollout_spec(spec, examples, train=None)
            hyperparameters: dict[str, Any] = {}
        else:
            assert create.examples is not None
            examples = [run_spec.as_rollout_example(i, loaded.train[i]) for i in create.examples]
            hyperparameters = dict(spec.hyperparameters)
            if create.learning_rate is not None:
                hyperparameters["learning_rate"] = create.learning_rate
            train_labels = {**labels, "run_role": "training"}
            train_id = child_id(run_id, "training", create.step)
            recipe = run_spec.rollout_spec(
                spec, examples, train=(train_id, hyperparameters, train_labels)
            )
        payload = rollout_spec.encode(recipe)
        summary = RolloutSummary(
            num_examples=len(examples),
            num_generations=recipe.num_generations,
            num_samples=len(examples) * recipe.num_generations,
        )
        new = new_job(
            JobKind.rollout,
            job_id=job_id,
            model=model,
            payload=payload,
            hyperparameters=hyperparameters,
            metadata=labels,
            summary=summary.model_dump(),
            request_hash=hashlib.sha256(payload.data).hexdigest(),
            max_attempts=self.settings.max_attempts,
            queued_event={"run": run_id, "step": create.step, "role": create.role},
        )
        await enqueue(conn, new)

    async def _load(self, conn: AsyncConnection, run_id: str) -> Loaded:
        loaded = self._loaded.get(run_id)
        if loaded is not None:
            self._loaded.move_to_end(run_id)
            return loaded
        row = (
            await conn.execute(
                select(jobs.c.payload, jobs.c.payload_format, jobs.c.payload_bytes).where(
                    jobs.c.id == run_id
                )
            )
        ).one()
        payload = Payload(row.payload_format, row.payload, row.payload_bytes)
        if payload.size > THREAD_BYTES:  # inline examples: decoded off the event loop
            spec = await asyncio.to_thread(run_spec.decode, payload)
        else:
            spec = run_spec.decode(payload)
        if spec.examples is not None:
            splits = spec.examples
            train_split, validation_split = "train", "validation"
        else:
            assert spec.dataset is not None
            splits = await load_splits(conn, spec.dataset.id)
            train_split = spec.dataset.train_split
            validation_split = spec.dataset.validation_split or "validation"
        loaded = Loaded(
            spec, spec.plan(), splits.get(train_split, []), splits.get(validation_split, [])
        )
        self._loaded[run_id] = loaded
        while len(self._loaded) > _CACHED:
            self._loaded.popitem(last=False)
        return loaded

    async def _prune(self, model: str, state: dict[str, Any], keep_best: bool) -> None:
        """Delete the run's checkpoints but the best and the latest, through the registry
        (which keeps an aliased or in-use step); idempotent."""
        from app.checkpoints import service as checkpoints

        keep = set()
        if keep_best and state.get("best"):
            keep.add(int(state["best"]["step"]))
        first = int(state.get("start_step") or 0)
        try:
            async with self._sessions() as session:
                listed, _ = await checkpoints.list_checkpoints(
                    session, self.backends, name=model, after=None, limit=1000
                )
                await session.rollback()
            steps = sorted(c.step for c in listed)
            if not steps:
                return
            keep.add(steps[-1])
            for step in steps:
                if step <= first or step in keep:
                    continue
                async with self._sessions() as session:
                    try:
                        await checkpoints.delete_checkpoint(
                            session, self.backends, name=model, step=step
                        )
                        await session.commit()
                    except ProblemError as exc:  # protected (aliased, in use) or gone
                        await session.rollback()
                        log.debug("model %s: step %s kept: %s", model, step, exc)
        except ProblemError as exc:  # the backend keeps no checkpoints here
            log.debug("model %s: no checkpoints to prune: %s", model, exc)


async def _model_step(conn: AsyncConnection, model: str) -> int:
    from app.jobs.statements import models

    step = await conn.scalar(select(models.c.current_step).where(models.c.name == model))
    return int(step or 0)


_child_jobs = jobs.alias("child")
_DUE = (
    select(jobs.c.id)
    .join(runs, runs.c.id == jobs.c.id)
    .outerjoin(_child_jobs, _child_jobs.c.id == runs.c.waiting_on)
    .where(
        jobs.c.kind == JobKind.run.value,
        jobs.c.status.in_(ACTIVE),
        or_(
            jobs.c.status == JobStatus.queued.value,
            jobs.c.cancel_requested.is_(True),
            and_(runs.c.waiting_on.is_(None), runs.c.paused.is_(False)),
            _child_jobs.c.status.in_(FINAL),
        ),
    )
    .order_by(jobs.c.id)
    .limit(500)
)
_RUN = (
    select(
        jobs.c.status,
        jobs.c.cancel_requested,
        jobs.c.model_name,
        runs.c.version,
        runs.c.paused,
        runs.c.state,
    )
    .join(runs, runs.c.id == jobs.c.id)
    .where(jobs.c.id == bindparam("run_id"))
)
_CHILD_COLUMNS = (
    jobs.c.id,
    jobs.c.status,
    jobs.c.metrics,
    jobs.c.summary,
    jobs.c.error,
    jobs.c.start_step,
    jobs.c.final_step,
    jobs.c.next_job_id,
    jobs.c.started_at,
    jobs.c.finished_at,
    jobs.c.trained,
    jobs.c.cancel_requested,
)


async def _children(conn: AsyncConnection, run_id: str, state: dict[str, Any]) -> dict[str, Child]:
    """The child the state waits on, and the rollouts of the next two steps (one may have
    been started early, off-policy)."""
    wanted = {
        child_id(run_id, "rollout", state["step"] + 1),
        child_id(run_id, "rollout", state["step"] + 2),
    }
    waiting = waiting_id(run_id, state)
    if waiting is not None:
        wanted.add(waiting)
    rows = (await conn.execute(select(*_CHILD_COLUMNS).where(jobs.c.id.in_(sorted(wanted))))).all()
    return {row.id: _child(row) for row in rows}


def _child(row: Any) -> Child:
    return Child(
        id=row.id,
        status=JobStatus(row.status),
        metrics=row.metrics,
        summary=row.summary or {},
        error=row.error,
        start_step=row.start_step,
        final_step=row.final_step,
        next_job_id=row.next_job_id,
        seconds=_seconds(row.started_at, row.finished_at),
        trained=row.trained,
        cancel_requested=bool(row.cancel_requested),
    )


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds(), 3)


async def _cancel_child(conn: AsyncConnection, job_id: str) -> None:
    """As `request_cancel` does for a job: queued, cancelled now; running, flagged."""
    row = (
        await conn.execute(
            select(jobs.c.status, jobs.c.cancel_requested).where(jobs.c.id == job_id)
        )
    ).one_or_none()
    if row is None or JobStatus(row.status).is_final:
        return
    if row.status == JobStatus.queued.value:
        await conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status == JobStatus.queued.value)
            .values(status=JobStatus.cancelled.value, finished_at=utcnow())
        )
        await append_event(conn, job_id, (EventType.job_cancelled, {"while": "queued"}))
    elif not row.cancel_requested:
        await conn.execute(update(jobs).where(jobs.c.id == job_id).values(cancel_requested=True))
        await append_event(conn, job_id, (EventType.cancel_requested, {}))


def _end_event(decision: Decision, state: dict[str, Any]) -> tuple[EventType, dict[str, Any]]:
    status = decision.status
    data = {"step": state["step"], "stop_reason": state["stop_reason"], "best": state["best"]}
    if status is JobStatus.failed:
        error = decision.error or ErrorInfo(type="Failed", message="", transient=False)
        return EventType.run_failed, {**data, "error": error}
    if status is JobStatus.cancelled:
        return EventType.job_cancelled, {"while": "running", **data}
    return EventType.run_ended, data
