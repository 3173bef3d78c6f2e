"""Checkpoint directories laid out like ART's LocalBackend's, shared by our own backends:
`{path}/{project}/models/{name}/checkpoints/{step:04d}/`; the step is the newest one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import art


class CheckpointDirs:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def _dir(self, model: art.Model) -> Path:
        return self.path / model.project / "models" / model.name / "checkpoints"

    def step_on_disk(self, model: art.Model) -> int:
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

    async def _delete_checkpoint_files(
        self, model: art.TrainableModel, steps_to_keep: list[int]
    ) -> None:
        for path in self._dir(model).glob("[0-9]*"):
            if path.name.isdigit() and int(path.name) not in steps_to_keep:
                shutil.rmtree(path, ignore_errors=True)
