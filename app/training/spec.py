"""What a queued training job stores: its groups in ART's JSON shape, whatever the request
held (a NAT collection is converted at the edge, once), so the worker has one input shape.

Formats (`payload_format`):
- `trainyard.training.v1+json;zstd`: `{"groups": [ART-style group JSON]}`.
- `training-job-create+json;zstd`: the whole HTTP request (`TrainingJobCreate`), as jobs
  queued before versioned specs hold it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from app.ingest import jsontext
from app.jobs.payloads import Codec, Compressing, Payload
from app.schemas.jobs import TrainingJobCreate
from app.schemas.trajectories import ArtTrajectoryGroup
from app.trajectories import collection_to_groups, groups_to_art

if TYPE_CHECKING:
    import art

V1 = "trainyard.training.v1+json;zstd"
REQUEST_V0 = "training-job-create+json;zstd"


def _v1(raw: bytes) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = jsontext.load_stored(raw)["groups"]
    return groups


def _request_v0(raw: bytes) -> list[dict[str, Any]]:
    return groups_of(TrainingJobCreate.model_validate_json(raw))


# Every format decodes to the job's groups in ART's JSON shape.
CODEC: Codec[list[dict[str, Any]]] = Codec(V1, {V1: _v1, REQUEST_V0: _request_v0})


def groups_of(body: TrainingJobCreate) -> list[dict[str, Any]]:
    """A checked request's groups in ART's JSON shape."""
    if body.collection is not None:
        return collection_to_groups(body.collection)
    assert body.groups is not None
    return [group_json(group) for group in body.groups]


def group_json(group: ArtTrajectoryGroup) -> dict[str, Any]:
    """A checked ART-style group in its JSON shape."""
    return _plain(group, {"trajectories": [_plain(t, _RAW) for t in group.trajectories]})


_RAW = ("messages_and_choices", "tools")


def _plain(model: BaseModel, given: dict[str, Any] | tuple[str, ...]) -> dict[str, Any]:
    """`model.model_dump(mode="json")`, but fields named in `given` are taken as they are
    (JSON already: what the request parsed to), or as `given` says: serializing them would
    copy every message and logprob again, in one long call."""
    keep = given if isinstance(given, dict) else {name: getattr(model, name) for name in given}
    dumped = model.model_dump(mode="json", exclude=set(keep))
    return {name: keep[name] if name in keep else dumped[name] for name in type(model).model_fields}


def encode(groups: list[dict[str, Any]]) -> Payload:
    return CODEC.encode({"groups": groups})


class Encoding:
    """`encode`'s payload built a group at a time (`add`, then `finish`): the same text in
    the same frame, without the list of groups ever existing."""

    def __init__(self) -> None:
        self._frame = Compressing()
        self._frame.add(b'{"groups": [')
        self._empty = True

    def add(self, group: dict[str, Any]) -> None:
        if not self._empty:
            self._frame.add(b", ")
        self._empty = False
        for piece in jsontext.dumps_pieces(group):
            self._frame.add(piece)

    def finish(self) -> Payload:
        self._frame.add(b"]}")
        data, size = self._frame.finish()
        return Payload(V1, data, size)


def stored_groups(payload: Payload) -> list[dict[str, Any]]:
    """A stored job's groups, in ART's JSON shape, whatever format it was stored in."""
    return CODEC.decode(payload.format, payload.data, payload.size)


def decode(payload: Payload) -> list[art.TrajectoryGroup]:
    """Rebuild the ART objects of a stored job (in the worker, off the request path)."""
    return groups_to_art(stored_groups(payload))
