"""What a queued rollout job stores: its recipe (examples, sampling, grader or agent, what
to train after), validated at the edge. The model and the labels live in the job's row.

Formats (`payload_format`):
- `trainyard.rollout.v1+json;zstd`: a `RolloutSpec`.
- `rollout-job-create+json;zstd`: the whole HTTP request (`RolloutJobCreate`), as jobs
  queued before versioned specs hold it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from app.db import json_dumps
from app.ingest import jsontext
from app.jobs.payloads import Codec, Payload
from app.schemas.graders import Grader
from app.schemas.rollouts import Agent, Example, RolloutJobCreate, Sampling, TrainAfter

V1 = "trainyard.rollout.v1+json;zstd"
REQUEST_V0 = "rollout-job-create+json;zstd"


class RolloutSpec(BaseModel):
    """A rollout's recipe, as the worker runs it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    examples: list[Example]
    num_generations: int
    sampling: Sampling
    grader: Grader | None
    agent: Agent | None
    concurrency: int
    train: TrainAfter | None
    # A run's rollout: the id its training job gets (deterministic, so the run finds it)
    # and the labels it carries.
    train_job_id: str | None = None
    train_metadata: dict[str, Any] = {}

    @classmethod
    def of(cls, body: RolloutJobCreate) -> RolloutSpec:
        return cls(
            examples=body.examples,
            num_generations=body.num_generations,
            sampling=body.sampling,
            grader=body.grader,
            agent=body.agent,
            concurrency=body.concurrency,
            train=body.train,
        )


def _v1(raw: bytes) -> RolloutSpec:
    # Parsed a piece at a time, then validated (see `jsontext.load_stored`).
    return RolloutSpec.model_validate(jsontext.load_stored(raw))


def _request_v0(raw: bytes) -> RolloutSpec:
    return RolloutSpec.of(RolloutJobCreate.model_validate_json(raw))


CODEC: Codec[RolloutSpec] = Codec(V1, {V1: _v1, REQUEST_V0: _request_v0})


def encode(spec: RolloutSpec, examples: bytes | None = None) -> Payload:
    """The spec stored. `examples`: its examples as JSON (`examples_json`), when they were
    encoded apart (the spec's own `examples` are then left out)."""
    if examples is None:
        examples = examples_json(spec.examples)
    rest = json_dumps(spec.model_dump(mode="json", exclude={"examples"})).encode()
    # bytes.join: no copy of the examples under the GIL (see `jsontext.dumps_bytes`)
    return CODEC.encode_json(b"".join([b'{"examples": ', examples, b", ", rest[1:]]))


def examples_json(examples: list[Example]) -> bytes:
    """Examples as a spec stores them: `model_dump(mode="json")`'s JSON (UTF-8), encoded a
    piece at a time. Their fields hold JSON already (what the request parsed to): they are
    not serialized again."""
    return jsontext.dumps_bytes(
        [{name: getattr(e, name) for name in Example.model_fields} for e in examples]
    )


def decode(payload: Payload) -> RolloutSpec:
    return CODEC.decode(payload.format, payload.data, payload.size)
