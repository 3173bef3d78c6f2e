"""A run's lifecycle (pure): its statuses and transitions, the writes planned from a
driver's move or a pause, and its state's formats, read back from every one written."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from app.jobs.lifecycle import (
    RUN_TRANSITIONS,
    EventType,
    JobStatus,
    RunMove,
    RunStatus,
    RunTransitionError,
    plan_pause,
    plan_run,
    run_status,
)
from app.runs.state import FORMAT, RunState, StateFormatError, decode

NOW = datetime(2026, 12, 5, tzinfo=UTC)

# A state as the first release of runs stored it (format 1): no `format` key, `waiting`
# a list, `start_step` and `metric_seq` added once the run had started.
FORMAT_1: dict[str, Any] = {
    "step": 3,
    "epoch": 1,
    "epochs": 2,
    "epoch_start": 2,
    "order": [3, 0, 2, 1],
    "excluded": [],
    "uniform": {"0": 1},
    "total_steps": 4,
    "phase": "training",
    "waiting": ["training", 4],
    "validations": 2,
    "sampled": {"4": {"reward_mean": 0.5}},
    "best": {"step": 2, "score": 0.75},
    "reference": 0.75,
    "since_best": 1,
    "stop_reason": None,
    "start_step": 7,
    "metric_seq": 5,
}


def test_a_format_1_state_reads_as_the_same_state_and_is_written_as_the_current() -> None:
    state = decode(FORMAT_1)
    assert state.waiting == ("training", 4) and state.step == 3 and state.start_step == 7
    assert state.sampled == {"4": {"reward_mean": 0.5}} and state.best == FORMAT_1["best"]
    encoded = state.encode()
    assert encoded["format"] == FORMAT == 2
    assert {k: v for k, v in encoded.items() if k != "format"} == FORMAT_1
    assert decode(encoded) == state


def test_a_format_1_state_of_a_run_not_yet_started_reads_with_defaults() -> None:
    early = {k: v for k, v in FORMAT_1.items() if k not in ("start_step", "metric_seq")}
    state = decode(early)
    assert state.start_step is None and state.metric_seq == 0


@pytest.mark.parametrize(
    "raw, message",
    [
        ({**FORMAT_1, "format": 3}, "newer than this version reads"),
        ({**FORMAT_1, "format": "2"}, "unreadable format"),
        ({**FORMAT_1, "waiting": ["sleeping", 1]}, "unknown role"),
    ],
)
def test_a_state_this_version_cannot_read_is_refused_not_guessed(raw: Any, message: str) -> None:
    with pytest.raises(StateFormatError, match=message):
        decode(raw)


def test_run_status_reads_paused_as_a_status_until_the_run_ends() -> None:
    assert run_status(JobStatus.running, True) is RunStatus.paused
    assert run_status(JobStatus.queued, True) is RunStatus.paused
    assert run_status(JobStatus.cancelled, True) is RunStatus.cancelled
    assert run_status(JobStatus.running, False) is RunStatus.running
    for final in (RunStatus.succeeded, RunStatus.failed, RunStatus.cancelled):
        assert RUN_TRANSITIONS[final] == frozenset() and final.is_final
    assert not RunStatus.paused.is_final


def move(**changes: Any) -> RunMove:
    return RunMove(**{"state": RunState().encode(), "step": 1, "total_steps": 4, **changes})


def test_a_queued_run_starts_with_its_model_step_and_the_start_event_first() -> None:
    step = (EventType.run_step, {"step": 1})
    write = plan_run(RunStatus.queued, move(start_step=7, events=(step,)), now=NOW)
    assert write.status is RunStatus.running and write.job["status"] is JobStatus.running
    assert [e[0] for e in write.events] == [EventType.run_started, EventType.run_step]
    assert write.events[0][1] == {"total_steps": 4, "start_step": 7}
    with pytest.raises(RunTransitionError):
        plan_run(RunStatus.queued, move(), now=NOW)  # no start step
    with pytest.raises(RunTransitionError):
        plan_run(RunStatus.running, move(start_step=3), now=NOW)  # started twice
    # A run paused before it started starts paused.
    assert plan_run(RunStatus.paused, move(start_step=0), now=NOW).status is RunStatus.paused


@pytest.mark.parametrize(
    "ends, event",
    [
        (JobStatus.succeeded, EventType.run_ended),
        (JobStatus.failed, EventType.run_failed),
        (JobStatus.cancelled, EventType.job_cancelled),
    ],
)
def test_a_run_that_ends_is_no_longer_paused(ends: JobStatus, event: EventType) -> None:
    write = plan_run(RunStatus.paused, move(ends=ends, end_data={"step": 1}), now=NOW)
    assert write.status.value == ends.value and write.run["paused"] is False
    assert write.job["finished_at"] == NOW and write.events[-1][0] is event


def test_pause_and_resume_are_planned_and_a_final_run_refuses_both() -> None:
    paused = plan_pause(RunStatus.running, paused=True, step=2)
    assert paused is not None and paused.run == {"paused": True}
    assert paused.events == ((EventType.run_paused, {"step": 2}),)
    assert plan_pause(RunStatus.paused, paused=True, step=2) is None  # already
    resumed = plan_pause(RunStatus.paused, paused=False, step=2)
    assert resumed is not None and resumed.status is RunStatus.running
    for final in (RunStatus.succeeded, RunStatus.failed, RunStatus.cancelled):
        with pytest.raises(RunTransitionError, match=f"already {final.value}"):
            plan_pause(final, paused=True, step=2)
        with pytest.raises(RunTransitionError):
            plan_run(final, move(ends=JobStatus.succeeded), now=NOW)
