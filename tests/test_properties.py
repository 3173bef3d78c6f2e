"""Properties of the trajectory wire formats and their conversion to real `art` objects.

Generated NAT collections and ART-style groups (as JSON, parsed the way the API parses a
request body) must pass the checks and convert to `art.TrajectoryGroup`s that keep every
reward, group size, message, and logprob token in order. Broken ones must be refused with
the project's own errors, at a location that exists in the submitted document, and never
with an unexpected exception. Whatever passes the checks must convert. Conversions that go
from one format to the other and back must keep what they carry.

Runs derandomized when the CI environment variable is set.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable
from typing import Any

import art
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat.chat_completion import Choice
from pydantic import ValidationError

from app.jobs.payloads import Payload, compress
from app.models import JobRow
from app.rollouts.service import to_collection
from app.schemas.jobs import TrainingJobCreate
from app.schemas.trajectories import ArtTrajectoryGroup, TrajectoryCollection
from app.training import spec as training_spec
from app.trajectories import (
    check_collection,
    check_groups,
    collection_to_art,
    groups_to_art,
    summarize_collection,
    summarize_groups,
)

CI = bool(os.environ.get("CI"))
PROPERTY = settings(
    max_examples=25,
    deadline=None,
    derandomize=CI,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

Json = Any
Path = tuple[str | int, ...]

# ---------------------------------------------------------------------------------------------
# Strategies: documents exactly as NAT and ART-style clients send them
# ---------------------------------------------------------------------------------------------

finite = st.floats(allow_nan=False, allow_infinity=False)
text = st.text(max_size=12)
json_values: st.SearchStrategy[Json] = st.recursive(
    # Integers past a float's range too: JSON has no limit, and float() of one overflows.
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**1024) | finite | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
FINISH_REASONS = ["stop", "length", "tool_calls", "content_filter", "function_call"]


@st.composite
def token_logprobs(draw: st.DrawFn, *, nested: bool = True) -> dict[str, Json]:
    """One OpenAI `ChatCompletionTokenLogprob`, as vLLM returns it (token ids as tokens)."""
    entry: dict[str, Json] = {
        "token": f"token_id:{draw(st.integers(0, 200_000))}",
        "logprob": draw(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)),
    }
    if draw(st.booleans()):
        entry["bytes"] = draw(st.none() | st.lists(st.integers(0, 255), max_size=4))
    if nested and draw(st.booleans()):
        alternatives = st.lists(token_logprobs(nested=False), max_size=2)
        entry["top_logprobs"] = draw(st.none() | alternatives)
    return entry


@st.composite
def choice_logprobs(draw: st.DrawFn) -> dict[str, Json]:
    logprobs: dict[str, Json] = {
        "content": draw(st.lists(token_logprobs(), min_size=1, max_size=5))
    }
    if draw(st.booleans()):
        logprobs["refusal"] = None
    return logprobs


@st.composite
def tool_calls(draw: st.DrawFn) -> list[dict[str, Json]]:
    """Tool calls as NAT records them: LangChain `{name, args, id}` or OpenAI-shaped."""
    calls = []
    for i in range(draw(st.integers(1, 2))):
        name = draw(st.from_regex(r"[a-z_]{1,8}", fullmatch=True))
        args = draw(st.dictionaries(text, json_values, max_size=2))
        if draw(st.booleans()):
            calls.append({"name": name, "args": args, "id": f"call_{i}", "type": "tool_call"})
        else:
            arguments = json.dumps(args)
            calls.append(
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
    return calls


def nat_item(role: str, content: str, logprobs: Json = None, metadata: Json = None) -> dict:
    return {"role": role, "content": content, "logprobs": logprobs, "metadata": metadata}


@st.composite
def nat_assistant(draw: st.DrawFn, *, with_logprobs: bool = True) -> dict[str, Json]:
    metadata: dict[str, Json] = {}
    if with_logprobs and draw(st.booleans()):
        metadata["tool_calls"] = draw(tool_calls())
    if draw(st.booleans()):
        metadata["finish_reason"] = draw(st.sampled_from(FINISH_REASONS))
    logprobs = draw(choice_logprobs()) if with_logprobs else None
    return nat_item("assistant", draw(text), logprobs, metadata or None)


@st.composite
def nat_context(draw: st.DrawFn, *, tool_call_ids: bool = False) -> dict[str, Json]:
    """A turn between two assistant turns: a tool result, the user, or someone else.
    `tool_call_ids`: every tool result names its call (NAT's LlamaIndex parser drops it)."""
    role = draw(st.sampled_from(["tool", "user", "environment", "other", "function"]))
    metadata: Json = None
    if role == "tool":
        ids = st.fixed_dictionaries({"tool_call_id": st.integers() | text})
        metadata = draw(ids if tool_call_ids else st.none() | ids)
    elif role == "function":
        metadata = draw(st.none() | st.fixed_dictionaries({"name": text}))
    return nat_item(role, draw(text), None, metadata)


@st.composite
def nat_episode(
    draw: st.DrawFn, *, with_logprobs: bool = True, tool_call_ids: bool = False
) -> list[dict[str, Json]]:
    """Valid by NAT's rules: system turns first, then a user turn, then assistant turns with
    at least one other turn between any two of them."""
    episode = [nat_item("system", draw(text)) for _ in range(draw(st.integers(0, 2)))]
    episode.append(nat_item("user", draw(text)))
    steps = draw(st.integers(1, 3))
    for step in range(steps):
        episode.append(draw(nat_assistant(with_logprobs=with_logprobs)))
        least = 0 if step == steps - 1 else 1
        between = st.lists(nat_context(tool_call_ids=tool_call_ids), min_size=least, max_size=2)
        episode += draw(between)
    return episode


@st.composite
def nat_trajectory(draw: st.DrawFn, **episode: bool) -> dict[str, Json]:
    return {
        "episode": draw(nat_episode(**episode)),
        "reward": draw(finite),
        "shaped_rewards": draw(st.none() | st.lists(finite, max_size=3)),
        "metadata": draw(st.none() | st.dictionaries(text, json_values, max_size=3)),
    }


def nat_collections(**episode: bool) -> st.SearchStrategy[dict[str, Json]]:
    group = st.lists(nat_trajectory(**episode), min_size=1, max_size=3)
    return st.fixed_dictionaries(
        {"trajectories": st.lists(group, min_size=1, max_size=3), "run_id": text}
    )


@st.composite
def art_choice(draw: st.DrawFn) -> dict[str, Json]:
    """An OpenAI `Choice` as `completion.choices[0].model_dump()` gives it, maybe with
    vLLM's extra fields."""
    message: dict[str, Json] = {"role": "assistant", "content": draw(st.none() | text)}
    finish_reason = draw(st.sampled_from(FINISH_REASONS))
    if draw(st.booleans()):
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            for i in range(draw(st.integers(1, 2)))
        ]
    choice = {
        "finish_reason": finish_reason,
        "index": 0,
        "message": message,
        "logprobs": draw(choice_logprobs()),
    }
    if draw(st.booleans()):
        choice["token_ids"] = draw(st.lists(st.integers(0, 200_000), max_size=3))
    return choice


@st.composite
def art_context(draw: st.DrawFn, *, nat_shaped: bool = False) -> dict[str, Json]:
    roles = ["user", "tool"] if nat_shaped else ["user", "tool", "assistant", "developer", "system"]
    role = draw(st.sampled_from(roles))
    message: dict[str, Json] = {"role": role, "content": draw(text)}
    if role == "tool":
        message["tool_call_id"] = draw(text)
    return message


@st.composite
def art_trajectory(draw: st.DrawFn, *, nat_shaped: bool = False) -> dict[str, Json]:
    """`nat_shaped`: as NAT's rules want, system messages only first, and no two assistant
    turns in a row (no assistant message as context, and something between two answers)."""
    first = {"role": draw(st.sampled_from(["system", "user"])), "content": draw(text)}
    items = [first]
    for step in range(draw(st.integers(1, 3))):
        least = 1 if nat_shaped and step else 0
        items += draw(st.lists(art_context(nat_shaped=nat_shaped), min_size=least, max_size=2))
        items.append(draw(art_choice()))
    scalars = st.none() | st.booleans() | st.integers() | finite | text
    return {
        "messages_and_choices": items,
        "reward": draw(finite),
        "metrics": draw(st.dictionaries(text, st.booleans() | st.integers() | finite, max_size=2)),
        "metadata": draw(st.dictionaries(text, scalars, max_size=2)),
        "logs": draw(st.lists(text, max_size=2)),
    }


def art_group_lists(*, nat_shaped: bool = False) -> st.SearchStrategy[list[dict[str, Json]]]:
    trajectories = art_trajectory(nat_shaped=nat_shaped)
    group = st.fixed_dictionaries(
        {"trajectories": st.lists(trajectories, min_size=1, max_size=3)},
        optional={
            "metadata": st.dictionaries(text, st.none() | st.integers() | text, max_size=2),
            "logs": st.lists(text, max_size=2),
        },
    )
    return st.lists(group, min_size=1, max_size=3)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def parse_collection(document: Json) -> TrajectoryCollection:
    """As the API parses a request body: from JSON text."""
    return TrajectoryCollection.model_validate_json(json.dumps(document))


def parse_groups(document: Json) -> list[ArtTrajectoryGroup]:
    return [ArtTrajectoryGroup.model_validate_json(json.dumps(group)) for group in document]


def paths(document: Json, prefix: Path = ()) -> list[Path]:
    """Every location in a JSON document, the root included."""
    found = [prefix]
    if isinstance(document, dict):
        for key, value in document.items():
            found += paths(value, (*prefix, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found += paths(value, (*prefix, index))
    return found


def resolves(document: Json, loc: Path) -> bool:
    """Whether `loc` points into `document`: every step but the last exists; the last one
    exists too, or names a key of an object (one that is missing, e.g. `logprobs`)."""
    node = document
    for depth, part in enumerate(loc):
        last = depth == len(loc) - 1
        if isinstance(node, dict) and isinstance(part, str):
            if part not in node:
                return last
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            return False
    return True


def replace(document: Json, loc: Path, value: Json) -> Json:
    if not loc:
        return value
    copied = copy.deepcopy(document)
    node = copied
    for part in loc[:-1]:
        node = node[part]
    node[loc[-1]] = value
    return copied


def tokens(logprobs: Json) -> list[tuple[str, float]]:
    return [(entry["token"], entry["logprob"]) for entry in logprobs["content"]]


def converted_tokens(choice: Choice) -> list[tuple[str, float]]:
    assert choice.logprobs is not None and choice.logprobs.content is not None
    return [(entry.token, entry.logprob) for entry in choice.logprobs.content]


def openai_calls(calls: list[dict[str, Json]]) -> list[tuple[str, str, Json]]:
    """What NAT's calls mean in OpenAI's shape (arguments decoded, to compare as values)."""
    result = []
    for call in calls:
        if "function" in call:
            function = call["function"]
            result.append((call["id"], function["name"], json.loads(function["arguments"])))
        else:
            result.append((call["id"], call["name"], call["args"]))
    return result


def assert_same_groups(a: list[art.TrajectoryGroup], b: list[art.TrajectoryGroup]) -> None:
    assert [len(g.trajectories) for g in a] == [len(g.trajectories) for g in b]
    for group_a, group_b in zip(a, b, strict=True):
        for t_a, t_b in zip(group_a.trajectories, group_b.trajectories, strict=True):
            assert (t_a.reward, t_a.metadata, t_a.tools) == (t_b.reward, t_b.metadata, t_b.tools)
            assert t_a.messages_and_choices == t_b.messages_and_choices


def same_float(a: float, b: float) -> bool:
    return a == b and math.copysign(1, a) == math.copysign(1, b)


# ---------------------------------------------------------------------------------------------
# NAT collections
# ---------------------------------------------------------------------------------------------


@PROPERTY
@given(nat_collections())
def test_valid_nat_collections_convert_keeping_what_they_carry(document: Json) -> None:
    collection = parse_collection(document)
    assert check_collection(collection) == []
    groups = collection_to_art(collection)

    assert all(type(group) is art.TrajectoryGroup for group in groups)
    assert [len(g.trajectories) for g in groups] == [len(g) for g in document["trajectories"]]
    for raw_group, group in zip(document["trajectories"], groups, strict=True):
        for raw, trajectory in zip(raw_group, group.trajectories, strict=True):
            assert isinstance(trajectory, art.Trajectory)
            assert same_float(trajectory.reward, raw["reward"])
            assert len(trajectory.messages_and_choices) == len(raw["episode"])
            for item, converted in zip(
                raw["episode"], trajectory.messages_and_choices, strict=True
            ):
                check_nat_item(item, converted)
            for key, value in (raw["metadata"] or {}).items():
                kept = trajectory.metadata[key]
                scalar = value is None or isinstance(value, bool | int | float | str)
                assert kept == value if scalar else json.loads(str(kept)) == value
            # ART itself reads the turns back as chat messages, one per episode item.
            assert len(trajectory.messages()) == len(raw["episode"])

    summary = summarize_collection(collection)
    rewards = [[t["reward"] for t in group] for group in document["trajectories"]]
    assert summary.num_groups == len(rewards)
    assert summary.num_trajectories == sum(map(len, rewards))
    assert summary.untrainable_groups == [g for g, r in enumerate(rewards) if len(set(r)) < 2]


def check_nat_item(item: dict[str, Json], converted: Json) -> None:
    role, content, metadata = item["role"], item["content"], item["metadata"] or {}
    if role == "assistant" and item["logprobs"] is not None:
        assert isinstance(converted, Choice)
        assert converted.message.content == content
        assert converted_tokens(converted) == tokens(item["logprobs"])
        assert converted.logprobs is not None
        kept_entries = converted.logprobs.content or []
        for entry, kept in zip(item["logprobs"]["content"], kept_entries, strict=True):
            alternatives = entry.get("top_logprobs") or []
            assert [(t.token, t.logprob) for t in kept.top_logprobs] == [
                (t["token"], t["logprob"]) for t in alternatives
            ]
        calls = metadata.get("tool_calls") or []
        expected_finish = metadata.get("finish_reason") or ("tool_calls" if calls else "stop")
        assert converted.finish_reason == expected_finish
        kept_calls = [
            (c.id, c.function.name, json.loads(c.function.arguments))
            for c in converted.message.tool_calls or []
            if c.type == "function"
        ]
        assert kept_calls == openai_calls(calls)
    elif role == "assistant":
        assert converted == {"role": "assistant", "content": content}
    elif role in ("system", "user"):
        assert converted == {"role": role, "content": content}
    elif role == "tool":
        expected = {"role": "tool", "content": content}
        if metadata.get("tool_call_id") is not None:
            expected["tool_call_id"] = str(metadata["tool_call_id"])
        assert converted == expected
    elif role == "function":
        assert converted == {
            "role": "function",
            "name": str(metadata.get("name") or ""),
            "content": content,
        }
    else:  # environment, other: chat templates know no such roles
        assert converted == {"role": "user", "content": content}


@PROPERTY
@given(nat_collections(with_logprobs=False))
def test_without_logprobs_only_an_opted_out_job_trains(document: Json) -> None:
    collection = parse_collection(document)
    assistants = [
        ("trajectories", g, t, "episode", k, "logprobs")
        for g, group in enumerate(document["trajectories"])
        for t, trajectory in enumerate(group)
        for k, item in enumerate(trajectory["episode"])
        if item["role"] == "assistant"
    ]
    missing = check_collection(collection)
    assert [(i.loc, i.type) for i in missing] == [(loc, "missing_logprobs") for loc in assistants][
        :100
    ]
    assert check_collection(collection, require_logprobs=False) == []
    groups = collection_to_art(collection)
    assert not any(isinstance(i, Choice) for g in groups for t in g for i in t.messages_and_choices)


def _drop_logprobs(item: Json) -> tuple[Json, Path, str]:
    return {**item, "logprobs": None, "metadata": None}, ("logprobs",), "missing_logprobs"


def _bad_token(field: str, value: Json) -> Callable[[Json], tuple[Json, Path, str]]:
    def mutate(item: Json) -> tuple[Json, Path, str]:
        logprobs = copy.deepcopy(item["logprobs"])
        last = len(logprobs["content"]) - 1
        logprobs["content"][last][field] = value
        return (
            {**item, "logprobs": logprobs},
            ("logprobs", "content", last, field),
            "invalid_logprobs",
        )

    return mutate


def _refusal(value: Json) -> Callable[[Json], tuple[Json, Path, str]]:
    def mutate(item: Json) -> tuple[Json, Path, str]:
        logprobs = {**item["logprobs"], "refusal": value}
        loc: Path = (
            ("logprobs", "refusal")
            if not isinstance(value, list)
            else ("logprobs", "refusal", 0, "logprob")
        )
        return {**item, "logprobs": logprobs}, loc, "invalid_logprobs"

    return mutate


def _not_logprobs(value: Json) -> Callable[[Json], tuple[Json, Path, str]]:
    def mutate(item: Json) -> tuple[Json, Path, str]:
        loc: Path = ("logprobs",) if not isinstance(value, dict) else ("logprobs", "content")
        return {**item, "logprobs": value}, loc, "invalid_logprobs"

    return mutate


DEFECTS = {
    "no logprobs": _drop_logprobs,
    "token not a string": _bad_token("token", 7),
    "logprob a string": _bad_token("logprob", "-0.5"),
    "logprob a boolean": _bad_token("logprob", True),
    "logprob null": _bad_token("logprob", None),
    "logprob NaN": _bad_token("logprob", math.nan),
    "logprob past a float's range": _bad_token("logprob", 10**400),
    "bytes a string": _bad_token("bytes", "ab"),
    "refusal not a list": _refusal(False),
    "refusal entry without logprob": _refusal([{"token": "token_id:1"}]),
    "logprobs a list": _not_logprobs([{"token": "token_id:1", "logprob": -0.1}]),
    "logprobs a string": _not_logprobs("-0.1"),
    "logprobs of another API": _not_logprobs({"tokens": ["a"], "token_logprobs": [-0.1]}),
    "no tokens": _not_logprobs({"content": []}),
}


@pytest.mark.parametrize("defect", DEFECTS.values(), ids=DEFECTS.keys())
@settings(PROPERTY, max_examples=5)
@given(nat_collections(), st.data())
def test_a_broken_assistant_turn_is_reported_where_it_is(
    defect: Callable[[Json], tuple[Json, Path, str]], document: Json, data: st.DataObject
) -> None:
    assistants = [
        loc
        for loc in paths(document)
        if len(loc) == 5
        and loc[3] == "episode"
        and isinstance(node := _at(document, loc), dict)
        and node.get("role") == "assistant"
    ]
    target = data.draw(st.sampled_from(assistants))
    broken, relative, kind = defect(_at(document, target))
    document = replace(document, target, broken)

    issues = check_collection(parse_collection(document))
    assert (("trajectories", *target[1:], *relative), kind) in {(i.loc, i.type) for i in issues}
    astray = [issue for issue in issues if not resolves(document, issue.loc)]
    assert astray == []


def _at(document: Json, loc: Path) -> Json:
    for part in loc:
        document = document[part]
    return document


@PROPERTY
@given(nat_collections(), st.data(), json_values)
def test_any_nat_document_is_refused_cleanly_or_converts(
    document: Json, data: st.DataObject, value: Json
) -> None:
    """Replace any part with any JSON: the result is a ValidationError, issues that point
    into the document, or real ART groups. Nothing else."""
    loc = data.draw(st.sampled_from(paths(document)))
    document = replace(document, loc, value)
    try:
        collection = parse_collection(document)
    except ValidationError:
        return
    for require_logprobs in (True, False):
        issues = check_collection(collection, require_logprobs=require_logprobs)
        astray = [issue for issue in issues if not resolves(document, issue.loc)]
        assert astray == []
        if not issues:
            groups = collection_to_art(collection)
            assert len(groups) == len(collection.trajectories)


# ---------------------------------------------------------------------------------------------
# ART-style groups
# ---------------------------------------------------------------------------------------------


@PROPERTY
@given(art_group_lists())
def test_valid_art_groups_convert_keeping_what_they_carry(document: Json) -> None:
    groups_in = parse_groups(document)
    assert check_groups(groups_in) == []
    groups = groups_to_art(groups_in)

    assert [len(g.trajectories) for g in groups] == [len(g["trajectories"]) for g in document]
    for raw_group, group in zip(document, groups, strict=True):
        assert group.metadata == raw_group.get("metadata", {})
        assert group.logs == raw_group.get("logs", [])
        for raw, trajectory in zip(raw_group["trajectories"], group.trajectories, strict=True):
            assert same_float(trajectory.reward, raw["reward"])
            assert (trajectory.metrics, trajectory.metadata, trajectory.logs) == (
                raw["metrics"],
                raw["metadata"],
                raw["logs"],
            )
            items = raw["messages_and_choices"]
            assert len(trajectory.messages_and_choices) == len(items)
            for item, converted in zip(items, trajectory.messages_and_choices, strict=True):
                if "finish_reason" in item:
                    assert isinstance(converted, Choice)
                    assert converted.finish_reason == item["finish_reason"]
                    assert converted.message.content == item["message"]["content"]
                    assert converted_tokens(converted) == tokens(item["logprobs"])
                    assert converted.model_extra == (
                        {"token_ids": item["token_ids"]} if "token_ids" in item else {}
                    )
                else:
                    assert converted == item
            assert [m["role"] for m in trajectory.messages()] == [
                "assistant" if "finish_reason" in i else i["role"] for i in items
            ]
    rewards = [[t["reward"] for t in g["trajectories"]] for g in document]
    assert summarize_groups(groups_in).untrainable_groups == [
        g for g, r in enumerate(rewards) if len(set(r)) < 2
    ]


@PROPERTY
@given(art_group_lists(), st.data(), json_values)
def test_any_art_document_is_refused_cleanly_or_converts(
    document: Json, data: st.DataObject, value: Json
) -> None:
    loc = data.draw(st.sampled_from(paths(document)))
    document = replace(document, loc, value)
    if not isinstance(document, list):
        return  # the API's `groups` field is a list; anything else fails in its model
    try:
        groups = parse_groups(document)
    except ValidationError:
        return
    for require_logprobs in (True, False):
        issues = check_groups(groups, require_logprobs=require_logprobs)
        astray = [issue for issue in issues if not resolves(document, issue.loc)]
        assert astray == []
        if not issues:
            converted = groups_to_art(groups)
            assert [len(g.trajectories) for g in converted] == [len(g.trajectories) for g in groups]


# ---------------------------------------------------------------------------------------------
# Round trips the code offers
# ---------------------------------------------------------------------------------------------


@PROPERTY
@given(art_group_lists(nat_shaped=True))
def test_rollout_groups_read_as_nat_convert_to_the_same_art_turns(document: Json) -> None:
    """A rollout stores ART-style groups and serves them as a NAT collection
    (`GET /v1/rollout-jobs/{id}/trajectories`); that collection converts back to the same
    ART turns, rewards and logprobs."""
    raw = json.dumps(document).encode()
    job = JobRow(
        id="job_roundtrip",
        status="succeeded",
        output=zstandard.ZstdCompressor().compress(raw),
        output_bytes=len(raw),
    )
    collection = to_collection(job)
    assert check_collection(collection, require_logprobs=False) == []
    back = collection_to_art(collection)
    direct = groups_to_art(parse_groups(document))
    for group_back, group_direct in zip(back, direct, strict=True):
        for t_back, t_direct in zip(
            group_back.trajectories, group_direct.trajectories, strict=True
        ):
            assert t_back.reward == t_direct.reward
            assert len(t_back.messages_and_choices) == len(t_direct.messages_and_choices)
            for a, b in zip(
                t_back.messages_and_choices, t_direct.messages_and_choices, strict=True
            ):
                if isinstance(b, Choice):
                    assert isinstance(a, Choice)
                    assert (a.finish_reason, a.message.content or "") == (
                        b.finish_reason,
                        b.message.content or "",
                    )
                    assert converted_tokens(a) == converted_tokens(b)
                    assert a.message.tool_calls == b.message.tool_calls
                else:
                    expected = {**b, "role": {"developer": "system"}.get(b["role"], b["role"])}
                    assert a == expected


@PROPERTY
@given(nat_collections())
def test_stored_training_payloads_load_as_the_same_groups(document: Json) -> None:
    """A training job stores its groups as ART JSON (a NAT collection is converted at the
    edge); jobs queued before versioned specs stored the whole request. The worker rebuilds
    the same groups from both."""
    raw = json.dumps({"model": "m", "collection": document}).encode()
    body = TrainingJobCreate.model_validate_json(raw)
    stored = training_spec.encode(training_spec.groups_of(body))
    assert stored.format == training_spec.V1
    loaded = training_spec.decode(stored)
    legacy = training_spec.decode(Payload(training_spec.REQUEST_V0, compress(raw), len(raw)))
    assert_same_groups(loaded, legacy)
    assert_same_groups(loaded, collection_to_art(parse_collection(document)))


@PROPERTY
@given(nat_collections(tool_call_ids=True))  # ART-style tool messages need one
def test_converted_nat_trajectories_are_valid_art_wire_input(document: Json) -> None:
    """An agent may answer in NAT's format; the worker converts it and carries it on as an
    ART-style trajectory (JSON). That JSON passes the ART checks and converts to the same
    turns."""
    for group in collection_to_art(parse_collection(document)):
        # As TrainyardBackend dumps it, defaults included (ART 0.5.23 leaves them out unless
        # told; pydantic warns that message dicts are not its TypedDicts).
        dumped = [
            t.model_dump(mode="json", exclude_defaults=False, warnings=False)
            for t in group.trajectories
        ]
        wire = [{"trajectories": dumped}]
        parsed = parse_groups(wire)
        assert check_groups(parsed) == []
        [again] = groups_to_art(parsed)
        for before, after in zip(group.trajectories, again.trajectories, strict=True):
            assert after.reward == before.reward
            assert after.messages_and_choices == before.messages_and_choices
