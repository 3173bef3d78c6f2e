"""`cpu`: Trainyard's reference trainer, an `art.Backend` that really trains on CPU.

A policy-gradient step (group-normalized advantages, clipped importance ratio against the
sampled logprobs, optional KL to the base model) on a LoRA adapter over a causal LM from a
local directory, with torch + transformers + peft. Each step is a checkpoint directory
laid out like ART's LocalBackend's; `_prepare_backend_for_training` serves the latest
adapter as `name@step` on an OpenAI-compatible endpoint with logprobs. Made for small
models: tests, the quick start, and laptops without a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.backends.admission import Admission
from app.backends.base import TOTAL_KEY, report_gradient_step
from app.backends.checkpoints import CheckpointDirs
from app.backends.hyperparameters import SftHyperparameters
from app.backends.storage import Shelf

if TYPE_CHECKING:
    import art


class CpuConfig(BaseModel):
    """Model config of the cpu backend; `base_model` must be a local model directory."""

    model_config = ConfigDict(extra="forbid")

    lora_rank: int = Field(default=8, ge=1, le=256)
    lora_alpha: int = Field(default=16, ge=1)
    seed: int = Field(default=0, description="Seeds the adapter's initialization.")
    target_modules: list[str] | None = Field(
        default=None,
        description="The modules the adapter trains (None: every attention and MLP "
        "projection). A Tinker run names its own (`lm_head` with `train_unembed`).",
    )


class CpuHyperparameters(BaseModel):
    """Training keywords of the cpu backend."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(default=1e-4, gt=0, le=1)
    epsilon: float = Field(default=0.2, gt=0, le=10, description="Clip range of the ratio.")
    kl_penalty_coef: float = Field(default=0.0, ge=0, description="Weight of KL to the base.")
    scale_rewards: bool = Field(default=True, description="Divide advantages by the std.")
    max_grad_norm: float = Field(default=1.0, gt=0)
    allow_training_without_logprobs: bool = Field(
        default=False, description="Train assistant turns without logprobs (re-tokenized)."
    )


class CpuDpoHyperparameters(BaseModel):
    """Preference-optimisation (DPO) keywords of the cpu backend."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(default=1e-4, gt=0, le=1)
    beta: float = Field(
        default=0.1,
        gt=0,
        le=100,
        description="How far the policy may move from the reference to fit a preference.",
    )
    batch_size: int = Field(default=8, ge=1, le=4096, description="Pairs per gradient step.")
    reference: Literal["start", "base"] = Field(
        default="start",
        description="The reference policy: `start`, the step the job starts from; `base`, the "
        "base model with the adapter off.",
    )
    max_grad_norm: float = Field(default=1.0, gt=0)


SFT_BATCH_SIZE = 8  # examples per gradient step when the job leaves it to the backend
MAX_GRAD_NORM = 1.0


def base_model_refusal(base: str, roots: Sequence[Path]) -> str | None:
    """Why the cpu backend may not load `base` (None: it may). It may load directories under
    `roots` only, after symlinks are resolved. Whether a path outside them exists is never
    looked up, so the answer says nothing about the rest of the filesystem."""
    allowed = ", ".join(str(root) for root in roots)
    refusal = f"must be a directory under one of the model roots: {allowed}"
    path = Path(base)
    if not path.is_absolute() or ".." in path.parts:
        return f"must be an absolute path without `..`, under one of the model roots: {allowed}"
    try:
        resolved_roots = [root.resolve() for root in roots]
        # By its text first: nothing outside the roots is looked up ...
        if not any(path.is_relative_to(r) for r in (*roots, *resolved_roots)):
            return refusal
        # ... then where its symlinks lead, which must stay inside too.
        if not any(path.resolve().is_relative_to(r) for r in resolved_roots):
            return refusal
        # Checkpoint storage (every backend's, ART's and the object store's cache keep a
        # model's steps as `…/models/<name>/checkpoints/<step>`) holds every project's
        # trained weights: refused by its shape, before anything in it is looked up, so
        # the answer says nothing of what is there.
        if _in_checkpoint_storage(path) or _in_checkpoint_storage(path.resolve()):
            return (
                "is inside checkpoint storage (…/models/<name>/checkpoints/…), not a base "
                "model: register its base model, and the adapter's weights as that model's "
                "checkpoint"
            )
        # A LoRA adapter (what checkpoints, Tinker's saves and adapter exports hold) is no
        # base model, though transformers with PEFT loads one as a model (its base with the
        # adapter applied): registered as a base, one model's trained weights, another
        # project's among them (under the data directory), would be served as this one's.
        adapter = (path.resolve() / ADAPTER_CONFIG).exists()
    except (OSError, ValueError, RuntimeError):  # a NUL, a symlink loop
        return refusal
    if adapter:
        return (
            f"is a LoRA adapter (it holds {ADAPTER_CONFIG}), not a base model: register "
            "its base model, and the adapter's weights as that model's checkpoint"
        )
    return None


ADAPTER_CONFIG = "adapter_config.json"


def _in_checkpoint_storage(path: Path) -> bool:
    parts = path.parts
    return "checkpoint-cache" in parts or any(
        parts[i] == "models" and parts[i + 2] == "checkpoints" for i in range(len(parts) - 2)
    )


class CpuBackend(CheckpointDirs):
    """Satisfies `art.Backend` structurally; one policy (and one adapter) per model.
    `model_roots`: the directories it may load base models from."""

    def __init__(
        self,
        path: Path,
        *,
        shelf: Shelf | None = None,
        model_roots: Sequence[Path],
        host: str = "127.0.0.1",
        port: int = 0,
        admission: Admission | None = None,
        device: str = "cpu",
        threads: int | None = None,
    ) -> None:
        super().__init__(path, shelf=shelf)
        self.admission = admission or Admission()
        self.host, self.port = host, port
        self.model_roots = list(model_roots)
        self.device = device  # where its models run: `cpu`, `cuda[:N]`, or `auto`
        self.threads = threads  # torch's threads (None: `cpu_policy.default_threads`)
        self._policies: dict[str, Any] = {}
        self._server: Any = None

    @property
    def served(self) -> dict[str, tuple[art.Model, Any]]:
        """Registered models by name, with their policies (what the endpoint serves)."""
        return dict(self._policies)

    async def close(self) -> None:
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
            self._server = None

    async def register(self, model: art.Model) -> None:
        if model.name in self._policies:
            return
        await asyncio.to_thread(self._register, model)

    def _register(self, model: art.Model) -> None:
        try:
            from app.backends.cpu_policy import Policy
        except ImportError as exc:
            raise ValueError(
                f"the cpu backend needs the cpu extra (`pip install '.[cpu]'`): {exc}"
            ) from exc

        config = model.config if isinstance(model.config, CpuConfig) else CpuConfig()
        base = getattr(model, "base_model", "")
        refusal = base_model_refusal(base, self.model_roots)
        if refusal is not None:  # registered before the roots were checked, or moved since
            raise ValueError(f"the cpu backend will not load base_model {base!r}: it {refusal}")
        if not Path(base).is_dir():
            raise ValueError(
                f"the cpu backend loads models from local directories; {base!r} is not one "
                "(make one with `trainyard make-tiny-model DIR`)"
            )
        policy = Policy(
            base,
            rank=config.lora_rank,
            alpha=config.lora_alpha,
            seed=config.seed,
            device=self.device,
            threads=self.threads,
            **({"target_modules": config.target_modules} if config.target_modules else {}),
        )
        if not self.sync(model, policy):
            with self.writing(model, 0, replace=False) as partial:
                policy.save(partial, 0)
        self._policies[model.name] = (model, policy)

    def checkpoint(self, model: art.Model, step: int) -> Path | None:
        """The directory of `step`'s adapter, if there is one (fetched from the object store
        into this worker's cache on a miss)."""
        path = self.local_step(model, step)
        return path if path is not None and (path / "adapter_model.safetensors").exists() else None

    def sync(self, model: art.Model, policy: Any) -> bool:
        """Load the newest checkpoint on disk if the adapter in memory is older (another
        worker process trained it, or this one restarted). Call with `policy.lock` held."""
        step = self.step_on_disk(model)
        checkpoint = self.checkpoint(model, step)
        if checkpoint is None:
            return False
        if step != policy.loaded_step:
            policy.load(checkpoint, step)
        return True

    async def _prepare_backend_for_training(
        self, model: art.TrainableModel, config: Any = None
    ) -> tuple[str, str]:
        """Serve the model (with every other model of this backend) on one local endpoint,
        behind a key of its own (`cpu_server.ModelKeys`)."""
        if self._server is None:
            from app.backends.cpu_server import InferenceServer

            self._server = InferenceServer(self, host=self.host, port=self.port)
            await asyncio.to_thread(self._server.start)
        return self._server.base_url, self._server.keys.key(model.name)

    async def train(
        self,
        model: art.TrainableModel,
        trajectory_groups: Iterable[art.TrajectoryGroup],
        **kwargs: Any,
    ) -> art.TrainResult:
        hp = CpuHyperparameters.model_validate(kwargs)
        _, policy = self._policies[model.name]
        groups = list(trajectory_groups)
        return await _in_thread(self._train, model, policy, groups, hp)

    def _train(
        self,
        model: art.TrainableModel,
        policy: Any,
        groups: list[art.TrajectoryGroup],
        hp: CpuHyperparameters,
    ) -> art.TrainResult:
        with policy.lock, self._stepping(model, policy):
            self.sync(model, policy)
            batches = policy.sequences(
                groups,
                scale_rewards=hp.scale_rewards,
                allow_without_logprobs=hp.allow_training_without_logprobs,
            )
            total = len(batches)
            summary: dict[str, float] = {
                "data/step_num_groups_submitted": len(groups),
                "data/step_num_groups_trainable": total,
                "data/step_num_trajectories": sum(len(g.trajectories) for g in groups),
                "data/step_trainer_tokens": sum(len(t.completion_ids) for b in batches for t in b),
                TOTAL_KEY: total,
            }
            samples = []
            for batch in batches:
                go_on()
                metrics = policy.step(
                    batch,
                    learning_rate=hp.learning_rate,
                    epsilon=hp.epsilon,
                    kl_penalty_coef=hp.kl_penalty_coef,
                    max_grad_norm=hp.max_grad_norm,
                )
                samples.append(metrics)
                report_gradient_step({**metrics, TOTAL_KEY: total})
            go_on()
            step = self.step_on_disk(model) + 1
            checkpoint = self.location(model, step)
            # Like ART: a step with nothing to learn still advances, as a copy of the last.
            with self.writing(model, step) as partial:
                policy.save(partial, step)
        averaged = (
            {k: sum(s[k] for s in samples) / len(samples) for k in samples[0]} if samples else {}
        )
        from art.types import LocalTrainResult

        return LocalTrainResult(
            step=step, metrics={**summary, **averaged}, checkpoint_path=checkpoint
        )

    # -- supervised fine-tuning (ART's `_train_sft`) and DPO ------------------------------

    async def _train_sft(
        self,
        model: art.TrainableModel,
        trajectories: Iterable[art.Trajectory],
        config: Any,
        dev_config: Any = None,
        verbose: bool = False,
    ) -> AsyncIterator[dict[str, float]]:
        """ART's supervised entry point: cross-entropy on the assistant turns of each chat,
        `config.batch_size` chats a gradient step, one new step (checkpoint) at the end.
        Yields each gradient step's metrics as it is taken. `config`: ART's
        `TrainSFTConfig`, or the job's `SftHyperparameters`."""
        hp = SftHyperparameters(
            learning_rate=config.learning_rate,
            batch_size=None if config.batch_size in (None, "auto") else config.batch_size,
            assistant_turns=getattr(config, "assistant_turns", "all"),
        )
        _, policy = self._policies[model.name]
        chats = list(trajectories)
        async for metrics in _streamed(self._sft, model, policy, chats, hp):
            yield metrics

    def _sft(
        self,
        model: art.TrainableModel,
        policy: Any,
        chats: list[art.Trajectory],
        hp: SftHyperparameters,
        emit: Callable[[dict[str, float]], None],
    ) -> None:
        size = hp.batch_size or SFT_BATCH_SIZE
        with policy.lock, self._stepping(model, policy):
            self.sync(model, policy)
            batches = [
                [
                    turn
                    for chat in chats[i : i + size]
                    for turn in policy.sft_turns(chat, hp.assistant_turns)
                ]
                for i in range(0, len(chats), size)
            ]
            batches = [b for b in batches if b]
            for batch in batches:
                go_on()
                metrics = policy.sft_step(
                    batch, learning_rate=hp.learning_rate, max_grad_norm=MAX_GRAD_NORM
                )
                emit(
                    {
                        **metrics,
                        "data/step_num_trajectories": float(len(chats)),
                        TOTAL_KEY: len(batches),
                    }
                )
            self._save_next(model, policy)

    async def train_dpo(
        self, model: art.TrainableModel, pairs: list[dict[str, Any]], **kwargs: Any
    ) -> art.TrainResult:
        """One step of DPO on preference pairs (`{prompt, chosen, rejected}`), `batch_size`
        pairs a gradient step, against the reference `reference` names."""
        hp = CpuDpoHyperparameters.model_validate(kwargs)
        _, policy = self._policies[model.name]
        return await _in_thread(self._dpo, model, policy, pairs, hp)

    def _dpo(
        self,
        model: art.TrainableModel,
        policy: Any,
        pairs: list[dict[str, Any]],
        hp: CpuDpoHyperparameters,
    ) -> art.TrainResult:
        with policy.lock, self._stepping(model, policy):
            self.sync(model, policy)
            turns = [policy.pair_turns(pair) for pair in pairs]
            references = policy.pair_logprobs(turns, adapter=hp.reference == "start")
            size = hp.batch_size
            total = (len(turns) + size - 1) // size
            samples = []
            for i in range(0, len(turns), size):
                go_on()
                metrics = policy.dpo_step(
                    turns[i : i + size],
                    references[i : i + size],
                    beta=hp.beta,
                    learning_rate=hp.learning_rate,
                    max_grad_norm=hp.max_grad_norm,
                )
                samples.append(metrics)
                report_gradient_step({**metrics, TOTAL_KEY: total})
            step, checkpoint = self._save_next(model, policy)
        averaged = {k: sum(s[k] for s in samples) / len(samples) for k in samples[0]}
        from art.types import LocalTrainResult

        summary = {"data/step_num_pairs": float(len(pairs)), TOTAL_KEY: float(total)}
        return LocalTrainResult(
            step=step, metrics={**summary, **averaged}, checkpoint_path=checkpoint
        )

    @contextlib.contextmanager
    def _stepping(self, model: art.TrainableModel, policy: Any) -> Iterator[None]:
        """Around one job's gradient steps (with `policy.lock` held): if they stop part-way
        (an error, or the job given up), the adapter in memory goes back to the newest step
        on disk, so neither the job's retry nor a sample starts from half a step."""
        try:
            yield
        except BaseException:
            policy.loaded_step = -1  # what is in memory is no step: load the one on disk
            with contextlib.suppress(Exception):
                self.sync(model, policy)
            raise

    def _save_next(self, model: art.TrainableModel, policy: Any) -> tuple[int, str]:
        """Save the adapter in memory as the model's next step (call with the lock held)."""
        go_on()
        step = self.step_on_disk(model) + 1
        checkpoint = self.location(model, step)
        with self.writing(model, step) as partial:
            policy.save(partial, step)
        return step, checkpoint


async def _streamed(work: Callable[..., None], *args: Any) -> AsyncIterator[dict[str, float]]:
    """Run `work(*args, emit)` in a thread and yield what it emits, as it emits it; then
    raise what it raised, if anything. Given up part-way, as `_in_thread`."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, float] | None] = asyncio.Queue()

    def emit(metrics: dict[str, float]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, metrics)

    def finished(future: asyncio.Future[None]) -> None:
        if not future.cancelled():
            future.exception()  # raised below; retrieved here if nobody waits any more
        loop.call_soon_threadsafe(queue.put_nowait, None)

    running, abandoned = _start(work, *args, emit)
    running.add_done_callback(finished)
    try:
        while (metrics := await queue.get()) is not None:
            yield metrics
        await running
    except BaseException:  # cancelled, or the consumer stopped reading (GeneratorExit)
        await _give_up(running, abandoned)
        raise


class TrainingAbandoned(Exception):
    """The job a training thread works for was given up (its task cancelled: a cancel, a
    lost lease, a worker that stops past its grace); the thread stops before its next
    gradient step or save."""


_ABANDONED: ContextVar[threading.Event | None] = ContextVar("cpu_abandoned", default=None)


def go_on() -> None:
    """In a training thread, before each gradient step and before the save: raise
    `TrainingAbandoned` if the job was given up."""
    abandoned = _ABANDONED.get()
    if abandoned is not None and abandoned.is_set():
        raise TrainingAbandoned("the job was given up; stopped before its next write")


def _start(work: Callable[..., Any], *args: Any) -> tuple[asyncio.Future[Any], threading.Event]:
    abandoned = threading.Event()
    token = _ABANDONED.set(abandoned)
    try:  # the task copies this context, and `to_thread` copies the task's into the thread
        running = asyncio.ensure_future(asyncio.to_thread(work, *args))
    finally:
        _ABANDONED.reset(token)
    return running, abandoned


async def _give_up(running: asyncio.Future[Any], abandoned: threading.Event) -> None:
    """Tell the thread to stop and wait for it to end, so nothing it writes lands after its
    job was handed back (another worker may train that job next)."""
    abandoned.set()
    with contextlib.suppress(BaseException):
        await asyncio.shield(running)


async def _in_thread(work: Callable[..., Any], *args: Any) -> Any:
    """`asyncio.to_thread(work, *args)`, except that if the caller is cancelled, the thread
    is told to stop (`go_on` raises in it) and waited for before the cancellation goes on:
    a training thread must not write a step after its job's lease is released."""
    running, abandoned = _start(work, *args)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await _give_up(running, abandoned)
        raise
