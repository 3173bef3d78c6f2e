"""One adapter that drives any object satisfying ART's `art.Backend` Protocol."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import BaseModel

from app.backends.checkpoints import CheckpointDirs
from app.backends.hyperparameters import SftHyperparameters

if TYPE_CHECKING:
    import art

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int | None, dict[str, float]], None]
"""Called with (gradient steps done, total gradient steps or None, that step's metrics)."""

_progress: contextvars.ContextVar[_ProgressState | None] = contextvars.ContextVar(
    "trainyard_progress", default=None
)
# ART puts the number of gradient steps of the current training step in every sample.
TOTAL_KEY = "data/step_num_gradient_steps"


@dataclass
class _ProgressState:
    callback: ProgressCallback
    loop: asyncio.AbstractEventLoop
    thread: int = field(default_factory=threading.get_ident)
    done: int = 0


def report_gradient_step(metrics: dict[str, float]) -> None:
    """Backends call this once per gradient step, from the event loop or from a thread they
    train in (`asyncio.to_thread` carries the context); a no-op outside a training call."""
    state = _progress.get()
    if state is None:
        return
    state.done += 1
    total = metrics.get(TOTAL_KEY)
    args = (state.done, int(total) if total is not None else None, dict(metrics))
    if threading.get_ident() == state.thread:
        state.callback(*args)
    else:
        state.loop.call_soon_threadsafe(state.callback, *args)


@contextmanager
def progress_reporting(callback: ProgressCallback | None) -> Iterator[None]:
    state = _ProgressState(callback, asyncio.get_running_loop()) if callback else None
    token = _progress.set(state)
    try:
        yield
    finally:
        _progress.reset(token)


class BackendError(Exception):
    """A trainer backend failed; `transient` says whether retrying may help."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


# Errors that say "the backend is not reachable right now", not "your data is bad".
_TRANSIENT = (ConnectionError, TimeoutError, asyncio.TimeoutError, httpx.TransportError, OSError)


def classify(exc: BaseException) -> BackendError:
    if isinstance(exc, BackendError):
        return exc
    error = BackendError(f"{type(exc).__name__}: {exc}", transient=isinstance(exc, _TRANSIENT))
    error.__cause__ = exc
    return error


@dataclass(frozen=True)
class ModelSpec:
    """What the adapter needs to know of a registered model (taken from its row)."""

    name: str
    project: str
    base_model: str
    config: dict[str, Any] = field(default_factory=dict)


def trainable_model(spec: ModelSpec, **extra: Any) -> art.TrainableModel:
    """`spec` as an `art.TrainableModel`, on openpipe-art 0.5.18 and 0.5.23 alike.

    0.5.23 requires `run_name` (the name its checkpoints and W&B run are stored under;
    `name` stays the served alias); 0.5.18 has no such field and refuses it. The run is
    named after the model, so a model's checkpoints lie where 0.5.18 kept them."""
    import art

    if "run_name" in art.TrainableModel.model_fields:
        extra["run_name"] = spec.name
    return art.TrainableModel(
        name=spec.name, project=spec.project, base_model=spec.base_model, **extra
    )


@dataclass(frozen=True)
class TrainOutcome:
    step: int
    metrics: dict[str, float]
    checkpoint_path: str | None
    trained: bool  # False when the backend advanced the step without training (ART's skip path)


@dataclass(frozen=True)
class Inference:
    base_url: str | None
    model_name: str
    step: int
    api_key: str | None = None  # the key that endpoint takes for this model


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _sft_config(hp: SftHyperparameters) -> art.TrainSFTConfig:
    """ART's `TrainSFTConfig` of the job's keywords; `assistant_turns` only where the
    installed ART has it (0.5.23), and an error where a job asks for it on 0.5.18."""
    import art

    fields: dict[str, Any] = {
        "learning_rate": hp.learning_rate,
        "batch_size": "auto" if hp.batch_size is None else hp.batch_size,
    }
    if "assistant_turns" in art.TrainSFTConfig.model_fields:
        fields["assistant_turns"] = hp.assistant_turns
    elif hp.assistant_turns != "all":
        raise ValueError("assistant_turns=last needs openpipe-art 0.5.23 on the worker")
    return art.TrainSFTConfig(**fields)


class TrainerAdapter:
    """Register, read steps, train and serve through one `art.Backend`."""

    def __init__(
        self,
        name: str,
        backend: art.Backend,
        *,
        hyperparameters: type[BaseModel],
        model_factory: Callable[[ModelSpec], art.TrainableModel],
    ) -> None:
        self.name = name
        self.backend = backend
        self.hyperparameters = hyperparameters
        self._model_factory = model_factory
        self._models: dict[str, art.TrainableModel] = {}
        self._lock = asyncio.Lock()

    async def model(self, spec: ModelSpec) -> art.TrainableModel:
        """The registered `art.TrainableModel`; registers it with the backend once."""
        async with self._lock:
            model = self._models.get(spec.name)
            if model is None:
                try:
                    model = self._model_factory(spec)
                    await model.register(self.backend)
                except Exception as exc:
                    raise classify(exc) from exc
                self._models[spec.name] = model
            return model

    async def get_step(self, spec: ModelSpec) -> int:
        model = await self.model(spec)
        try:
            return await self.backend._get_step(model)
        except Exception as exc:
            raise classify(exc) from exc

    async def inference(self, spec: ModelSpec, step: int | None = None) -> Inference:
        """Where the model is served; pass `step` when it is known, to skip asking."""
        model = await self.model(spec)
        if step is None:
            step = await self.get_step(spec)
        return Inference(
            base_url=model.inference_base_url or None,
            model_name=self.backend._model_inference_name(model, step),
            step=step,
            api_key=model.inference_api_key or None,
        )

    async def train(
        self,
        spec: ModelSpec,
        groups: list[art.TrajectoryGroup],
        hyperparameters: dict[str, Any],
        on_progress: ProgressCallback | None = None,
    ) -> TrainOutcome:
        model = await self.model(spec)
        try:
            parsed = self.hyperparameters.model_validate(hyperparameters)
        except ValueError as exc:
            raise classify(exc) from exc
        kwargs = parsed.model_dump(exclude_unset=True)
        try:
            with progress_reporting(on_progress):
                result = await self.backend.train(model, groups, **kwargs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise classify(exc) from exc
        metrics = {k: v for k, v in (result.metrics or {}).items() if isinstance(v, int | float)}
        return TrainOutcome(
            step=result.step,
            metrics=metrics,
            checkpoint_path=getattr(result, "checkpoint_path", None),
            trained=metrics.get(TOTAL_KEY, 1) != 0,
        )

    async def train_sft(
        self,
        spec: ModelSpec,
        trajectories: list[art.Trajectory],
        hyperparameters: dict[str, Any],
        on_progress: ProgressCallback | None = None,
    ) -> TrainOutcome:
        """One supervised step through ART's entry point, `backend._train_sft` (what
        `model.train_sft` calls): each gradient step's metrics reported as it comes; the
        step the backend is at afterwards is the job's."""
        model = await self.model(spec)
        try:
            hp = SftHyperparameters.model_validate(hyperparameters)
            # Our own backends take every keyword; ART's, its `TrainSFTConfig`.
            config: Any = hp if isinstance(self.backend, CheckpointDirs) else _sft_config(hp)
        except ValueError as exc:
            raise classify(exc) from exc
        samples: list[dict[str, float]] = []
        try:
            with progress_reporting(on_progress):
                async for metrics in self.backend._train_sft(model, trajectories, config, {}):
                    numbers = {k: float(v) for k, v in metrics.items() if _number(v)}
                    samples.append(numbers)
                    report_gradient_step(numbers)
            step = await self.backend._get_step(model)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise classify(exc) from exc
        return self._outcome(spec, step, samples)

    async def train_dpo(
        self,
        spec: ModelSpec,
        pairs: list[dict[str, Any]],
        hyperparameters: dict[str, Any],
        on_progress: ProgressCallback | None = None,
    ) -> TrainOutcome:
        """One preference-optimisation step, by the backend's `train_dpo` (ART has no DPO:
        only Trainyard's own backends offer it)."""
        model = await self.model(spec)
        train_dpo = getattr(self.backend, "train_dpo", None)
        if train_dpo is None:
            raise BackendError(f"backend {self.name} does not train DPO", transient=False)
        try:
            with progress_reporting(on_progress):
                result = await train_dpo(model, pairs, **hyperparameters)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise classify(exc) from exc
        metrics = {k: v for k, v in (result.metrics or {}).items() if _number(v)}
        return TrainOutcome(
            step=result.step,
            metrics=metrics,
            checkpoint_path=getattr(result, "checkpoint_path", None),
            trained=metrics.get(TOTAL_KEY, 1) != 0,
        )

    def _outcome(self, spec: ModelSpec, step: int, samples: list[dict[str, float]]) -> TrainOutcome:
        """A step's outcome from its gradient steps' metrics (averaged, as ART logs them)."""
        keys = {k for sample in samples for k in sample}
        metrics = {
            k: sum(s[k] for s in samples if k in s) / sum(1 for s in samples if k in s)
            for k in sorted(keys)
        }
        metrics[TOTAL_KEY] = float(len(samples))
        dirs = self.checkpoint_dirs()
        return TrainOutcome(
            step=step,
            metrics=metrics,
            checkpoint_path=dirs.location(self._unregistered(spec), step) if dirs else None,
            trained=bool(samples),
        )

    def _unregistered(self, spec: ModelSpec) -> art.TrainableModel:
        """The model object, registered if this process has done so; else a fresh one
        (what checkpoint paths need: its name and project; nothing is loaded)."""
        model = self._models.get(spec.name)
        if model is not None:
            return model
        try:
            return self._model_factory(spec)
        except Exception as exc:
            raise classify(exc) from exc

    def checkpoint_dirs(self) -> CheckpointDirs | None:
        """Our own backends' checkpoints (local or in the object store); None for ART's."""
        return self.backend if isinstance(self.backend, CheckpointDirs) else None

    def checkpoints_dir(self, spec: ModelSpec) -> Path | None:
        """Where the backend keeps the model's checkpoints on this machine (one `{step:04d}`
        directory per step), or None when it keeps none here (art-serverless)."""
        if isinstance(self.backend, CheckpointDirs):  # dry-run, cpu: no ART object needed
            return self.backend.checkpoints_dir(spec)
        art_path = getattr(self.backend, "_path", None)
        if isinstance(art_path, str):  # ART's LocalBackend
            from art.utils.output_dirs import get_model_dir

            model = self._unregistered(spec)
            return Path(get_model_dir(model=model, art_path=art_path)) / "checkpoints"
        return None

    async def delete_checkpoints(self, spec: ModelSpec, steps_to_keep: list[int]) -> None:
        """Delete every checkpoint of the model but `steps_to_keep`, through the backend
        (`art.Backend._delete_checkpoint_files`)."""
        backend = self.backend
        try:
            if isinstance(backend, CheckpointDirs):  # dry-run, cpu: no ART object needed
                await backend._delete_checkpoint_files(spec, steps_to_keep)
            else:
                await backend._delete_checkpoint_files(self._unregistered(spec), steps_to_keep)
        except Exception as exc:
            raise classify(exc) from exc

    async def health(self) -> None:
        """Raise if the backend is unreachable; backends may offer an async `healthcheck()`."""
        check = getattr(self.backend, "healthcheck", None)
        if check is not None:
            await check()

    async def close(self) -> None:
        await self.backend.close()
