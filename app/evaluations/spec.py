"""What a queued evaluation job stores: its recipe, the step it evaluates (resolved when
it was accepted) and its examples (a dataset's split is copied in then, so the job
evaluates what it was given even if the dataset is deleted). The model lives in the row.

Formats (`payload_format`):
- `trainyard.evaluation.v1+json;zstd`: an `EvaluationSpec`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from app.db import json_dumps
from app.ingest import jsontext
from app.jobs.payloads import Codec, Payload
from app.schemas.evaluations import EvaluationSampling
from app.schemas.graders import Grader
from app.schemas.rollouts import Example

V1 = "trainyard.evaluation.v1+json;zstd"


class EvaluationSpec(BaseModel):
    """An evaluation, as the worker runs it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int
    examples: list[Example]
    samples_per_example: int
    sampling: EvaluationSampling
    grader: Grader
    concurrency: int


def _v1(raw: bytes) -> EvaluationSpec:
    return EvaluationSpec.model_validate(jsontext.load_stored(raw))


CODEC: Codec[EvaluationSpec] = Codec(V1, {V1: _v1})


def examples_json(examples: list[Example]) -> bytes:
    """Examples as the spec stores them (and as their digest is taken): JSON, UTF-8."""
    return jsontext.dumps_bytes(
        [{name: getattr(e, name) for name in Example.model_fields} for e in examples]
    )


def encode(spec: EvaluationSpec, examples: bytes) -> Payload:
    """The spec stored; `examples`: its examples as `examples_json` encoded them."""
    rest = json_dumps(spec.model_dump(mode="json", exclude={"examples"})).encode()
    return CODEC.encode_json(b"".join([b'{"examples": ', examples, b", ", rest[1:]]))


def decode(payload: Payload) -> EvaluationSpec:
    return CODEC.decode(payload.format, payload.data, payload.size)
