"""Checkpoint directories laid out like ART's LocalBackend's, shared by our own backends:
`{path}/{project}/models/{name}/checkpoints/{step:04d}/`; the step is the newest one.

A model's name and project say where its checkpoints are, so they are found and deleted
from an `art.Model` or from a `ModelSpec` alike: an API process lists and deletes them
without importing ART."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import art


class Named(Protocol):
    """What a checkpoint's place needs of a model (`art.Model` and `ModelSpec` have it)."""

    @property
    def name(self) -> str: ...

    @property
    def project(self) -> str: ...


class CheckpointDirs:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def _dir(self, model: Named) -> Path:
        return self.path / model.project / "models" / model.name / "checkpoints"

    def checkpoints_dir(self, model: Named) -> Path:
        """Where the model's checkpoints live: one `{step:04d}` directory per step."""
        return self._dir(model)

    @contextmanager
    def writing(self, model: Named, step: int, *, replace: bool = True) -> Iterator[Path]:
        """Write `step`'s checkpoint: into a hidden directory beside the others, renamed
        into place once complete. A reader never sees a step whose files are still being
        written: not another worker's `step_on_disk` (a rollout would sample a step its
        server cannot load yet), not a recovery deciding whether a step landed, not a
        server loading the newest adapter. `replace=False`: a step another process put in
        place meanwhile is kept, and this one dropped. A crash mid-write leaves the hidden
        directory (`.NNNN.partial-…`), which nothing reads."""
        final = self._dir(model) / f"{step:04d}"
        partial = final.with_name(f".{final.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        partial.mkdir(parents=True)
        try:
            yield partial
            if final.exists():
                if not replace:
                    shutil.rmtree(partial, ignore_errors=True)
                    return
                shutil.rmtree(final, ignore_errors=True)  # a step written again, as a whole
            os.rename(partial, final)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise

    def step_on_disk(self, model: Named) -> int:
        # scandir, not Path.glob: read before and after every step, and glob builds a
        # Path and matches a pattern per entry (~3x slower on 50 checkpoints).
        try:
            with os.scandir(self._dir(model)) as entries:
                return max((int(e.name) for e in entries if e.name.isdigit()), default=0)
        except FileNotFoundError:
            return 0

    def _model_inference_name(self, model: art.Model, step: int | None = None) -> str:
        return f"{model.name}@{self.step_on_disk(model) if step is None else step}"

    async def _get_step(self, model: art.TrainableModel) -> int:
        return self.step_on_disk(model)

    async def _delete_checkpoint_files(self, model: Named, steps_to_keep: list[int]) -> None:
        """Delete every checkpoint not in `steps_to_keep`, except those newer than all of
        them: a step newer than every kept one is being written right now (a job trains
        while the caller decided), and is never deleted."""
        newest_kept = max(steps_to_keep, default=-1)
        for path in self._dir(model).glob("[0-9]*"):
            if not path.name.isdigit():
                continue
            step = int(path.name)
            if step not in steps_to_keep and step < newest_kept:
                shutil.rmtree(path, ignore_errors=True)
