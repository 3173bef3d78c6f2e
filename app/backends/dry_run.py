"""`dry-run`: an `art.Backend` that checks and counts what it is given but trains nothing.

It keeps steps on disk exactly like ART's LocalBackend (`{path}/{project}/models/{name}/
checkpoints/{step:04d}/`), so a step advanced before a crash is still there after it, and
each checkpoint holds a manifest of the groups that produced it. Use it to wire up an agent
service, to exercise workers and recovery, and to benchmark the queue without a GPU.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from app.backends.base import TOTAL_KEY, report_gradient_step
from app.backends.checkpoints import CheckpointDirs
from app.backends.storage import Shelf

if TYPE_CHECKING:
    import art


class DryRunConfig(BaseModel):
    """Model config of the dry-run backend."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key is a 422, not ignored

    seconds_per_step: float = Field(
        default=0.0, ge=0, le=3600, description="Simulated time of one gradient step."
    )
    seconds_after_step: float = Field(
        default=0.0,
        ge=0,
        le=3600,
        description="Simulated delay between a step's checkpoint landing and `train` "
        "returning, like a trainer whose reply is slow to arrive.",
    )
    fail_with: str | None = Field(
        default=None, description="Fail every training call with this ValueError message."
    )


def _trainable(group: art.TrajectoryGroup) -> bool:
    # ART's rule: advantages are zero unless a group has two trajectories and two rewards.
    return len(group.trajectories) > 1 and len({t.reward for t in group.trajectories}) > 1


def _choice_tokens(trajectory: art.Trajectory) -> int:
    from openai.types.chat.chat_completion import Choice

    tokens = 0
    for item in trajectory.messages_and_choices:
        if isinstance(item, Choice) and item.logprobs and item.logprobs.content:
            tokens += len(item.logprobs.content)
    return tokens


class DryRunBackend(CheckpointDirs):
    """Satisfies `art.Backend` (0.5.18) structurally, as ART's own backends do in 0.5.23."""

    _registered: set[str]

    def __init__(self, path: Path, *, shelf: Shelf | None = None) -> None:
        super().__init__(path, shelf=shelf)
        self._registered = set()

    def _config(self, model: art.Model) -> DryRunConfig:
        config = model.config
        return config if isinstance(config, DryRunConfig) else DryRunConfig()

    async def close(self) -> None:
        return None

    async def register(self, model: art.Model) -> None:
        if self.shelf is None:
            (self._dir(model) / "0000").mkdir(parents=True, exist_ok=True)
        elif model.name not in self._registered:  # step 0 in the store, once per process
            await asyncio.to_thread(self._write_step_zero, model)
            self._registered.add(model.name)

    def _write_step_zero(self, model: art.Model) -> None:
        with self.writing(model, 0, replace=False):
            pass

    async def _prepare_backend_for_training(
        self, model: art.TrainableModel, config: Any = None
    ) -> tuple[str, str]:
        # Nothing is served: a dry run has no weights to sample from.
        return "", ""

    async def train(
        self,
        model: art.TrainableModel,
        trajectory_groups: Iterable[art.TrajectoryGroup],
        **kwargs: Any,
    ) -> art.TrainResult:
        config = self._config(model)
        if config.fail_with:
            raise ValueError(config.fail_with)
        groups = list(trajectory_groups)
        trainable = [g for g in groups if _trainable(g)]
        total = len(trainable)
        metrics: dict[str, float] = {
            "data/step_num_groups_submitted": len(groups),
            "data/step_num_groups_trainable": total,
            "data/step_num_trajectories": sum(len(g.trajectories) for g in groups),
            "data/step_trainer_tokens": sum(_choice_tokens(t) for g in trainable for t in g),
            TOTAL_KEY: total,
        }
        for index in range(total):
            await asyncio.sleep(config.seconds_per_step)
            report_gradient_step({TOTAL_KEY: total, "loss/train": 0.0, "step": index + 1})
        step = self.step_on_disk(model) + 1
        checkpoint = self.location(model, step)
        manifest = {"metrics": metrics, "hyperparameters": kwargs}
        with self.writing(model, step) as partial:
            (partial / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
        await asyncio.sleep(config.seconds_after_step)
        from art.types import LocalTrainResult

        return LocalTrainResult(step=step, metrics=metrics, checkpoint_path=checkpoint)

    async def _train_sft(self, *args: Any, **kwargs: Any) -> AsyncIterator[dict[str, float]]:
        raise NotImplementedError("the dry-run backend does not do SFT")
        yield {}
