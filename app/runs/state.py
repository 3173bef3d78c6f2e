"""A run's schedule state: typed, versioned, and read back from every format written.

`runs.state` holds one `RunState` as JSON. `encode` writes the current format (`FORMAT`);
`decode` reads it and every earlier one, so a run in flight during an upgrade keeps
going: format 1 (the untyped dict the first release of runs wrote, without a `format`
key) decodes to the same state. A format newer than this code knows is refused, not
guessed at: an older worker must not advance a run a newer one wrote.

Pure: no database, no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["rollout", "training", "validation", "warmup"]
Phase = Literal["queued", "warmup", "validation", "rollout", "training", "done"]

FORMAT = 2
_ROLES = ("rollout", "training", "validation", "warmup")


class StateFormatError(ValueError):
    """A stored state this code cannot read (a newer format, or a malformed row)."""


@dataclass
class RunState:
    """Where a run is in its schedule (`app.runs.schedule` moves it; the driver stores it)."""

    step: int = 0  # steps trained
    epoch: int = 0  # 0-based epoch of the next step
    epochs: int | None = None
    epoch_start: int = 0  # steps trained before this epoch
    order: list[int] = field(default_factory=list)  # this epoch's examples, in order
    excluded: list[int] = field(default_factory=list)  # by the curriculum, for later epochs
    # example index -> epochs in a row its group was all one reward
    uniform: dict[str, int] = field(default_factory=dict)
    total_steps: int = 0
    phase: Phase = "rollout"
    waiting: tuple[Role, int] | None = None  # the child the run waits on
    validations: int = 0
    # step -> its rollout's figures, until its training ends
    sampled: dict[str, dict[str, Any]] = field(default_factory=dict)
    best: dict[str, Any] | None = None  # {"step", "score"}
    reference: float | None = None  # best score for patience (improved by min_delta)
    since_best: int = 0
    stop_reason: str | None = None
    start_step: int | None = None  # the model's step when the run started
    metric_seq: int = 0  # the last run metric's sequence number

    def encode(self) -> dict[str, Any]:
        """The JSON stored in `runs.state`, in the current format."""
        data = dataclasses.asdict(self)
        data["waiting"] = list(self.waiting) if self.waiting is not None else None
        return {"format": FORMAT, **data}


_FIELDS = {f.name for f in dataclasses.fields(RunState)}


def decode(raw: dict[str, Any] | None) -> RunState:
    """A stored state, of any format this code knows."""
    if not raw:
        return RunState()
    version = raw.get("format", 1)
    if not isinstance(version, int) or version < 1:
        raise StateFormatError(f"run state has an unreadable format {version!r}")
    if version > FORMAT:
        raise StateFormatError(
            f"run state format {version} is newer than this version reads ({FORMAT}): "
            "upgrade this worker"
        )
    # Format 1 holds the same keys without `format` (`start_step` and `metric_seq` were
    # added once the run had started); format 2 adds `format` alone.
    values = {key: value for key, value in raw.items() if key in _FIELDS}
    waiting = values.get("waiting")
    if waiting is not None:
        role, step = waiting
        if role not in _ROLES:
            raise StateFormatError(f"run state waits on an unknown role {role!r}")
        values["waiting"] = (role, int(step))
    try:
        return RunState(**values)
    except TypeError as exc:  # pragma: no cover - a key of the right name, wrong shape
        raise StateFormatError(f"run state is malformed: {exc}") from exc
