"""What SFT and DPO training jobs store, and what the worker rebuilds from it.

A training job's `payload_format` says its method: the RL formats are `app.training.spec`'s;
these two are the others. Each request shape is converted at the edge, once, so the worker
has one input shape per method.

Formats:
- `trainyard.training.sft.v1+json;zstd`: `{"examples": [{"messages": [...], "tools": ...}]}`.
- `trainyard.training.dpo.v1+json;zstd`: `{"pairs": [{"prompt": [...], "chosen": "...",
  "rejected": "...", "tools": ...}]}` (a NAT DPO item's text prompt becomes one user turn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app.ingest import jsontext
from app.jobs.payloads import Codec, Payload
from app.schemas.supervised import (
    ROLES,
    DpoJobCreate,
    DpoSummary,
    NatDpoCollection,
    SftExample,
    SftSummary,
)
from app.training import spec

if TYPE_CHECKING:
    import art

SFT_V1 = "trainyard.training.sft.v1+json;zstd"
DPO_V1 = "trainyard.training.dpo.v1+json;zstd"


def _examples(raw: bytes) -> list[dict[str, Any]]:
    examples: list[dict[str, Any]] = jsontext.load_stored(raw)["examples"]
    return examples


def _pairs(raw: bytes) -> list[dict[str, Any]]:
    pairs: list[dict[str, Any]] = jsontext.load_stored(raw)["pairs"]
    return pairs


SFT: Codec[list[dict[str, Any]]] = Codec(SFT_V1, {SFT_V1: _examples})
DPO: Codec[list[dict[str, Any]]] = Codec(DPO_V1, {DPO_V1: _pairs})


def method_of(payload_format: str) -> str:
    """The training method of a stored spec: `sft`, `dpo`, or `rl` (every other format)."""
    return {SFT_V1: "sft", DPO_V1: "dpo"}.get(payload_format, "rl")


# -- SFT -------------------------------------------------------------------------------------


def example_json(example: SftExample) -> dict[str, Any]:
    document: dict[str, Any] = {"messages": example.messages}
    if example.tools is not None:
        document["tools"] = example.tools
    return document


def encode_sft(
    examples: list[dict[str, Any]], dataset: str | None = None
) -> tuple[Payload, SftSummary]:
    summary = SftSummary(
        num_examples=len(examples),
        num_target_turns=sum(
            1 for e in examples for m in e["messages"] if m.get("role") == "assistant"
        ),
        dataset=dataset,
    )
    return SFT.encode({"examples": examples}), summary


def sft_trajectories(payload: Payload) -> list[art.Trajectory]:
    """A stored SFT job's examples as the `art.Trajectory`s ART's `_train_sft` takes:
    plain messages, no reward."""
    import art

    return [
        art.Trajectory(
            messages_and_choices=list(example["messages"]),
            tools=example.get("tools"),
            reward=0.0,
        )
        for example in SFT.decode(payload.format, payload.data, payload.size)
    ]


# -- DPO -------------------------------------------------------------------------------------


def pairs_of(body: DpoJobCreate) -> list[dict[str, Any]]:
    """A checked DPO request's pairs in the stored shape."""
    if body.collection is not None:
        return nat_pairs(body.collection)
    assert body.pairs is not None
    pairs = []
    for pair in body.pairs:
        document: dict[str, Any] = {
            "prompt": pair.prompt,
            "chosen": pair.chosen,
            "rejected": pair.rejected,
        }
        if pair.tools is not None:
            document["tools"] = pair.tools
        pairs.append(document)
    return pairs


def nat_pairs(collection: NatDpoCollection) -> list[dict[str, Any]]:
    """Every DPO item of a NAT collection, in order (groups, trajectories, items)."""
    pairs = []
    for group in collection.trajectories:
        for trajectory in group:
            for item in trajectory.episode:
                prompt = (
                    [{"role": "user", "content": item.prompt}]
                    if isinstance(item.prompt, str)
                    else [{"role": m.role, "content": m.content} for m in item.prompt]
                )
                pairs.append(
                    {
                        "prompt": prompt,
                        "chosen": item.chosen_response,
                        "rejected": item.rejected_response,
                    }
                )
    return pairs


def dpo_problems(body: DpoJobCreate) -> list[dict[str, Any]]:
    """What the pydantic models cannot say of a NAT collection: it holds no pair, a pair
    whose answers are the same, or a prompt message of no OpenAI role (each at its path)."""
    if body.collection is None:
        return []
    errors: list[dict[str, Any]] = []
    count = 0
    for g, group in enumerate(body.collection.trajectories):
        for t, trajectory in enumerate(group):
            for i, item in enumerate(trajectory.episode):
                count += 1
                if item.chosen_response == item.rejected_response:
                    loc = ("collection", "trajectories", g, t, "episode", i, "rejected_response")
                    errors.append(
                        {
                            "loc": loc,
                            "msg": "the same as `chosen_response`: nothing to prefer",
                            "type": "same_answers",
                        }
                    )
                if isinstance(item.prompt, list) and not item.prompt:
                    loc = ("collection", "trajectories", g, t, "episode", i, "prompt")
                    errors.append({"loc": loc, "msg": "an empty prompt", "type": "too_short"})
                for j, message in enumerate(item.prompt if isinstance(item.prompt, list) else ()):
                    if message.role not in ROLES:  # as a plain pair's prompt is refused
                        at = ("collection", "trajectories", g, t, "episode", i, "prompt", j)
                        errors.append(
                            {
                                "loc": (*at, "role"),
                                "msg": f"Input should be one of {', '.join(sorted(ROLES))}",
                                "type": "literal_error",
                            }
                        )
    if count == 0:
        errors.append(
            {
                "loc": ("collection", "trajectories"),
                "msg": "no DPO item: nothing to train on",
                "type": "too_short",
            }
        )
    return errors


def encode_dpo(pairs: list[dict[str, Any]]) -> tuple[Payload, DpoSummary]:
    return DPO.encode({"pairs": pairs}), DpoSummary(num_pairs=len(pairs))


def stored_pairs(payload: Payload) -> list[dict[str, Any]]:
    return DPO.decode(payload.format, payload.data, payload.size)


def stored_examples(payload: Payload) -> list[dict[str, Any]]:
    return SFT.decode(payload.format, payload.data, payload.size)


def is_rl(payload_format: str) -> bool:
    return payload_format in spec.CODEC.decoders
