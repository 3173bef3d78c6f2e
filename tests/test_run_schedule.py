"""A run's schedule, pure: epoch orders, learning rates, and the decisions a driver takes
from what its children did (off-policy prefetch, early stopping, curriculum, cancel)."""

from __future__ import annotations

from typing import Any

import pytest

from app.jobs.lifecycle import JobStatus
from app.runs.schedule import (
    Child,
    Plan,
    child_id,
    decide,
    epoch_order,
    initial_state,
    learning_rate,
    queues_next,
    run_of,
)

RUN = "run_0661b5914c7f371b3abb4591"


def plan(**changes: Any) -> Plan:
    values: dict[str, Any] = {
        "num_train": 6,
        "examples_per_step": 2,
        "epochs": 2,
        "max_steps": None,
        "seed": 3,
        "validate_every": None,
        "early_stopping": None,
        "curriculum": None,
        "off_policy": 0,
        "lr": 0.1,
        "lr_schedule": None,
    }
    values.update(changes)
    return Plan(**values)


def child(role: str, step: int, status: str = "succeeded", **fields: Any) -> Child:
    job_id = child_id(RUN, role, step)  # type: ignore[arg-type]
    values: dict[str, Any] = {
        "id": job_id,
        "status": JobStatus(status),
        "metrics": {"mean_reward": 0.5, "num_groups": 2, "untrainable_groups": []},
        "summary": {},
        "error": None,
        "start_step": step - 1 if role != "validation" else step,
        "final_step": step if role == "training" else None,
        "next_job_id": child_id(RUN, "training", step) if role == "rollout" else None,
        "seconds": 0.1,
        "trained": True,
    }
    values.update(fields)
    return Child(**values)


def drive(p: Plan, outcomes: dict[tuple[str, int], dict[str, Any]] | None = None) -> list[Any]:
    """Run a whole schedule, every child succeeding (or as `outcomes` says); returns the
    sequence of (role, step) children it made and the final decision."""
    state = initial_state(p)
    made: list[tuple[str, int]] = []
    children: dict[str, Child] = {}
    for _ in range(500):
        decision = decide(p, RUN, state, children, paused=False, cancel_requested=False)
        for create in decision.create:
            made.append((create.role, create.step))
            fields = (outcomes or {}).get((create.role, create.step), {})
            children[child_id(RUN, create.role, create.step)] = child(
                create.role, create.step, **fields
            )
            if create.role == "rollout":  # its training job, as the rollout enqueues it
                training = child("training", create.step)
                children[training.id] = training
        state = decision.state
        if decision.status is not None:
            return [made, decision]
    raise AssertionError("the schedule never ended")


def test_child_ids_are_the_runs_and_lead_back_to_it() -> None:
    assert child_id(RUN, "rollout", 3) == "job_0661b5914c7f371b3abb4591-r000003"
    assert run_of(child_id(RUN, "validation", 12)) == RUN
    assert run_of("job_0661b5914c7f371b3abb4591") is None
    assert run_of("job_x-q000001") is None
    # Only a step's rollout queues the run's next child itself (its training job).
    assert queues_next(child_id(RUN, "rollout", 3))
    roles = ("training", "validation", "warmup")
    assert not any(queues_next(child_id(RUN, role, 3)) for role in roles)
    assert not queues_next("job_0661b5914c7f371b3abb4591") and not queues_next("job_x-q1")


def test_epoch_orders_are_seeded_shuffles() -> None:
    first = epoch_order(list(range(10)), 3, 0)
    assert sorted(first) == list(range(10)) and first == epoch_order(list(range(10)), 3, 0)
    assert first != epoch_order(list(range(10)), 3, 1) != epoch_order(list(range(10)), 4, 0)


@pytest.mark.parametrize(
    ("kind", "warmup", "expected"),
    [
        ("constant", 0, [0.1, 0.1, 0.1, 0.1]),
        ("constant", 2, [0.05, 0.1, 0.1, 0.1]),
        ("linear", 0, [0.075, 0.05, 0.025, 0.0]),
        ("cosine", 0, [0.085355, 0.05, 0.014645, 0.0]),
    ],
)
def test_learning_rate_schedules(kind: str, warmup: int, expected: list[float]) -> None:
    p = plan(lr_schedule=(kind, warmup, 0.0))
    got = [learning_rate(p, step, 4) for step in range(1, 5)]
    assert got == pytest.approx(expected, abs=1e-6)
    floor = plan(lr_schedule=("linear", 0, 0.5))
    assert learning_rate(floor, 4, 4) == pytest.approx(0.05)


def test_a_schedule_takes_every_example_once_per_epoch_then_ends() -> None:
    made, end = drive(plan(validate_every=2))
    assert made == [
        ("validation", 0),
        ("rollout", 1),
        ("rollout", 2),
        ("validation", 2),
        ("rollout", 3),
        ("rollout", 4),
        ("validation", 4),
        ("rollout", 5),
        ("rollout", 6),
        ("validation", 6),
    ]
    assert end.status is JobStatus.succeeded and end.state.stop_reason == "completed"
    assert end.state.step == 6 and end.prune


def test_max_steps_ends_before_the_epochs_do() -> None:
    made, end = drive(plan(max_steps=4))
    assert [m for m in made if m[0] == "rollout"] == [("rollout", s) for s in range(1, 5)]
    assert end.state.step == 4


def test_early_stopping_after_patience_validations_without_improvement() -> None:
    flat = {("validation", s): {"metrics": {"mean_reward": 0.4}} for s in range(0, 7, 2)}
    _, end = drive(plan(validate_every=2, early_stopping=(2, 0.0)), flat)
    assert end.state.stop_reason == "early_stopping" and end.state.step == 4
    assert end.state.best == {"step": 0, "score": 0.4}


def test_a_failed_child_fails_the_run_naming_it() -> None:
    broken = {("rollout", 2): {"status": "failed", "error": {"type": "X", "message": "boom"}}}
    _, end = drive(plan(), broken)
    assert end.status is JobStatus.failed and end.state.step == 1
    assert end.error is not None and "r000002 failed: X: boom" in end.error["message"]


def test_off_policy_starts_the_next_rollout_while_the_step_trains() -> None:
    p = plan(off_policy=1)
    state = initial_state(p)
    first = decide(p, RUN, state, {}, paused=False, cancel_requested=False)
    assert [(c.role, c.step) for c in first.create] == [("rollout", 1)]
    done = {child_id(RUN, "rollout", 1): child("rollout", 1)}
    second = decide(p, RUN, first.state, done, paused=False, cancel_requested=False)
    assert [(c.role, c.step) for c in second.create] == [("rollout", 2)]
    assert second.state.waiting == ("training", 1)


def test_curriculum_leaves_out_examples_always_solved_or_failed() -> None:
    # Every group of examples 0 and 1 is all one reward: the second epoch leaves them out.
    p = plan(curriculum=(1, 2))
    state = initial_state(p)
    order = state.order
    outcomes = {}
    for step in range(1, 4):
        batch = order[(step - 1) * 2 : step * 2]
        same = [i for i in batch if i in (0, 1)]
        metrics = {"mean_reward": 1.0, "num_groups": 2, "untrainable_groups": same}
        outcomes[("rollout", step)] = {"metrics": metrics}
    _, end = drive(p, outcomes)
    assert end.state.excluded == [0, 1]
    assert sorted(end.state.order) == [2, 3, 4, 5]
    assert end.state.step == 5  # 3 steps, then 2 of the four examples left


def test_pause_holds_and_cancel_cancels_the_child_under_way() -> None:
    p = plan()
    state = initial_state(p)
    started = decide(p, RUN, state, {}, paused=False, cancel_requested=False)
    running = {child_id(RUN, "rollout", 1): child("rollout", 1, status="running")}
    held = decide(p, RUN, started.state, running, paused=True, cancel_requested=False)
    assert not held.changed and held.state == started.state
    done = {child_id(RUN, "rollout", 1): child("rollout", 1)}
    training = {child_id(RUN, "training", 1): child("training", 1)}
    after = decide(p, RUN, started.state, done, paused=True, cancel_requested=False)
    paused = decide(p, RUN, after.state, training, paused=True, cancel_requested=False)
    assert paused.state.step == 1 and paused.create == []  # the step landed; no next
    cancel = decide(p, RUN, started.state, running, paused=False, cancel_requested=True)
    assert cancel.cancel == [child_id(RUN, "rollout", 1)] and cancel.status is None
    gone = {child_id(RUN, "rollout", 1): child("rollout", 1, status="cancelled")}
    over = decide(p, RUN, started.state, gone, paused=False, cancel_requested=True)
    assert over.status is JobStatus.cancelled and over.state.stop_reason == "cancelled"


def test_a_warm_up_comes_first_and_a_failed_one_fails_the_run() -> None:
    """`warmup`: the run waits on its SFT child (`…-w000000`) before the baseline
    validation; a warm-up that fails ends the run failed, naming it."""
    p = plan(warmup=True, validate_every=2)
    state = initial_state(p)
    assert state.phase == "warmup"
    first = decide(p, RUN, state, {}, paused=False, cancel_requested=False)
    (create,) = first.create
    assert (create.role, create.step) == ("warmup", 0)
    warmup_id = child_id(RUN, "warmup", 0)
    assert warmup_id.endswith("-w000000") and run_of(warmup_id) == RUN
    assert first.state.waiting == ("warmup", 0)
    done = child("warmup", 0, final_step=1, start_step=0, metrics={"loss/train": 0.7})
    after = decide(p, RUN, first.state, {warmup_id: done}, paused=False, cancel_requested=False)
    assert [c.role for c in after.create] == ["validation"]  # the baseline, of the new step
    (event,) = after.events
    assert event[1]["warmup"] == warmup_id and event[1]["loss"] == 0.7
    failed = child("warmup", 0, status="failed", error={"type": "X", "message": "boom"})
    ended = decide(p, RUN, first.state, {warmup_id: failed}, paused=False, cancel_requested=False)
    assert ended.status == JobStatus.failed and ended.error is not None
    assert "warmup job" in ended.error["message"] and "boom" in ended.error["message"]
