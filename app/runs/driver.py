"""The run driver: advances every active run from what its child jobs did.

Each worker runs it in its loop, after every wake-up (a child job ended, a run was
created, paused, resumed or cancelled) and every poll. Advancing a run is short and
touches only the database: read the run and the children its state names, `decide`
(pure, `app.runs.schedule`), then write the decision in one transaction guarded by the
run's `version`. Two drivers that decide at once cannot both write: the second matches
no row, rolls back (with any child job it inserted) and decides again from what the first
wrote. A crash between deciding and writing loses nothing but the decision, which the
next driver takes again; a child's deterministic id makes it the same job. When a child
ends, its run's move is made in the child's final write (`JoinedMove`).

The slow work is the children's, claimed by workers like any job. Pruning checkpoints,
which calls the backend, runs after the write and is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, cast

from sqlalchemy import Table, and_, bindparam, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection, async_sessionmaker

from app.backends import Backends
from app.datasets import THREAD_BYTES, load_splits
from app.db import is_unavailable, utcnow
from app.errors import ProblemError
from app.jobs.lifecycle import (
    JobKind,
    JobStatus,
    NewJob,
    RunMetric,
    RunMove,
    RunWrite,
    plan_run,
    run_status,
)
from app.jobs.payloads import Payload
from app.jobs.runs import apply_move, model_step, write_move
from app.jobs.statements import jobs
from app.jobs.store import Claim, LeftOut, QueueStore, new_job
from app.models import RunMetricRow, RunRow
from app.notify import Notifier
from app.rollouts import spec as rollout_spec
from app.runs import spec as run_spec
from app.runs.schedule import (
    Child,
    Create,
    Decision,
    Plan,
    child_id,
    decide,
    queues_next,
    waiting_id,
)
from app.runs.state import RunState
from app.runs.state import decode as decode_state
from app.schemas.rollouts import RolloutSummary
from app.settings import Settings
from app.training import methods

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


class Claimer(Protocol):
    """A worker that claims the children a move queues in the move's own transaction:
    `claim_in` runs inside it (`slots`: at most that many; None: its free slots),
    `run_claims` once it has committed."""

    async def claim_in(self, conn: AsyncConnection, *, slots: int | None = None) -> list[Claim]: ...

    def run_claims(self, claims: list[Claim]) -> None: ...


@dataclass
class _Decided:
    """A decision on a run, planned as its write, not yet written."""

    run_id: str
    run: Any  # the `_RUN` row it was taken from
    loaded: Loaded
    decision: Decision
    children: dict[str, Child]
    starting: bool
    prune: bool  # checkpoints to prune (before the write where the run ends)
    write: RunWrite

    @property
    def seen(self) -> tuple[str, bool]:
        return self.run.status, self.run.cancel_requested

    @property
    def ends_pruning(self) -> bool:
        return self.prune and self.decision.status is not None


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
        self._prune_again: dict[str, tuple[RunState, bool]] = {}

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
            except Exception as exc:  # one run's trouble must not stop the others
                if is_unavailable(exc):
                    log.warning("run %s: not advanced (%s); trying again later", run_id, exc)
                else:
                    log.exception("run %s: advancing it failed; trying again later", run_id)
        return moved

    async def advance(self, run_id: str, claimer: Claimer | None = None) -> int:
        """Move the run on as far as it goes now. `claimer`: whoever advances it claims
        the children it queues in the same transaction."""
        moves = 0
        for _ in range(MAX_MOVES):
            moved, again = await self._move(run_id, claimer)
            moves += moved
            if not again:
                break
        return moves

    async def _move(self, run_id: str, claimer: Claimer | None = None) -> tuple[bool, bool]:
        """One decision written (moved), and whether another may follow at once (again):
        the run now waits on a child that had already ended (a rollout started early), or
        another driver moved it first."""
        async with self.store.engine.connect() as conn:
            decided = await self._decide(conn, run_id)
        if decided is None:
            return False, False
        if decided.ends_pruning:
            # A run that ends has pruned first: what its owner lists once it has ended is
            # what it keeps. Idempotent: redone if the write below loses to another driver.
            await self._prune_now(
                decided.run.model_name,
                decided.decision.state,
                decided.loaded.spec.checkpoints.keep_best,
            )
        taken: list[Claim] = []

        async def take(conn: AsyncConnection) -> None:
            assert claimer is not None
            taken.extend(await claimer.claim_in(conn))

        then = take if claimer is not None and decided.decision.create else None
        written = await apply_move(
            self.store.engine,
            run_id,
            version=decided.run.version,
            seen=decided.seen,
            write=decided.write,
            then=then,
        )
        if not written:
            return False, True  # another driver moved it: decide again from its state
        return True, self._moved(decided, claimer, taken)

    def joined(self, run_id: str, job_id: str, claimer: Claimer) -> JoinedMove:
        """The run's next move, to make in the final write of its child `job_id`."""
        return JoinedMove(self, run_id, job_id, claimer)

    def has_loaded(self, run_id: str) -> bool:
        """Whether this process has read the run's spec (`_load`)."""
        return run_id in self._loaded

    async def _decide(self, conn: AsyncConnection, run_id: str, run: Any = None) -> _Decided | None:
        """Read the run (unless `run`: its `_RUN` row, read in this transaction) and the
        children its state names, and decide (`decide`, pure); None where there is
        nothing to write (the run has ended, or nothing changed)."""
        if run is None:
            run = (await conn.execute(_RUN, {"run_id": run_id})).one()
        if JobStatus(run.status).is_final:
            return None
        loaded = await self._load(conn, run_id)
        state = decode_state(run.state)
        children = await _children(conn, run_id, state)
        starting = run.status == JobStatus.queued.value
        start_step = await model_step(conn, run.model_name) if starting else None
        decision = decide(
            loaded.plan,
            run_id,
            state,
            children,
            paused=run.paused,
            cancel_requested=run.cancel_requested,
        )
        if not decision.changed and decision.state == state and not starting:
            return None
        if start_step is not None:
            decision.state.start_step = start_step
        move = self._move_of(run_id, run.model_name, decision, loaded, start_step)
        write = plan_run(run_status(JobStatus(run.status), run.paused), move, now=utcnow())
        prune = decision.prune and loaded.spec.checkpoints.prune
        return _Decided(run_id, run, loaded, decision, children, starting, prune, write)

    def _moved(self, decided: _Decided, claimer: Claimer | None, taken: list[Claim]) -> bool:
        """What follows a move once it has committed; returns whether another move may
        follow at once (see `_move`)."""
        run_id, decision = decided.run_id, decided.decision
        if claimer is not None and taken:
            claimer.run_claims(taken)  # committed: they are this worker's now
        if {child.id for child in decided.write.children} - {c.lease.job_id for c in taken}:
            self.notifier.jobs_changed()  # a child is left for another worker
        self.notifier.events_appended(run_id)
        for cancelled in decision.cancel:
            self.notifier.events_appended(cancelled)
        if decided.prune and decision.status is None:
            keep_best = decided.loaded.spec.checkpoints.keep_best
            self._prune_soon(decided.run.model_name, decision.state, keep_best)
        waiting = waiting_id(run_id, decision.state)
        ended = waiting in decided.children and decided.children[waiting].status.is_final
        return decision.status is None and (ended or decided.starting)

    def _move_of(
        self,
        run_id: str,
        model: str,
        decision: Decision,
        loaded: Loaded,
        start_step: int | None,
    ) -> RunMove:
        """The lifecycle's view of a decision: what it writes, nothing written here."""
        state = decision.state
        end_data: dict[str, Any] = {}
        if decision.status is not None:
            end_data = {"step": state.step, "stop_reason": state.stop_reason, "best": state.best}
        metrics = tuple(
            RunMetric(m["kind"], m["step"], {**m["data"], "epoch": m["epoch"]})
            for m in decision.metrics
        )
        return RunMove(
            state=state.encode(),
            step=state.step,
            total_steps=state.total_steps,
            start_step=start_step,
            ends=decision.status,
            error=decision.error,
            end_data=end_data,
            events=tuple(decision.events),
            metrics=metrics,
            children=tuple(self._child(run_id, model, c, loaded) for c in decision.create),
            cancel=tuple(decision.cancel),
            waiting_on=waiting_id(run_id, state),
        )

    def _prune_soon(self, model: str, state: RunState, keep_best: bool) -> None:
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

    async def _prune_now(self, model: str, state: RunState, keep_best: bool) -> None:
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

    def _child(self, run_id: str, model: str, create: Create, loaded: Loaded) -> NewJob:
        """The child job a decision creates (its id is the same every time it is asked)."""
        job_id = child_id(run_id, create.role, create.step)
        spec = loaded.spec
        labels = {"run": run_id, "run_step": create.step, "run_role": create.role}
        if create.role == "warmup":
            return self._warmup(job_id, model, spec.warmup, labels)
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
        return new_job(
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

    def _warmup(
        self, job_id: str, model: str, warmup: dict[str, Any] | None, labels: dict[str, Any]
    ) -> NewJob:
        """The run's SFT warm-up: a training job with `method: sft`."""
        assert warmup is not None
        payload, summary = methods.encode_sft(warmup["examples"])
        return new_job(
            JobKind.training,
            job_id=job_id,
            model=model,
            payload=payload,
            hyperparameters=warmup["hyperparameters"],
            metadata=labels,
            summary=summary.model_dump(),
            request_hash=hashlib.sha256(payload.data).hexdigest(),
            max_attempts=self.settings.max_attempts,
            queued_event={"run": labels["run"], "step": 0, "role": "warmup"},
        )

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

    async def _prune(self, model: str, state: RunState, keep_best: bool) -> None:
        """Delete the run's checkpoints but the best and the latest, through the registry
        (which keeps an aliased or in-use step); idempotent."""
        from app.checkpoints import service as checkpoints

        keep = set()
        if keep_best and state.best:
            keep.add(int(state.best["step"]))
        first = int(state.start_step or 0)
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


class JoinedMove:
    """A run's next move made in its child's final write (`QueueStore.apply(joined=...)`):
    the child's end, the run's decision, the children it queues and the claim of the next
    job into the slot the child frees commit together, where they took four transactions
    one after another (`bench.runs`). The run's job row is locked first, as every move and
    the routes that change a run lock it before a child's row.

    Where the move would wait on what a transaction should not (the run's spec not yet
    read by this process, checkpoints to prune as the run ends), or fails, it makes none
    (`settled` stays False) and the worker advances the run after the write, as before:
    a failure raises `LeftOut`, and the store makes the child's write again without it.
    """

    def __init__(self, driver: RunDriver, run_id: str, job_id: str, claimer: Claimer) -> None:
        self.driver, self.run_id, self.job_id, self.claimer = driver, run_id, job_id, claimer
        self.settled = False  # the run needs no advance after the write (but `again`)
        self.again = False  # another move may follow at once (see `RunDriver._move`)
        self.claimed = 0  # jobs claimed into the slot the child frees
        self._run: Any = None  # the run's `_RUN` row, read as it was locked

    async def lock(self, conn: AsyncConnection) -> None:
        """Lock the run's job row (as `lock_run`), reading what `_decide` reads of the run
        in the same statement: a round trip fewer on Postgres."""
        self._run = (await conn.execute(_RUN_LOCKED, {"run_id": self.run_id})).one()

    async def then(self, conn: AsyncConnection) -> Callable[[], None]:
        self.settled, self.again, self.claimed = False, False, 0
        if not self.driver.has_loaded(self.run_id):  # read off the loop, after the write
            return _nothing
        try:
            taken: list[Claim] = []
            # A rollout's write queued its training job: claim it before deciding (the run
            # waits on it). Otherwise decide first: the move queues what the slot takes.
            first = queues_next(self.job_id)
            if first:
                taken = await self.claimer.claim_in(conn, slots=1)
            decided = await self.driver._decide(conn, self.run_id, self._run)
            if decided is not None:
                if decided.ends_pruning:  # pruned before the run's end is written: after
                    raise LeftOut("the run ends: its checkpoints are pruned first")
                # `lock` took the run's row before `_decide` read it: seen None.
                version, write = decided.run.version, decided.write
                if not await write_move(conn, self.run_id, version=version, seen=None, write=write):
                    raise LeftOut("the run changed")  # not while its row is locked
            if not first:
                taken = await self.claimer.claim_in(conn, slots=1)
        except LeftOut:
            raise
        except Exception as exc:  # the child's write is made again without the move
            if is_unavailable(exc):
                raise  # the write is tried again as it is
            raise LeftOut(f"{type(exc).__name__}: {exc}") from exc

        def committed() -> None:
            self.settled, self.claimed = True, len(taken)
            if decided is None:
                self.claimer.run_claims(taken)
            else:
                self.again = self.driver._moved(decided, self.claimer, taken)

        return committed


def _nothing() -> None:
    pass


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
# The run's job row locked, as `lock_run` locks it (not its `runs` row).
_RUN_LOCKED = _RUN.with_for_update(of=jobs)
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

# Three ids, each its own parameter: an IN of a list is rendered again at every execution.
_CHILDREN = select(*_CHILD_COLUMNS).where(
    jobs.c.id.in_([bindparam("next_one"), bindparam("next_two"), bindparam("waiting")])
)


async def _children(conn: AsyncConnection, run_id: str, state: RunState) -> dict[str, Child]:
    """The child the state waits on, and the rollouts of the next two steps (one may have
    been started early, off-policy)."""
    next_one = child_id(run_id, "rollout", state.step + 1)
    ids = {
        "next_one": next_one,
        "next_two": child_id(run_id, "rollout", state.step + 2),
        "waiting": waiting_id(run_id, state) or next_one,
    }
    rows = (await conn.execute(_CHILDREN, ids)).all()
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
