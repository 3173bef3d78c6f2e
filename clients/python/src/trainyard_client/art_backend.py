"""`TrainyardBackend`: an `art.Backend` over Trainyard's HTTP API.

An ART program changes one line, the backend it registers its model with::

    backend = TrainyardBackend("http://127.0.0.1:8000", api_key=None, trainer="cpu")
    await model.register(backend)
    result = await backend.train(model, groups, learning_rate=1e-5)

and each `train` becomes a durable Trainyard training job: submitted once (an
Idempotency-Key repeated by every retry), followed over the job's event stream, and
answered with ART's own `TrainResult` (the step the job made and its metrics). The
program may die meanwhile: the job goes on, and its step is not trained twice.

The model's OpenAI client (`model.openai_client()`) points at Trainyard's gateway
(`/openai/v1`), which serves the latest step under the model's name and any kept step
as `name@N`, and calls it with the key the backend's client sends (`api_key=`, else
`TRAINYARD_API_KEY`): the gateway is behind the API's keys.

Written against `art.Backend` of openpipe-art 0.5.18 and 0.5.23 (which adds
`exact_adapter_lease`). Needs the `art` extra: `pip install "trainyard-client[art]"`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import art

from trainyard_client._async import AsyncTrainyard
from trainyard_client.errors import ConflictError, NotFoundError, TrainyardError
from trainyard_client.models import JobStatus, TrainingJob
from trainyard_client.progress import Progress

if TYPE_CHECKING:
    from art import dev

log = logging.getLogger("trainyard_client.art")

# ART's own keyword arguments of `LocalBackend.train` that are no hyper-parameter of a step:
# they say how to print, not how to train.
_NOT_HYPERPARAMETERS = frozenset({"verbose"})

# The key an OpenAI client is given when the user has none (an OpenAI client refuses to
# be made without one): a server without TRAINYARD_API_KEYS takes any.
NO_KEY = "no-key"


class JobFailedError(TrainyardError):
    """A training (or SFT) job ended without training (failed or cancelled); `job` says why."""

    def __init__(self, job: TrainingJob) -> None:
        reason = job.error.message if job.error else job.status
        super().__init__(f"training job {job.id} {job.status}: {reason}")
        self.job = job


class TrainyardBackend:
    """An `art.Backend` whose models live in a Trainyard service (see the module).

    `trainer`: the Trainyard backend a model is created on when `register` does not find
    it (`cpu`, `art-local`, …; see `GET /v1/backends`); a model already registered keeps
    its own. `trainer_config`: that backend's model config. `metadata`: labels every job
    submitted carries. `timeout`: seconds one `train` waits for its job (None: as long as
    it takes; on timeout the job goes on). `on_progress`: called with each event's
    `Progress` while a job trains (the default logs it).

    `url` and `api_key` default to `TRAINYARD_URL` and `TRAINYARD_API_KEY`; with `client`
    given, its URL and key are used. The key reaches every call, ART's OpenAI client too.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        trainer: str | None = None,
        trainer_config: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        on_progress: Callable[[Progress], object] | None = None,
        client: AsyncTrainyard | None = None,
    ) -> None:
        self.client = client or AsyncTrainyard(url, api_key=api_key)
        self._owns_client = client is None
        self.trainer = trainer
        self.trainer_config = dict(trainer_config or {})
        self.metadata = dict(metadata or {})
        self.timeout = timeout
        self.on_progress = on_progress or _log_progress

    # -- registration and inference ---------------------------------------------------

    async def register(self, model: art.Model[Any, Any]) -> None:
        """Find the model on the service, or create it (a trainable one) on `trainer`."""
        if not model.trainable:
            return  # a model ART only samples (an API model): nothing to keep here
        assert isinstance(model, art.TrainableModel)
        try:
            found = await self.client.models.get(model.name)
        except NotFoundError:
            if self.trainer is None:
                raise ValueError(
                    f"model {model.name!r} is not registered on {self.client.url}: pass "
                    "trainer=… (a backend of GET /v1/backends) to create it"
                ) from None
            await self.client.models.create(
                name=model.name,
                base_model=model.base_model,
                backend=self.trainer,
                project=model.project,
                config=self.trainer_config,
            )
            return
        if found.base_model != model.base_model:
            raise ValueError(
                f"model {model.name!r} on {self.client.url} has base model "
                f"{found.base_model!r}, not {model.base_model!r}"
            )

    async def _prepare_backend_for_training(
        self,
        model: art.TrainableModel[Any, Any],
        config: dev.OpenAIServerConfig | None,
    ) -> tuple[str, str]:
        """The gateway and the key ART's OpenAI client calls it with: the key every call
        of `self.client` sends (the gateway is behind the API's keys). A server without
        keys takes any: an OpenAI client needs one, so a placeholder stands in."""
        return self.client.openai_base_url, self.client.api_key or NO_KEY

    def _model_inference_name(self, model: art.Model[Any, Any], step: int | None = None) -> str:
        """The gateway's names: `name` is the latest step, `name@N` step N."""
        return model.name if step is None else f"{model.name}@{step}"

    async def _get_step(self, model: art.TrainableModel[Any, Any]) -> int:
        return (await self.client.models.get(model.name)).current_step

    @contextlib.asynccontextmanager
    async def exact_adapter_lease(
        self, model: art.TrainableModel[Any, Any], step: int
    ) -> AsyncIterator[None]:
        """Keep `step` served and undeletable while the block runs: an alias names it
        (the registry keeps an aliased step) and is removed after."""
        alias = f"lease-{secrets.token_hex(6)}"
        await self.client.aliases.set(model.name, alias, step=step)
        try:
            yield
        finally:
            with contextlib.suppress(NotFoundError):
                await self.client.aliases.delete(model.name, alias)

    # -- training ---------------------------------------------------------------------

    async def train(
        self,
        model: art.TrainableModel[Any, Any],
        trajectory_groups: Iterable[art.TrajectoryGroup],
        **hyperparameters: Any,
    ) -> art.TrainResult:
        """One training step as a Trainyard job: submit, follow, return its result.
        Keyword arguments are the step's hyper-parameters, checked by the model's backend
        (an unknown or invalid one: ValidationError naming it; nothing is submitted).
        Raises JobFailedError if the job fails or is cancelled, WaitTimeoutError past
        `timeout` (the job goes on)."""
        # Every field, defaults included: openpipe-art 0.5.23 leaves out fields at their
        # default (a reward of 0.0 among them), and the API requires `reward`.
        groups = [
            group.model_dump(mode="json", exclude_defaults=False) for group in trajectory_groups
        ]
        submitted = await self.client.training_jobs.create(
            model=model.name,
            groups=groups,
            hyperparameters={
                k: v for k, v in hyperparameters.items() if k not in _NOT_HYPERPARAMETERS
            },
            metadata=self.metadata or None,
        )
        log.info("model %s: training job %s submitted", model.name, submitted.id)
        job = await self.client.training_jobs.wait(
            submitted.id, timeout=self.timeout, on_progress=self.on_progress
        )
        if job.status != JobStatus.succeeded or job.result is None:
            raise JobFailedError(job)
        step = job.result.final_step
        if step is None:
            step = await self._get_step(model)
        return art.TrainResult(step=step, metrics=_numbers(job.result.metrics or {}))

    async def _train_sft(
        self,
        model: art.TrainableModel[Any, Any],
        trajectories: Iterable[art.Trajectory],
        config: art.types.TrainSFTConfig,
        dev_config: dev.TrainSFTConfig,
        verbose: bool = False,
    ) -> AsyncIterator[dict[str, float]]:
        """ART's supervised entry point (what `model.train_sft` calls): one Trainyard SFT
        job (`method: "sft"`) on the trajectories' messages, whose assistant turns are
        the targets. Yields each gradient step's metrics as the job reports it; raises
        JobFailedError if the job fails or is cancelled, WaitTimeoutError past `timeout`."""
        if isinstance(config.learning_rate, list):
            raise ValueError(
                "Trainyard's SFT jobs take one learning_rate per job, not one per batch"
            )
        hyperparameters: dict[str, Any] = {"learning_rate": config.learning_rate}
        if config.batch_size != "auto":
            hyperparameters["batch_size"] = config.batch_size
        turns = getattr(config, "assistant_turns", "all")  # openpipe-art 0.5.23
        if turns != "all":
            hyperparameters["assistant_turns"] = turns
        submitted = await self.client.training_jobs.create(
            model=model.name,
            method="sft",
            examples=[_sft_example(trajectory) for trajectory in trajectories],
            hyperparameters=hyperparameters,
            metadata=self.metadata or None,
        )
        log.info("model %s: SFT job %s submitted", model.name, submitted.id)
        async for event in self.client.training_jobs.events(submitted.id, timeout=self.timeout):
            if event.type == "gradient_step":
                yield _numbers(event.data.get("metrics") or {})
        job = await self.client.training_jobs.get(submitted.id)
        if job.status != JobStatus.succeeded:
            raise JobFailedError(job)

    async def _delete_checkpoint_files(
        self, model: art.TrainableModel[Any, Any], steps_to_keep: list[int]
    ) -> None:
        """Delete the model's checkpoints but `steps_to_keep`, through the registry: a
        step it protects (aliased, in use, the latest) stays."""
        keep = set(steps_to_keep)
        async for checkpoint in self.client.checkpoints.iterate(model.name):
            if checkpoint.step in keep:
                continue
            try:
                await self.client.checkpoints.delete(model.name, checkpoint.step)
            except (ConflictError, NotFoundError) as exc:
                log.info("model %s: step %s kept: %s", model.name, checkpoint.step, exc)

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The job's metrics that are numbers (ART's `TrainResult.metrics` holds floats)."""
    numbers: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            numbers[key] = float(value)
    return numbers


def _sft_example(trajectory: art.Trajectory) -> dict[str, Any]:
    """An SFT example of an ART trajectory: its messages (a Choice as its message), and
    the tools it offered."""
    example: dict[str, Any] = {"messages": [dict(m) for m in trajectory.messages()]}
    if trajectory.tools:
        example["tools"] = [dict(tool) for tool in trajectory.tools]
    return example


def _log_progress(progress: Progress) -> None:
    if progress.total:
        log.info(
            "job %s: %s, step %s/%s, loss %s",
            progress.job_id,
            progress.status,
            progress.step,
            progress.total,
            progress.loss,
        )


__all__ = ["JobFailedError", "TrainyardBackend"]


if TYPE_CHECKING:

    def _is_an_art_backend(backend: TrainyardBackend) -> art.Backend:
        return backend  # the type checker holds the class to ART's Protocol
