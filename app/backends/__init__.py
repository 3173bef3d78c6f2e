"""Trainer backends by name. Adding one is one module and one `BackendSpec` below."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import art
from pydantic import BaseModel, ValidationError

from app.backends.base import BackendError, ModelSpec, TrainerAdapter
from app.backends.dry_run import DryRunBackend, DryRunConfig
from app.backends.hyperparameters import ArtLocalHyperparameters


@dataclass(frozen=True)
class BackendSpec:
    name: str
    description: str
    hyperparameters: type[BaseModel]
    config: type[BaseModel]
    create: Callable[[Path], Any]
    """Builds the `art.Backend` object, given the data directory."""
    trainable_model: Callable[[ModelSpec, BaseModel], art.TrainableModel]


def _dry_run_model(spec: ModelSpec, config: BaseModel) -> art.TrainableModel:
    return art.TrainableModel(
        name=spec.name, project=spec.project, base_model=spec.base_model, config=config
    )


SPECS: dict[str, BackendSpec] = {
    "dry-run": BackendSpec(
        name="dry-run",
        description="Validates, counts and checkpoints what it is given without training "
        "weights; for wiring, demos and benchmarks without a GPU.",
        hyperparameters=ArtLocalHyperparameters,
        config=DryRunConfig,
        create=lambda data_dir: DryRunBackend(data_dir / "dry-run"),
        trainable_model=_dry_run_model,
    ),
}


def validate_config(backend: str, config: dict[str, Any]) -> BaseModel:
    """Raises KeyError for an unknown backend, ValidationError for a bad config."""
    return SPECS[backend].config.model_validate(config)


class Backends:
    """The trainer adapters of this process, created on first use."""

    def __init__(self, data_dir: Path, overrides: dict[str, Any] | None = None) -> None:
        self.data_dir = Path(data_dir)
        self._overrides = overrides or {}
        self._adapters: dict[str, TrainerAdapter] = {}

    def get(self, name: str) -> TrainerAdapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            spec = SPECS.get(name)
            if spec is None:
                raise BackendError(f"unknown backend {name!r}", transient=False)
            backend = self._overrides.get(name) or spec.create(self.data_dir)

            def trainable_model(model: ModelSpec, spec: BackendSpec = spec) -> art.TrainableModel:
                return spec.trainable_model(model, spec.config.model_validate(model.config))

            adapter = TrainerAdapter(
                name, backend, hyperparameters=spec.hyperparameters, model_factory=trainable_model
            )
            self._adapters[name] = adapter
        return adapter

    @property
    def active(self) -> dict[str, TrainerAdapter]:
        return dict(self._adapters)

    async def close(self) -> None:
        for adapter in self._adapters.values():
            await adapter.close()
        self._adapters.clear()


__all__ = ["SPECS", "BackendError", "BackendSpec", "Backends", "ModelSpec", "ValidationError"]
