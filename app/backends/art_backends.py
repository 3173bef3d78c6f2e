"""ART's own backends: `art-local` (LocalBackend on a CUDA host) and `art-serverless`.

Neither can run on a machine without a GPU or W&B credentials; each fails with a clear,
permanent error naming what is missing, and the job that asked for it fails with it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, model_validator

from app.backends.base import BackendError, ModelSpec, trainable_model

if TYPE_CHECKING:
    import art

GPU_HINT = (
    "art-local runs ART's LocalBackend: it needs a CUDA GPU and the gpu extra "
    "(`pip install '.[gpu]'`, or the docker/Dockerfile.gpu image)"
)


class ArtLocalConfig(BaseModel):
    """ART's `_internal_config` (`art.dev.InternalModelConfig`): init_args, engine_args, ..."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _known_keys(self) -> ArtLocalConfig:
        if not self.model_extra:
            return self
        # Only a config with keys needs ART's list of them (importing ART takes seconds).
        from art.dev import InternalModelConfig

        known = set(InternalModelConfig.__annotations__)
        unknown = set(self.model_extra) - known
        if unknown:
            raise ValueError(
                f"unknown keys {sorted(unknown)}; ART's InternalModelConfig has {sorted(known)}"
            )
        return self


class ArtServerlessConfig(BaseModel):
    """ServerlessBackend models take no config."""

    model_config = ConfigDict(extra="forbid")


def local_unavailable() -> str | None:
    """Why art-local cannot run in this process (None: it can)."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("unsloth") is None:
        return GPU_HINT
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device is visible; {GPU_HINT}"
    return None


def create_local(data_dir: Path) -> Any:
    refusal = local_unavailable()
    if refusal is not None:
        raise BackendError(refusal, transient=False)
    from art.local import LocalBackend

    return LocalBackend(path=str(data_dir / "art"))


def local_model(spec: ModelSpec, config: BaseModel) -> art.TrainableModel:
    internal = config.model_dump(exclude_unset=True) or None
    return trainable_model(spec, _internal_config=internal)


def serverless_unavailable() -> str | None:
    """Why art-serverless cannot run in this process (None: it can)."""
    if not os.environ.get("WANDB_API_KEY"):
        return "art-serverless trains on W&B's serverless service: set WANDB_API_KEY"
    if importlib.util.find_spec("wandb") is None:
        # openpipe-art 0.5.18's ServerlessBackend.train imports wandb unconditionally.
        return "art-serverless needs the wandb package: pip install wandb"
    return None


def create_serverless(_data_dir: Path) -> Any:
    refusal = serverless_unavailable()
    if refusal is not None:
        raise BackendError(refusal, transient=False)
    import art

    return art.ServerlessBackend()


def serverless_model(spec: ModelSpec, _config: BaseModel) -> art.TrainableModel:
    return trainable_model(spec)
