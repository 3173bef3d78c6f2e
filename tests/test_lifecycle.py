"""The job lifecycle's rules, called directly: pure functions, no database."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import get_type_hints

import pytest

from app.jobs.lifecycle import (
    COMMON_EVENTS,
    TRANSITIONS,
    VOCABULARY,
    Cancelled,
    ErrorInfo,
    EventType,
    Failed,
    JobKind,
    JobStatus,
    JobUpdate,
    ModelUpdate,
    Recovered,
    Released,
    Retry,
    Succeeded,
    can_transition,
    events_of,
    landed_step,
    plan,
    retry_or_fail,
)
from app.models import JobRow, ModelRow

NOW = datetime(2026, 12, 3, tzinfo=UTC)
TRANSIENT = ErrorInfo(type="ConnectionError", message="refused", transient=True)
PERMANENT = ErrorInfo(type="ValueError", message="bad tokens", transient=False)
OUTCOMES = [
    Succeeded({"final_step": 1}, job={"final_step": 1}),
    Recovered(0, 1),
    Failed(PERMANENT),
    Retry(TRANSIENT, delay_s=2.0),
    Cancelled("running"),
    Released("w1"),
]


def test_final_statuses_go_nowhere_and_every_status_is_listed() -> None:
    assert set(TRANSITIONS) == set(JobStatus)
    for status in JobStatus:
        assert (TRANSITIONS[status] == frozenset()) is status.is_final
    assert can_transition(JobStatus.queued, JobStatus.running)
    assert not can_transition(JobStatus.queued, JobStatus.succeeded)
    assert not can_transition(JobStatus.cancelled, JobStatus.queued)


def test_each_kind_has_its_own_closed_vocabulary() -> None:
    training, rollout = events_of(JobKind.training), events_of(JobKind.rollout)
    run, evaluation = events_of(JobKind.run), events_of(JobKind.evaluation)
    assert training & rollout == training & run == rollout & run == COMMON_EVENTS
    assert evaluation & training == evaluation & rollout == evaluation & run == COMMON_EVENTS
    assert training | rollout | run | evaluation == set(EventType)
    assert all(e.value.startswith("run_") for e in run - COMMON_EVENTS)
    assert not any(e.value.startswith("training_") for e in rollout)
    assert not any(e.value.startswith("rollout_") for e in training)


@pytest.mark.parametrize("kind", list(JobKind))
@pytest.mark.parametrize("outcome", OUTCOMES, ids=lambda o: type(o).__name__)
def test_every_outcome_plans_one_write_in_its_kinds_words(kind: JobKind, outcome) -> None:
    earlier = [(VOCABULARY[kind].progress, {"step": 1})]
    write = plan(kind, outcome, attempt=2, now=NOW, earlier=earlier)
    assert can_transition(JobStatus.running, write.status)
    assert write.job["status"] is write.status
    assert write.job["lease_token"] is None and write.job["lease_expires_at"] is None
    assert ("finished_at" in write.job) is write.status.is_final
    assert write.events[0] == earlier[0]
    assert {type_ for type_, _ in write.events} <= events_of(kind)
    assert write.unless_cancel_requested is isinstance(outcome, Retry)


def test_what_each_outcome_writes() -> None:
    kind = JobKind.training
    ok = plan(kind, OUTCOMES[0], attempt=1, now=NOW)
    assert (ok.status, ok.events[-1][0]) == (JobStatus.succeeded, EventType.training_ended)
    assert ok.job["error"] is None and ok.job["final_step"] == 1

    recovered = plan(kind, Recovered(3, 4, note="lost reply"), attempt=1, now=NOW)
    assert recovered.events[-1][1] == {
        "start_step": 3,
        "final_step": 4,
        "recovered": True,
        "note": "lost reply",
    }
    assert recovered.model == {"current_step": 4, "step_known": True}
    assert (recovered.job["final_step"], recovered.job["recovered"]) == (4, True)

    retry = plan(kind, Retry(TRANSIENT, 1.5), attempt=2, now=NOW)
    assert retry.status is JobStatus.queued
    assert retry.job["not_before"] == NOW + timedelta(seconds=1.5)
    assert retry.job["lease_owner"] is None and retry.job["error"] == TRANSIENT
    assert retry.events[-1] == (
        EventType.job_retrying,
        {"error": TRANSIENT, "attempt": 2, "delay_s": 1.5},
    )

    released = plan(kind, Released("w1"), attempt=3, now=NOW)
    assert (released.status, released.job["attempts"], released.job["not_before"]) == (
        JobStatus.queued,
        2,  # the lease's attempt is given back
        NOW,
    )

    failed = plan(JobKind.rollout, Failed(PERMANENT, data={"num_graded": 0}), attempt=1, now=NOW)
    assert failed.events[-1] == (
        EventType.rollout_failed,
        {"error": PERMANENT, "attempt": 1, "num_graded": 0},
    )
    cancelled = plan(JobKind.rollout, Cancelled("retrying", error=TRANSIENT), attempt=1, now=NOW)
    assert cancelled.events[-1] == (
        EventType.job_cancelled,
        {"while": "retrying", "error": TRANSIENT},
    )


def test_retry_or_fail() -> None:
    retry = retry_or_fail(TRANSIENT, attempt=1, max_attempts=3, retry_base_seconds=2.0)
    assert isinstance(retry, Retry) and 1.0 <= retry.delay_s <= 2.0
    later = retry_or_fail(TRANSIENT, attempt=2, max_attempts=3, retry_base_seconds=2.0)
    assert isinstance(later, Retry) and 2.0 <= later.delay_s <= 4.0
    assert retry_or_fail(TRANSIENT, attempt=3, max_attempts=3, retry_base_seconds=2.0) == Failed(
        TRANSIENT
    )
    assert retry_or_fail(PERMANENT, attempt=1, max_attempts=3, retry_base_seconds=2.0) == Failed(
        PERMANENT
    )


@pytest.mark.parametrize(
    ("start", "step", "landed"),
    [(None, 5, None), (3, None, None), (3, 3, None), (3, 2, None), (3, 4, 4), (0, 7, 7)],
)
def test_a_landed_step_is_one_the_backend_moved_past_the_start_record(start, step, landed):
    assert landed_step(start, step) == landed


def test_typed_writes_name_real_columns() -> None:
    """A misspelt key in a write fails here (and in mypy), not in the worker's final write."""
    job_columns = set(JobRow.__table__.columns.keys())  # type: ignore[attr-defined]
    model_columns = set(ModelRow.__table__.columns.keys())  # type: ignore[attr-defined]
    assert set(get_type_hints(JobUpdate)) <= job_columns
    assert set(get_type_hints(ModelUpdate)) <= model_columns


def test_the_wire_publishes_event_types_as_an_enum() -> None:
    schema = json.loads((Path(__file__).parents[1] / "openapi.json").read_text())
    event_type = schema["components"]["schemas"]["EventType"]
    assert sorted(event_type["enum"]) == sorted(e.value for e in EventType)
