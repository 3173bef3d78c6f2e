"""Reading a job's event stream: Server-Sent Events decoding, and what a job's events say
about where it stands (`Progress`), for `wait(on_progress=...)` and the CLI's bar."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainyard_client.models import EventType, JobEvent, JobStatus


@dataclass(frozen=True)
class ServerSentEvent:
    event: str
    data: str
    id: str | None = None


@dataclass
class SSEDecoder:
    """Server-Sent Events from a stream's lines (WHATWG `text/event-stream` rules: `data`
    lines joined, comments skipped, an event dispatched at a blank line)."""

    _event: str = ""
    _data: list[str] = field(default_factory=list)
    _id: str | None = None

    def feed(self, line: str) -> ServerSentEvent | None:
        if not line:
            if not self._data:
                self._event = ""
                return None
            event = ServerSentEvent(self._event or "message", "\n".join(self._data), self._id)
            self._event, self._data = "", []
            return event
        if line.startswith(":"):
            return None  # a comment: the server's keep-alive ping
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\x00" not in value:
            self._id = value
        return None


# Which status each event leaves a job in (events not listed leave it as it was).
_STATUS_AFTER: dict[str, str] = {
    EventType.job_queued: JobStatus.queued,
    EventType.job_claimed: JobStatus.running,
    EventType.job_retrying: JobStatus.queued,
    EventType.job_released: JobStatus.queued,
    EventType.training_started: JobStatus.running,
    EventType.rollout_started: JobStatus.running,
    EventType.evaluation_started: JobStatus.running,
    EventType.training_ended: JobStatus.succeeded,
    EventType.rollout_ended: JobStatus.succeeded,
    EventType.evaluation_ended: JobStatus.succeeded,
    EventType.training_failed: JobStatus.failed,
    EventType.rollout_failed: JobStatus.failed,
    EventType.evaluation_failed: JobStatus.failed,
    EventType.job_cancelled: JobStatus.cancelled,
    EventType.run_started: JobStatus.running,
    EventType.run_ended: JobStatus.succeeded,
    EventType.run_failed: JobStatus.failed,
}
# Events that move a job along: gradient steps of a training job, answers of a rollout,
# steps of a run (whose total comes as `total_steps`, from its start).
_PROGRESS = {
    EventType.gradient_step,
    EventType.rollout_progress,
    EventType.evaluation_progress,
    EventType.run_step,
}
_TOTAL_KEYS = ("total", "total_steps")
# Metric names, in order of preference, that say a step's reward and loss: ART's LocalBackend
# reports `loss/train` (upstream `loss`), Serverless `train/reward`; rollouts `mean_reward`,
# runs `reward_mean`.
REWARD_KEYS = ("reward", "mean_reward", "reward_mean", "train/reward", "reward/mean")
LOSS_KEYS = ("loss/train", "loss", "train/loss")


def _pick(metrics: Mapping[str, Any], keys: tuple[str, ...], suffix: str) -> float | None:
    for key in keys:
        if isinstance(metrics.get(key), int | float) and not isinstance(metrics[key], bool):
            return float(metrics[key])
    for key, value in metrics.items():
        if key.endswith(suffix) and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


@dataclass(frozen=True)
class Progress:
    """Where a job stands after one of its events.

    `step` of `total`: gradient steps of a training job, answers sampled and graded of a
    rollout job, steps of a run (`total` once known). `reward` and `loss`: the latest
    values any event reported (None until one did). `metrics`: the latest event's metrics.
    """

    job_id: str
    status: str
    step: int
    total: int | None
    reward: float | None
    loss: float | None
    metrics: Mapping[str, Any]
    event: JobEvent

    @property
    def percent(self) -> float | None:
        return 100.0 * self.step / self.total if self.total else None

    @property
    def done(self) -> bool:
        return self.status in {JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled}


@dataclass
class ProgressTracker:
    """Folds a job's events, in order, into its `Progress`."""

    job_id: str
    status: str = JobStatus.queued
    step: int = 0
    total: int | None = None
    reward: float | None = None
    loss: float | None = None

    def update(self, event: JobEvent) -> Progress:
        data = event.data
        metrics = data.get("metrics") if isinstance(data.get("metrics"), dict) else {}
        assert isinstance(metrics, dict)
        self.status = _STATUS_AFTER.get(event.type, self.status)
        if event.type == EventType.job_retrying:
            self.step, self.total = 0, None  # the next attempt starts over
        if event.type in _PROGRESS and isinstance(data.get("step"), int):
            self.step = data["step"]
        if event.type in _PROGRESS or event.type == EventType.run_started:
            for key in _TOTAL_KEYS:
                if isinstance(data.get(key), int):
                    self.total = data[key]
        # A rollout's end and a run's step carry figures beside the metrics, or instead.
        for source in (metrics, data):
            reward = _pick(source, REWARD_KEYS, "reward")
            if reward is not None:
                self.reward = reward
                break
        for source in (metrics, data):
            loss = _pick(source, LOSS_KEYS, "loss")
            if loss is not None:
                self.loss = loss
                break
        return Progress(
            job_id=self.job_id,
            status=self.status,
            step=self.step,
            total=self.total,
            reward=self.reward,
            loss=self.loss,
            metrics=metrics,
            event=event,
        )
