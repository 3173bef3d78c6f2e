"""What a run stores (`jobs.payload` of its row): its request, normalized and checked, in a
versioned format; and how its child jobs' specs are built from it.

Formats (`payload_format`):
- `trainyard.run.v1+json;zstd`: a `RunSpec`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, SkipValidation

from app.ingest import jsontext
from app.jobs.payloads import Codec, Payload
from app.rollouts.spec import RolloutSpec
from app.runs.schedule import Plan
from app.schemas.rollouts import Example, TrainAfter
from app.schemas.runs import (
    CheckpointPolicy,
    Curriculum,
    DatasetExample,
    DatasetRef,
    EarlyStopping,
    LearningRateSchedule,
    Recipe,
    RunCreate,
    Schedule,
    Validation,
)

V1 = "trainyard.run.v1+json;zstd"


class RunSpec(BaseModel):
    """A run's request as the driver reads it: hyper-parameters normalized for the model's
    backend, the dataset's splits resolved and counted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: DatasetRef | None
    # Inline examples by split, each as a dataset stores it (checked JSON at the edge):
    # neither validated nor serialized again as a whole, so a large run reads and writes
    # a piece at a time (see `encode`, `_v1`).
    examples: SkipValidation[dict[str, list[dict[str, Any]]] | None]
    num_train: int
    num_validation: int
    recipe: Recipe
    schedule: Schedule
    hyperparameters: dict[str, Any]
    learning_rate_schedule: LearningRateSchedule | None
    validation: Validation | None
    checkpoints: CheckpointPolicy
    early_stopping: EarlyStopping | None
    curriculum: Curriculum | None
    max_steps_off_policy: int
    # The SFT warm-up before RL: {"examples": [chats], "hyperparameters": {...}} (a spec
    # written before warm-ups has none).
    warmup: SkipValidation[dict[str, Any] | None] = None

    @classmethod
    def of(
        cls,
        body: RunCreate,
        *,
        hyperparameters: dict[str, Any],
        num_train: int,
        num_validation: int,
        dataset: DatasetRef | None,
        examples: dict[str, list[dict[str, Any]]] | None,
        warmup: dict[str, Any] | None = None,
    ) -> RunSpec:
        return cls(
            dataset=dataset,
            examples=examples,
            num_train=num_train,
            num_validation=num_validation,
            recipe=body.recipe,
            schedule=body.schedule,
            hyperparameters=hyperparameters,
            learning_rate_schedule=body.learning_rate_schedule,
            validation=body.validation,
            checkpoints=body.checkpoints,
            early_stopping=body.early_stopping,
            curriculum=body.curriculum,
            max_steps_off_policy=body.max_steps_off_policy,
            warmup=warmup,
        )

    def plan(self) -> Plan:
        lr = self.hyperparameters.get("learning_rate")
        schedule = self.learning_rate_schedule
        return Plan(
            num_train=self.num_train,
            examples_per_step=self.schedule.examples_per_step,
            epochs=self.schedule.epochs,
            max_steps=self.schedule.max_steps,
            seed=self.schedule.shuffle_seed,
            validate_every=self.validation.every_steps if self.validation else None,
            early_stopping=(
                (self.early_stopping.patience, self.early_stopping.min_delta)
                if self.early_stopping
                else None
            ),
            curriculum=(
                (self.curriculum.patience, self.curriculum.min_examples)
                if self.curriculum
                else None
            ),
            off_policy=self.max_steps_off_policy,
            lr=float(lr) if isinstance(lr, int | float) and not isinstance(lr, bool) else None,
            lr_schedule=(
                (schedule.type, schedule.warmup_steps, schedule.min_ratio) if schedule else None
            ),
            warmup=self.warmup is not None,
        )


def _v1(raw: bytes) -> RunSpec:
    return RunSpec.model_validate(jsontext.load_stored(raw))


CODEC: Codec[RunSpec] = Codec(V1, {V1: _v1})


def encode(spec: RunSpec) -> Payload:
    document = spec.model_dump(mode="json", exclude={"examples"})
    document["examples"] = spec.examples  # JSON already: encoded a piece at a time
    return CODEC.encode(document)


def decode(payload: Payload) -> RunSpec:
    return CODEC.decode(payload.format, payload.data, payload.size)


def split_examples(examples: list[DatasetExample]) -> dict[str, list[dict[str, Any]]]:
    """Inline examples by split, each as a dataset stores it (checked JSON)."""
    splits: dict[str, list[dict[str, Any]]] = {}
    for example in examples:
        splits.setdefault(example.split, []).append(example.model_dump(mode="json"))
    return splits


def as_rollout_example(index: int, stored: dict[str, Any]) -> Example:
    """A split's example (as stored: checked JSON) as a rollout samples it: its id is its
    index in the split (what a rollout's `untrainable_groups` then names); the example's
    own id goes in its metadata."""
    return Example.model_construct(
        id=index,
        messages=stored["messages"],
        expected=stored.get("expected"),
        metadata={**(stored.get("metadata") or {}), "example_id": stored["id"]},
    )


def rollout_spec(
    spec: RunSpec,
    examples: list[Example],
    *,
    train: tuple[str, dict[str, Any], dict[str, Any]] | None,
) -> RolloutSpec:
    """A step's rollout (`train`: the training job's id, hyper-parameters and labels) or a
    validation (`train` None: the validation's sampling, nothing trained)."""
    recipe = spec.recipe
    if train is None:
        validation = spec.validation
        assert validation is not None
        return RolloutSpec(
            examples=examples,
            num_generations=validation.num_generations,
            sampling=validation.sampling or recipe.sampling,
            grader=recipe.grader,
            agent=recipe.agent,
            concurrency=recipe.concurrency,
            train=None,
        )
    job_id, hyperparameters, labels = train
    return RolloutSpec(
        examples=examples,
        num_generations=recipe.num_generations,
        sampling=recipe.sampling,
        grader=recipe.grader,
        agent=recipe.agent,
        concurrency=recipe.concurrency,
        train=TrainAfter(
            hyperparameters=hyperparameters,
            max_steps_off_policy=spec.max_steps_off_policy,
        ),
        train_job_id=job_id,
        train_metadata=labels,
    )
