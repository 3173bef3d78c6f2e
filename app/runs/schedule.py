"""A run's schedule, pure: which examples each step takes, how many steps there are, the
learning rate of each step, and the decision the driver takes from what its child jobs
did. No database, no I/O: `app.runs.driver` reads the children, calls `decide`, and
writes what it returns in one guarded transaction.

A run is a loop over steps s = 1, 2, ...; step s is three child jobs with ids derived
from the run's (`child_id`): the rollout `r` samples the step's examples and, when it
succeeds, enqueues the training job `t` in the same write; every `validation.every_steps`
steps (and once before the first, as a baseline) the validation rollout `v` samples the
validation split. The state in `runs.state` says which of them the run waits on; the
deterministic ids make a decision taken twice (two drivers, a crash between deciding and
writing) find the job it created the first time.

```
  validation(0)? ─▶ rollout(1) ─▶ training(1) ─▶ [validation(1)] ─▶ rollout(2) ─▶ ...
```
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field
from typing import Any

from app.jobs.lifecycle import ErrorInfo, EventType, JobStatus
from app.runs.state import Phase, Role, RunState

ROLE_LETTER: dict[Role, str] = {"rollout": "r", "training": "t", "validation": "v", "warmup": "w"}


def child_id(run_id: str, role: Role, step: int) -> str:
    """`run_<t>` → `job_<t>-r000001`: time-ordered like the run (a claim takes the run's
    children in the run's turn) and the same every time it is asked."""
    return f"job_{run_id.removeprefix('run_')}-{ROLE_LETTER[role]}{step:06d}"


def run_of(job_id: str) -> str | None:
    """The run a child job belongs to (None: not a run's child), from its id alone."""
    head, dash, tail = job_id.partition("-")
    if not dash or not head.startswith("job_") or tail[:1] not in ("r", "t", "v", "w"):
        return None
    return "run_" + head.removeprefix("job_")


def queues_next(job_id: str) -> bool:
    """Whether a run's child queues the run's next child itself, in its final write: a
    step's rollout queues its training job (`r` → `t`). After any other child, the driver
    decides what comes next."""
    head, dash, tail = job_id.partition("-")
    return bool(dash) and head.startswith("job_") and tail[:1] == "r"


@dataclass(frozen=True)
class Plan:
    """What a run's spec fixes about its schedule."""

    num_train: int
    examples_per_step: int
    epochs: int | None
    max_steps: int | None
    seed: int
    validate_every: int | None
    early_stopping: tuple[int, float] | None  # patience, min_delta
    curriculum: tuple[int, int] | None  # patience, min_examples
    off_policy: int
    lr: float | None
    lr_schedule: tuple[str, int, float] | None  # type, warmup_steps, min_ratio
    warmup: bool = False  # an SFT step before the first validation and rollout


def epoch_steps(examples: int, per_step: int) -> int:
    return max(1, math.ceil(examples / per_step))


def epoch_order(active: list[int], seed: int, epoch: int) -> list[int]:
    """The examples of epoch `epoch` (0-based), in order: a shuffle seeded by the run's
    seed and the epoch, the same on every worker and after every restart."""
    order = sorted(active)
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def total_steps(plan: Plan, *, epoch: int, epoch_start: int, active: int) -> int:
    """Steps in the whole run, as far as known: the steps before this epoch, this and the
    remaining epochs at the active examples' count, at most `max_steps`."""
    per_epoch = epoch_steps(active, plan.examples_per_step)
    total = epoch_start + per_epoch * ((plan.epochs or 0) - epoch) if plan.epochs else None
    if plan.max_steps is not None:
        total = plan.max_steps if total is None else min(total, plan.max_steps)
    assert total is not None
    return total


def learning_rate(plan: Plan, step: int, total: int) -> float | None:
    """The learning rate of step `step` (1-based) of `total`."""
    if plan.lr is None or plan.lr_schedule is None:
        return plan.lr
    kind, warmup, min_ratio = plan.lr_schedule
    if warmup and step <= warmup:
        return plan.lr * step / warmup
    if kind == "constant" or total <= warmup:
        return plan.lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    factor = 1.0 - progress if kind == "linear" else cosine
    return plan.lr * (min_ratio + (1.0 - min_ratio) * factor)


def initial_state(plan: Plan) -> RunState:
    active = list(range(plan.num_train))
    return RunState(
        epochs=plan.epochs,
        order=epoch_order(active, plan.seed, 0),
        total_steps=total_steps(plan, epoch=0, epoch_start=0, active=len(active)),
        phase="warmup" if plan.warmup else _first_phase(plan),
    )


def _first_phase(plan: Plan) -> Phase:
    """Where a run starts, after its warm-up if it has one: a validation of the step it
    starts from, or the first rollout."""
    return "validation" if plan.validate_every else "rollout"


def batch(plan: Plan, state: RunState, step: int) -> list[int]:
    """The train examples of step `step` (1-based), which belongs to the current epoch."""
    position = step - 1 - state.epoch_start
    per = plan.examples_per_step
    order: list[int] = state.order
    return order[position * per : (position + 1) * per]


@dataclass(frozen=True)
class Child:
    """What the driver reads of a child job."""

    id: str
    status: JobStatus
    metrics: dict[str, Any] | None
    summary: dict[str, Any]
    error: dict[str, Any] | None
    start_step: int | None
    final_step: int | None
    next_job_id: str | None
    seconds: float | None  # from its start to its end
    trained: bool | None
    cancel_requested: bool = False


@dataclass
class Create:
    role: Role
    step: int  # the step it belongs to (validation: the step it validates)
    examples: list[int] | None = None  # train indices (rollout); None: the validation split
    learning_rate: float | None = None


@dataclass
class Decision:
    """What to write. `state`: the new state; `status`: the run's new status (None: as is)."""

    state: RunState
    create: list[Create] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)  # child ids to cancel
    metrics: list[dict[str, Any]] = field(default_factory=list)  # kind, step, epoch, data
    events: list[tuple[EventType, dict[str, Any]]] = field(default_factory=list)
    status: JobStatus | None = None
    error: ErrorInfo | None = None
    prune: bool = False

    @property
    def changed(self) -> bool:
        return bool(
            self.create or self.cancel or self.metrics or self.events or self.status or self.prune
        )


def waiting_id(run_id: str, state: RunState) -> str | None:
    if state.waiting is None:
        return None
    role, step = state.waiting
    return child_id(run_id, role, step)


def decide(
    plan: Plan,
    run_id: str,
    state: RunState,
    children: dict[str, Child],
    *,
    paused: bool,
    cancel_requested: bool,
) -> Decision:
    """The next move of a run, from its state and its children (`children`: the child the
    state waits on, and the rollout of the step after it if one exists)."""
    new = copy.deepcopy(state)
    decision = Decision(new)
    working = [c for c in children.values() if not c.status.is_final]
    if cancel_requested:
        decision.cancel = [c.id for c in working if not c.cancel_requested]
        waiting = waiting_id(run_id, state)
        child = children.get(waiting) if waiting else None
        if child is not None and child.status.is_final:
            if child.status is JobStatus.succeeded:
                # A step that landed counts; a rollout's training job is cancelled next.
                _take(plan, run_id, new, child, decision, cancel_requested=True)
            else:
                new.waiting = None
        if not working and new.waiting is None:
            _end(new, decision, JobStatus.cancelled, "cancelled")
        return decision
    waiting = waiting_id(run_id, state)
    child = children.get(waiting) if waiting else None
    if child is not None:
        if not child.status.is_final:
            return decision  # it is still working
        _take(plan, run_id, new, child, decision, cancel_requested=False)
        if decision.status is not None:
            decision.cancel = [c.id for c in working]
            return decision
    if new.waiting is not None or paused:
        return decision  # a training job is next (its rollout enqueued it), or paused
    _next(plan, run_id, new, children, decision)
    return decision


def _take(
    plan: Plan,
    run_id: str,
    state: RunState,
    child: Child,
    decision: Decision,
    *,
    cancel_requested: bool,
) -> None:
    """Fold a finished child into the state (the child it waits on)."""
    assert state.waiting is not None
    role, step = state.waiting
    state.waiting = None
    if child.status is not JobStatus.succeeded:
        error = child.error or {}
        message = f"{role} job {child.id} {child.status.value}"
        if error.get("message"):
            message += f": {error.get('type', 'Error')}: {error['message']}"
        _end(state, decision, JobStatus.failed, "failed")
        decision.error = ErrorInfo(type="ChildJobFailed", message=message, transient=False)
        return
    if role == "warmup":
        state.phase = _first_phase(plan)
        progress = {
            "step": 0,
            "total_steps": state.total_steps,
            "epoch": 0,
            "reward_mean": None,
            "loss": _training_figures(child)["loss"],
            "warmup": child.id,  # the SFT step before RL, done
        }
        decision.events.append((EventType.run_step, progress))
        return
    if role == "rollout":
        if child.next_job_id is None:  # it built no training job: impossible with `train`
            _end(state, decision, JobStatus.failed, "failed")
            message = f"rollout job {child.id} enqueued no training job"
            decision.error = ErrorInfo(type="ChildJobFailed", message=message, transient=False)
            return
        state.waiting = ("training", step)
        state.phase = "training"
        state.sampled[str(step)] = _rollout_figures(child)
        _curriculum_note(plan, state, step, child)
        if plan.off_policy and not cancel_requested:
            _prefetch(plan, run_id, state, step, decision)
        return
    if role == "training":
        state.step = step
        sampled = state.sampled.pop(str(step), {})
        data = {**sampled, **_training_figures(child)}
        decision.metrics.append(
            {"kind": "step", "step": step, "epoch": state.epoch + 1, "data": data}
        )
        progress = {
            "step": step,
            "total_steps": state.total_steps,
            "epoch": state.epoch + 1,
            "reward_mean": data.get("reward_mean"),
            "loss": data.get("loss"),
        }
        decision.events.append((EventType.run_step, progress))
        state.phase = "rollout"
        if plan.validate_every and (step % plan.validate_every == 0 or step >= state.total_steps):
            state.phase = "validation"
        return
    # validation
    score = (child.metrics or {}).get("mean_reward")
    sampled_step = child.start_step if child.start_step is not None else step
    state.validations += 1
    best = state.best
    improved = score is not None and (best is None or score > best["score"])
    if improved:
        state.best = {"step": sampled_step, "score": score}
    reference = state.reference
    if score is not None and (reference is None or score > reference + plan_min_delta(plan)):
        state.reference, state.since_best = score, 0
    elif state.validations > 1:
        state.since_best += 1
    data = {
        "score": score,
        "reward_mean": score,
        "reward_std": (child.metrics or {}).get("reward_std"),
        "num_samples": (child.metrics or {}).get("num_graded"),
        "job_id": child.id,
        "best": improved,
    }
    decision.metrics.append(
        {"kind": "validation", "step": sampled_step, "epoch": None, "data": data}
    )
    decision.events.append(
        (EventType.run_validated, {"step": sampled_step, "score": score, "best": state.best})
    )
    decision.prune = True
    state.phase = "rollout"
    if plan.early_stopping and state.since_best >= plan.early_stopping[0]:
        _end(state, decision, JobStatus.succeeded, "early_stopping")


def plan_min_delta(plan: Plan) -> float:
    return plan.early_stopping[1] if plan.early_stopping else 0.0


def _rollout_figures(child: Child) -> dict[str, Any]:
    metrics = child.metrics or {}
    groups = metrics.get("num_groups") or 0
    untrainable = len(metrics.get("untrainable_groups") or [])
    return {
        "reward_mean": metrics.get("mean_reward"),
        "reward_std": metrics.get("reward_std"),
        "trainable_share": (groups - untrainable) / groups if groups else None,
        "num_samples": metrics.get("num_graded"),
        "sample_errors": metrics.get("num_errors"),
        "policy_step": child.start_step,
        "sampling_s": child.seconds,
        "rollout_job_id": child.id,
        "untrainable_examples": metrics.get("untrainable_groups") or [],
    }


def _training_figures(child: Child) -> dict[str, Any]:
    metrics = dict(child.metrics or {})
    return {
        "loss": metrics.get("loss/train", metrics.get("loss")),
        "tokens": metrics.get("data/step_trainer_tokens"),
        "learning_rate": metrics.get("loss/learning_rate"),
        "training_s": child.seconds,
        "trained": child.trained,
        "training_job_id": child.id,
        "trainer": metrics,
    }


def _curriculum_note(plan: Plan, state: RunState, step: int, child: Child) -> None:
    """Count, per example of the step, epochs in a row its group was all one reward."""
    if plan.curriculum is None:
        return
    uniform = {str(i) for i in (child.metrics or {}).get("untrainable_groups") or []}
    for index in batch(plan, state, step):
        key = str(index)
        state.uniform[key] = state.uniform.get(key, 0) + 1 if key in uniform else 0


def _prefetch(plan: Plan, run_id: str, state: RunState, step: int, decision: Decision) -> None:
    """Off-policy: the next step's rollout starts while this step's training waits."""
    following = step + 1
    if following > state.total_steps:
        return
    if plan.validate_every and step % plan.validate_every == 0:
        return  # validation comes first
    if following - 1 - state.epoch_start >= epoch_steps(len(state.order), plan.examples_per_step):
        return  # a new epoch: its order waits for this epoch's curriculum counts
    decision.create.append(
        Create("rollout", following, batch(plan, state, following), _lr(plan, state, following))
    )


def _lr(plan: Plan, state: RunState, step: int) -> float | None:
    return learning_rate(plan, step, state.total_steps)


def _next(
    plan: Plan,
    run_id: str,
    state: RunState,
    children: dict[str, Child],
    decision: Decision,
) -> None:
    """Nothing to wait on: start the next child, or end the run."""
    if state.phase == "warmup":
        state.waiting = ("warmup", 0)
        decision.create.append(Create("warmup", 0))
        return
    if state.phase == "validation":
        validated = state.step
        state.waiting = ("validation", validated)
        decision.create.append(Create("validation", validated))
        return
    step = state.step + 1
    if step > state.total_steps:
        _end(state, decision, JobStatus.succeeded, "completed")
        decision.prune = True
        return
    if step - 1 - state.epoch_start >= epoch_steps(len(state.order), plan.examples_per_step):
        _new_epoch(plan, state, step - 1)
        if step > state.total_steps:
            _end(state, decision, JobStatus.succeeded, "completed")
            decision.prune = True
            return
    state.waiting = ("rollout", step)
    state.phase = "rollout"
    if child_id(run_id, "rollout", step) not in children:
        decision.create.append(
            Create("rollout", step, batch(plan, state, step), _lr(plan, state, step))
        )


def _new_epoch(plan: Plan, state: RunState, trained: int) -> None:
    state.epoch += 1
    state.epoch_start = trained
    if plan.curriculum is not None:
        patience, floor = plan.curriculum
        done = {int(k) for k, n in state.uniform.items() if n >= patience}
        active = [i for i in range(plan.num_train) if i not in done]
        if len(active) >= floor:
            state.excluded = sorted(done)
    excluded = set(state.excluded)
    active = [i for i in range(plan.num_train) if i not in excluded]
    state.order = epoch_order(active, plan.seed, state.epoch)
    state.total_steps = total_steps(
        plan, epoch=state.epoch, epoch_start=trained, active=len(active)
    )


def _end(state: RunState, decision: Decision, status: JobStatus, reason: str) -> None:
    state.phase = "done"
    state.waiting = None
    state.stop_reason = reason
    decision.status = status
