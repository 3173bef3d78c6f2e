"""Trainer backends by name. Adding one is one module and one `BackendSpec` below."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from app.backends import art_backends
from app.backends.admission import Admission
from app.backends.base import BackendError, ModelSpec, TrainerAdapter, trainable_model
from app.backends.cpu import CpuBackend, CpuConfig, CpuDpoHyperparameters, CpuHyperparameters
from app.backends.dry_run import DryRunBackend, DryRunConfig
from app.backends.hyperparameters import (
    ArtLocalHyperparameters,
    ArtServerlessHyperparameters,
    SftHyperparameters,
)
from app.backends.storage import Storage
from app.settings import Settings

if TYPE_CHECKING:
    import art


@dataclass(frozen=True)
class BackendSpec:
    name: str
    description: str
    hyperparameters: type[BaseModel]
    config: type[BaseModel]
    create: Callable[[Settings], Any]
    """Builds the `art.Backend` object; raises BackendError when it cannot run here."""
    trainable_model: Callable[[ModelSpec, BaseModel], art.TrainableModel]
    serves: bool = False
    """Whether the backend serves models for inference from the worker's process."""
    unavailable: Callable[[], str | None] = lambda: None
    """Why this process cannot run the backend (None: it can), checked without building
    it; a worker not told its backends runs those it can."""
    other_methods: Mapping[str, type[BaseModel]] = field(default_factory=dict)
    """The training methods it offers beside `rl` (`sft`, `dpo`), with their keywords."""
    refusals: Mapping[str, str] = field(default_factory=dict)
    """Why it does not offer a method, where there is more to say than that it does not."""

    def method_hyperparameters(self, method: str) -> type[BaseModel] | None:
        """The keywords a job of `method` takes; None: the backend does not train so."""
        return self.hyperparameters if method == "rl" else self.other_methods.get(method)

    def methods(self) -> list[str]:
        return ["rl", *self.other_methods]


def _dry_run(settings: Settings) -> DryRunBackend:
    path, shelf = Storage(settings).place("dry-run")
    return DryRunBackend(path, shelf=shelf)


def _cpu(settings: Settings) -> CpuBackend:
    path, shelf = Storage(settings).place("cpu")
    return CpuBackend(
        path,
        shelf=shelf,
        model_roots=settings.allowed_model_roots(),
        host=settings.cpu_inference_host,
        port=settings.cpu_inference_port,
        admission=Admission(settings.serving_max_tokens, settings.serving_retry_after_seconds),
        device=settings.cpu_device,
        threads=settings.cpu_threads,
    )


def _model_with_config(spec: ModelSpec, config: BaseModel) -> art.TrainableModel:
    return trainable_model(spec, config=config)


_NO_WEIGHTS = "a dry run has no weights to fit"
_NO_ART_DPO = (
    "ART (0.5.18, 0.5.23) has no preference-optimisation path: train DPO on the cpu backend"
)

SPECS: dict[str, BackendSpec] = {
    "dry-run": BackendSpec(
        name="dry-run",
        description="Validates, counts and checkpoints what it is given without training "
        "weights; for wiring, demos and benchmarks without a GPU.",
        hyperparameters=ArtLocalHyperparameters,
        config=DryRunConfig,
        create=lambda settings: _dry_run(settings),
        trainable_model=_model_with_config,
        refusals={"sft": _NO_WEIGHTS, "dpo": _NO_WEIGHTS},
    ),
    "cpu": BackendSpec(
        name="cpu",
        description="Trainyard's reference trainer: policy-gradient steps on a LoRA adapter "
        "over a local causal LM, on CPU, serving `name@step` with logprobs. For small models.",
        hyperparameters=CpuHyperparameters,
        config=CpuConfig,
        create=lambda settings: _cpu(settings),
        trainable_model=_model_with_config,
        serves=True,
        other_methods={"sft": SftHyperparameters, "dpo": CpuDpoHyperparameters},
    ),
    "art-local": BackendSpec(
        name="art-local",
        description="ART's LocalBackend (vLLM + Unsloth) in the worker process; CUDA hosts "
        "with the gpu extra only.",
        hyperparameters=ArtLocalHyperparameters,
        config=art_backends.ArtLocalConfig,
        create=lambda settings: art_backends.create_local(settings.data_dir),
        trainable_model=art_backends.local_model,
        serves=True,
        unavailable=art_backends.local_unavailable,
        other_methods={"sft": SftHyperparameters},
        refusals={"dpo": _NO_ART_DPO},
    ),
    "art-serverless": BackendSpec(
        name="art-serverless",
        description="ART's ServerlessBackend (W&B serverless RL); needs WANDB_API_KEY.",
        hyperparameters=ArtServerlessHyperparameters,
        config=art_backends.ArtServerlessConfig,
        create=lambda settings: art_backends.create_serverless(settings.data_dir),
        trainable_model=art_backends.serverless_model,
        unavailable=art_backends.serverless_unavailable,
        other_methods={"sft": SftHyperparameters},
        refusals={"dpo": _NO_ART_DPO},
    ),
}


def loadable_backends() -> list[str]:
    """The backends this process can run (what a worker runs unless told)."""
    return [name for name, spec in SPECS.items() if spec.unavailable() is None]


def validate_config(backend: str, config: dict[str, Any]) -> BaseModel:
    """Raises KeyError for an unknown backend, ValidationError for a bad config."""
    return SPECS[backend].config.model_validate(config)


class Backends:
    """The trainer adapters of this process, created on first use."""

    def __init__(self, settings: Settings, overrides: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self._overrides = overrides or {}
        self._adapters: dict[str, TrainerAdapter] = {}

    def get(self, name: str) -> TrainerAdapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            spec = SPECS.get(name)
            if spec is None:
                raise BackendError(f"unknown backend {name!r}", transient=False)
            backend = self._overrides.get(name) or spec.create(self.settings)

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


def load_training_stack() -> None:
    """Import what a worker's first job would (ART, its types, OpenAI's types; torch where
    the cpu extra is installed). A worker calls it in a thread before it claims anything."""
    import importlib

    for module in ("art", "art.types", "openai.types.chat", "app.backends.cpu_policy"):
        try:
            importlib.import_module(module)
        except ImportError:  # e.g. torch without the cpu extra: that backend reports it
            continue
