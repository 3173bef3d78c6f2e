"""The job lifecycle in one screen: kinds, statuses, the closed event vocabulary, the
allowed transitions, and the outcomes a job's run can have.

Pure: no database, no I/O. Code that runs a job computes an `Outcome`; `plan` turns it
into the one final write (`FinalWrite`) that `app.jobs.store` applies under the lease
token. Nothing else writes a status or an event type.

```
            claim              Succeeded | Recovered
  queued ──────────▶ running ───────────────────────▶ succeeded
    │  ▲               │ │ │    Failed
    │  └── Retry ──────┘ │ └───────────────────────▶ failed
    │  └── Released ─────┘      Cancelled
    └────────────────────────────────────────────────▶ cancelled
           cancel (while queued)
```
"""

from __future__ import annotations

import enum
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeAlias, TypedDict


class JobKind(enum.StrEnum):
    training = "training"
    rollout = "rollout"
    # Sample a fixed step and score the answers, training nothing (`app.evaluations`).
    evaluation = "evaluation"
    # A training run: a schedule of rollout, training and validation jobs (`app.runs`).
    # Its row holds no lease and no model slot: a driver advances it between its children.
    run = "run"


class JobStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in FINAL_STATUSES


FINAL_STATUSES = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})

TRANSITIONS: Mapping[JobStatus, frozenset[JobStatus]] = {
    JobStatus.queued: frozenset({JobStatus.running, JobStatus.cancelled}),
    # queued again: a retry after a transient error, or a release at shutdown
    JobStatus.running: frozenset(
        {JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled, JobStatus.queued}
    ),
    JobStatus.succeeded: frozenset(),
    JobStatus.failed: frozenset(),
    JobStatus.cancelled: frozenset(),
}


def can_transition(current: JobStatus, target: JobStatus) -> bool:
    return target in TRANSITIONS[current]


class EventType(enum.StrEnum):
    """Every event a job's history can hold: the common ones and each kind's own."""

    # Any kind of job
    job_queued = "job_queued"
    job_claimed = "job_claimed"
    job_retrying = "job_retrying"
    job_released = "job_released"
    cancel_requested = "cancel_requested"
    job_cancelled = "job_cancelled"
    # Training jobs
    training_started = "training_started"
    gradient_step = "gradient_step"
    training_ended = "training_ended"
    training_failed = "training_failed"
    # Rollout jobs
    rollout_started = "rollout_started"
    rollout_progress = "rollout_progress"
    rollout_ended = "rollout_ended"
    rollout_failed = "rollout_failed"
    # Evaluation jobs
    evaluation_started = "evaluation_started"
    evaluation_progress = "evaluation_progress"
    evaluation_ended = "evaluation_ended"
    evaluation_failed = "evaluation_failed"
    # Training runs
    run_started = "run_started"
    run_step = "run_step"
    run_ended = "run_ended"
    run_failed = "run_failed"
    run_validated = "run_validated"
    run_paused = "run_paused"
    run_resumed = "run_resumed"


@dataclass(frozen=True)
class Vocabulary:
    """The events of one kind's run: its start, progress, end and failure."""

    started: EventType
    progress: EventType
    ended: EventType
    failed: EventType
    extra: frozenset[EventType] = frozenset()


VOCABULARY: Mapping[JobKind, Vocabulary] = {
    JobKind.training: Vocabulary(
        EventType.training_started,
        EventType.gradient_step,
        EventType.training_ended,
        EventType.training_failed,
    ),
    JobKind.rollout: Vocabulary(
        EventType.rollout_started,
        EventType.rollout_progress,
        EventType.rollout_ended,
        EventType.rollout_failed,
    ),
    JobKind.evaluation: Vocabulary(
        EventType.evaluation_started,
        EventType.evaluation_progress,
        EventType.evaluation_ended,
        EventType.evaluation_failed,
    ),
    JobKind.run: Vocabulary(
        EventType.run_started,
        EventType.run_step,
        EventType.run_ended,
        EventType.run_failed,
        frozenset({EventType.run_validated, EventType.run_paused, EventType.run_resumed}),
    ),
}
COMMON_EVENTS = frozenset(
    {
        EventType.job_queued,
        EventType.job_claimed,
        EventType.job_retrying,
        EventType.job_released,
        EventType.cancel_requested,
        EventType.job_cancelled,
    }
)


def events_of(kind: JobKind) -> frozenset[EventType]:
    """The closed vocabulary of one kind of job."""
    words = VOCABULARY[kind]
    return COMMON_EVENTS | words.extra | {words.started, words.progress, words.ended, words.failed}


Event: TypeAlias = tuple[EventType, dict[str, Any]]


# -- typed writes ---------------------------------------------------------------------------


class JobUpdate(TypedDict, total=False):
    """Columns of `jobs` a write may set (keys are column names)."""

    status: JobStatus
    lease_token: str | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    not_before: datetime
    attempts: int
    start_step: int | None
    progress_step: int
    progress_total: int | None
    final_step: int | None
    checkpoint_path: str | None
    metrics: dict[str, Any] | None
    error: ErrorInfo | None
    recovered: bool
    trained: bool | None
    output: bytes | None
    output_bytes: int | None
    next_job_id: str | None
    finished_at: datetime | None
    # What the job used (migration 0016): tokens sampled, tokens trained. Each is what one
    # attempt used, added to what earlier attempts did (`ADDED_COLUMNS`).
    prompt_tokens: int | None
    completion_tokens: int | None
    trained_tokens: int | None
    # An attempt sent back to the queue (`Retry`, `Released`): `attempts` after the write.
    # The write also adds the attempt's seconds to `earlier_seconds` (migration 0018).
    returned_at_attempt: int


ADDED_COLUMNS = frozenset({"prompt_tokens", "completion_tokens", "trained_tokens"})
"""A job's columns that a write adds to rather than sets: what an attempt used counts with
what earlier attempts used (a retried or cancelled rollout sampled tokens too)."""


class ModelUpdate(TypedDict, total=False):
    """Columns of `models` a job's write may set."""

    current_step: int
    step_known: bool
    inference_base_url: str | None
    inference_model_name: str | None
    inference_api_key: str | None


class ErrorInfo(TypedDict):
    """A job's error, as stored and shown (`JobError` on the wire)."""

    type: str
    message: str
    transient: bool


# -- outcomes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Succeeded:
    """The run did its work. `data`: the end event's; `job`: the result columns."""

    data: dict[str, Any]
    job: JobUpdate = field(default_factory=lambda: JobUpdate())
    model: ModelUpdate | None = None
    child: NewJob | None = None  # a job this one enqueues, in the same write


@dataclass(frozen=True)
class Recovered:
    """A training step landed although the call that trained it never said so (lost
    reply, late cancel, dead worker): the job succeeded, the step counts once."""

    start_step: int
    final_step: int
    note: str | None = None
    model: ModelUpdate = field(default_factory=lambda: ModelUpdate())
    job: JobUpdate = field(default_factory=lambda: JobUpdate())


@dataclass(frozen=True)
class Failed:
    error: ErrorInfo
    data: dict[str, Any] = field(default_factory=dict)
    job: JobUpdate = field(default_factory=lambda: JobUpdate())


@dataclass(frozen=True)
class Retry:
    """Queue the job again after `delay_s` (unless a cancel was asked meanwhile). `job`:
    columns the attempt leaves (the tokens it sampled, `ADDED_COLUMNS`)."""

    error: ErrorInfo
    delay_s: float
    job: JobUpdate = field(default_factory=lambda: JobUpdate())


@dataclass(frozen=True)
class Cancelled:
    while_: str  # "running", "retrying", "recovering"
    data: dict[str, Any] = field(default_factory=dict)
    error: ErrorInfo | None = None
    model: ModelUpdate | None = None
    job: JobUpdate = field(default_factory=lambda: JobUpdate())  # e.g. the tokens it sampled


@dataclass(frozen=True)
class Released:
    """Handed back at shutdown before it did anything: queued again, at once, with the
    attempt not counted."""

    worker: str


Outcome: TypeAlias = Succeeded | Recovered | Failed | Retry | Cancelled | Released


@dataclass(frozen=True)
class NewJob:
    """A job row to insert, queued. Built by `app.jobs.store.new_job` for every creator."""

    id: str
    kind: JobKind
    model_name: str
    payload: bytes
    payload_format: str
    payload_bytes: int
    hyperparameters: dict[str, Any]
    metadata: dict[str, Any]
    summary: dict[str, Any]
    request_hash: str
    max_attempts: int
    created_at: datetime
    idempotency_key: str | None = None
    policy_step: int | None = None
    max_steps_off_policy: int | None = None
    queued_event: dict[str, Any] = field(default_factory=dict)
    submitted: bool = False  # through the API (`app.jobs.service.enqueue_once`)
    key_id: str | None = None  # the API key that submitted it (`enqueue_once`)


# -- rules ----------------------------------------------------------------------------------


def backoff_seconds(attempt: int, base: float) -> float:
    """Exponential backoff with jitter: uniform in [c/2, c] where c = base * 2^(attempt-1)."""
    ceiling = base * 2 ** max(attempt - 1, 0)
    return random.uniform(ceiling / 2, ceiling)


def retry_or_fail(
    error: ErrorInfo, *, attempt: int, max_attempts: int, retry_base_seconds: float
) -> Retry | Failed:
    """A transient error with attempts left is retried after a backoff; anything else fails."""
    if error["transient"] and attempt < max_attempts:
        return Retry(error, backoff_seconds(attempt, retry_base_seconds))
    return Failed(error)


def landed_step(start_step: int | None, step: int | None) -> int | None:
    """The backend's step if a step landed since the job recorded where it started, else
    None. Whatever ended the call, a landed step is counted once and never trained again."""
    if start_step is None or step is None or step <= start_step:
        return None
    return step


# -- planning the final write ---------------------------------------------------------------


@dataclass(frozen=True)
class FinalWrite:
    """One guarded write that ends a run: the job's columns, its events (numbered by the
    store), the model's columns, a child job."""

    status: JobStatus
    job: JobUpdate
    events: tuple[Event, ...]
    model: ModelUpdate | None = None
    child: NewJob | None = None
    unless_cancel_requested: bool = False


def plan(
    kind: JobKind,
    outcome: Outcome,
    *,
    attempt: int,
    now: datetime,
    earlier: Sequence[Event] = (),
) -> FinalWrite:
    """The write that applies `outcome` to a running job of `kind`."""
    words = VOCABULARY[kind]
    status, job, event, model, child, guard = _plan(words, outcome, attempt, now)
    if not can_transition(JobStatus.running, status):
        raise AssertionError(f"running -> {status} is no transition")
    columns = JobUpdate(status=status, lease_token=None, lease_expires_at=None)
    if status.is_final:
        columns["finished_at"] = now
    columns.update(job)
    return FinalWrite(status, columns, (*earlier, event), model, child, guard)


_Planned: TypeAlias = tuple[JobStatus, JobUpdate, Event, ModelUpdate | None, "NewJob | None", bool]


def _plan(words: Vocabulary, outcome: Outcome, attempt: int, now: datetime) -> _Planned:
    match outcome:
        case Succeeded(data, job, model, child):
            return (
                JobStatus.succeeded,
                _with(JobUpdate(error=None), job),
                (words.ended, data),
                model,
                child,
                False,
            )
        case Recovered(start_step, final_step, note, model, job):
            ended: dict[str, Any] = {"start_step": start_step, "final_step": final_step}
            ended["recovered"] = True
            if note is not None:
                ended["note"] = note
            columns = _with(JobUpdate(final_step=final_step, recovered=True, error=None), job)
            steps = ModelUpdate(current_step=final_step, step_known=True)
            steps.update(model)
            return JobStatus.succeeded, columns, (words.ended, ended), steps, None, False
        case Failed(error, data, job):
            event = (words.failed, {"error": error, "attempt": attempt, **data})
            return JobStatus.failed, _with(JobUpdate(error=error), job), event, None, None, False
        case Retry(error, delay_s, job):
            columns = JobUpdate(
                error=error,
                not_before=now + timedelta(seconds=delay_s),
                lease_owner=None,
                returned_at_attempt=attempt,
            )
            data = {"error": error, "attempt": attempt, "delay_s": round(delay_s, 3)}
            return (
                JobStatus.queued,
                _with(columns, job),
                (EventType.job_retrying, data),
                None,
                None,
                True,
            )
        case Cancelled(while_, data, error, model, job):
            columns = JobUpdate() if error is None else JobUpdate(error=error)
            columns.update(job)
            data = {"while": while_, **data} | ({"error": error} if error else {})
            return (
                JobStatus.cancelled,
                columns,
                (EventType.job_cancelled, data),
                model,
                None,
                False,
            )
        case Released(worker):
            # The token held until now: `attempts` counted this lease; give it back.
            columns = JobUpdate(
                lease_owner=None,
                not_before=now,
                attempts=attempt - 1,
                returned_at_attempt=attempt - 1,
            )
            event = (EventType.job_released, {"worker": worker})
            return JobStatus.queued, columns, event, None, None, False
    raise AssertionError(f"unknown outcome {outcome!r}")


def _with(columns: JobUpdate, more: JobUpdate) -> JobUpdate:
    columns.update(more)
    return columns


# -- runs -----------------------------------------------------------------------------------
#
# A run (kind `run`) has no lease: a driver advances it between its children, and routes
# pause, resume and cancel it. Its status is its job row's, with `paused` (a column of its
# `runs` row) read as a status of its own. Every change of it is planned here, from a
# `RunMove`, into one `RunWrite` that `app.jobs.runs` applies under the run's version.
#
#   queued ──▶ running ◀──▶ paused          (pause / resume; a child under way finishes)
#     │   └──────┐  │          │
#     ▼          ▼  ▼          ▼
#  cancelled   succeeded | failed | cancelled


class RunStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    paused = "paused"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def is_final(self) -> bool:
        return JobStatus(self.value).is_final if self is not RunStatus.paused else False


RUN_TRANSITIONS: Mapping[RunStatus, frozenset[RunStatus]] = {
    # A queued run can be paused: it starts paused and creates no child until resumed.
    RunStatus.queued: frozenset({RunStatus.running, RunStatus.paused, RunStatus.cancelled}),
    RunStatus.running: frozenset(
        {RunStatus.paused, RunStatus.succeeded, RunStatus.failed, RunStatus.cancelled}
    ),
    # Paused, the child under way still ends: it can fail the run, or a cancel end it.
    RunStatus.paused: frozenset(
        {RunStatus.running, RunStatus.succeeded, RunStatus.failed, RunStatus.cancelled}
    ),
    RunStatus.succeeded: frozenset(),
    RunStatus.failed: frozenset(),
    RunStatus.cancelled: frozenset(),
}


def run_status(status: JobStatus, paused: bool) -> RunStatus:
    """A run's lifecycle status from its job row's status and its `paused` flag."""
    if paused and not status.is_final:
        return RunStatus.paused
    return RunStatus(status.value)


class RunTransitionError(Exception):
    """A move the run's lifecycle does not allow from where it is (a caller's bug, or a
    route's conflict: a final run cannot be paused)."""


@dataclass(frozen=True)
class RunMetric:
    """One point of a run's curves (`run_metrics`): a step's figures or a validation's."""

    kind: str  # "step" | "validation"
    step: int
    data: dict[str, Any]


@dataclass(frozen=True)
class RunMove:
    """What one decision of a run's driver changes. `state`: the schedule's new state, as
    stored; `start_step`: the model's step, when the run starts with this move; `ends`:
    its final status (with `error` when it failed); `children`: jobs it enqueues (ones
    that exist already are kept); `cancel`: children it cancels."""

    state: dict[str, Any]
    step: int
    total_steps: int
    start_step: int | None = None
    ends: JobStatus | None = None
    error: ErrorInfo | None = None
    end_data: dict[str, Any] = field(default_factory=dict)
    events: tuple[Event, ...] = ()
    metrics: tuple[RunMetric, ...] = ()
    children: tuple[NewJob, ...] = ()
    cancel: tuple[str, ...] = ()
    waiting_on: str | None = None


@dataclass(frozen=True)
class RunWrite:
    """One guarded write of a run: its job row's columns, its `runs` row's, its events
    (numbered by the store), its metrics, the children to enqueue and to cancel."""

    status: RunStatus
    job: dict[str, Any]
    run: dict[str, Any]
    events: tuple[Event, ...]
    metrics: tuple[RunMetric, ...] = ()
    children: tuple[NewJob, ...] = ()
    cancel: tuple[str, ...] = ()


def _check_run(current: RunStatus, target: RunStatus) -> None:
    if target is not current and target not in RUN_TRANSITIONS[current]:
        raise RunTransitionError(f"a {current.value} run cannot become {target.value}")


def plan_run(current: RunStatus, move: RunMove, *, now: datetime) -> RunWrite:
    """The write that applies a driver's `move` to a run that is `current`."""
    if current.is_final:
        raise RunTransitionError(f"run already {current.value}; it does not move")
    status = current
    job: dict[str, Any] = {
        "progress_step": move.step,
        "progress_total": move.total_steps,
        "updated_at": now,
    }
    run: dict[str, Any] = {"state": move.state, "waiting_on": move.waiting_on}
    events: list[Event] = []
    if current is RunStatus.queued and move.start_step is None:
        raise RunTransitionError("a queued run starts with the model's step")
    if move.start_step is not None:
        if current not in (RunStatus.queued, RunStatus.paused):
            raise RunTransitionError(f"a {current.value} run cannot start")
        target = RunStatus.paused if current is RunStatus.paused else RunStatus.running
        _check_run(current, target)
        status = target
        job |= {"status": JobStatus.running, "started_at": now}
        data = {"total_steps": move.total_steps, "start_step": move.start_step}
        events.append((EventType.run_started, data))
    events.extend(move.events)
    if move.ends is not None:
        target = RunStatus(move.ends.value)
        _check_run(status, target)
        status = target
        job |= {"status": move.ends, "finished_at": now}
        run["paused"] = False  # an ended run is not paused, whatever it was
        events.append(_run_end_event(move))
        if move.error is not None:
            job["error"] = move.error
    return RunWrite(status, job, run, tuple(events), move.metrics, move.children, move.cancel)


def plan_pause(current: RunStatus, *, paused: bool, step: int) -> RunWrite | None:
    """Pause or resume a run that is `current`; None: it already is as asked."""
    if current.is_final:
        verb = "paused" if paused else "resumed"
        raise RunTransitionError(f"run already {current.value}; it cannot be {verb}")
    if (current is RunStatus.paused) == paused:
        return None
    target = RunStatus.paused if paused else RunStatus.running
    _check_run(current, target)
    event = EventType.run_paused if paused else EventType.run_resumed
    return RunWrite(target, {}, {"paused": paused}, ((event, {"step": step}),))


def _run_end_event(move: RunMove) -> Event:
    data = move.end_data
    if move.ends is JobStatus.failed:
        error = move.error or ErrorInfo(type="Failed", message="", transient=False)
        return EventType.run_failed, {**data, "error": error}
    if move.ends is JobStatus.cancelled:
        return EventType.job_cancelled, {"while": "running", **data}
    return EventType.run_ended, data
