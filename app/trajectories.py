"""Semantic checks on submitted trajectories; NAT <-> ART conversion, both directions; and
the conversion to real ART objects.

Pure functions: no database, no HTTP. The checks report every problem they find (up to
`MAX_ISSUES`) with a location relative to the submitted collection or groups list, so the API
can point at the bad item. The conversions assume input that passed the checks.

Rules that come from ART 0.5.18 itself (`art.preprocessing.tokenize`):

- A turn is trainable only as an OpenAI `Choice` carrying `ChoiceLogprobs`; token ids are read
  from `"token_id:N"` tokens. Plain message dicts are context, unless the job trains without
  logprobs, in which case ART re-encodes assistant dicts and raises on ones with `tool_calls`.
- `Trajectory.metadata` holds scalars only; `TrajectoryGroup.model_validate` is broken, so
  groups are built from a list of `art.Trajectory` objects.

`art` is imported lazily by the conversions: the checks do not need it, and it is slow to import.
So is `openai` (about a second: its package imports every type it has), whose `Choice` and
tool types the checks validate against: on first use, so that a process starts without it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from itertools import islice
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from app.schemas.trajectories import (
    ArtTrajectory,
    ArtTrajectoryGroup,
    EpisodeItem,
    EpisodeItemRole,
    NatTrajectory,
    TrajectoryCollection,
    TrajectorySummary,
)

if TYPE_CHECKING:
    import art
    from openai.types.chat.chat_completion import Choice
    from openai.types.chat.chat_completion_tool_param import ChatCompletionToolParam

MAX_ISSUES = 100
MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool", "function", "developer"})

Loc = tuple[str | int, ...]
_Problem = tuple[Loc, str, str]  # (loc relative to the item, message, type)


@cache
def _choice() -> type[Choice]:
    from openai.types.chat.chat_completion import Choice

    return Choice


@cache
def _tools_adapter() -> TypeAdapter[list[ChatCompletionToolParam]]:
    from openai.types.chat.chat_completion_tool_param import ChatCompletionToolParam

    return TypeAdapter(list[ChatCompletionToolParam])


# ART 0.5.18 re-encodes logprob-less assistant turns from their text and raises on tool calls.
_TOOL_CALLS_NEED_LOGPROBS: _Problem = (
    ("logprobs",),
    "an assistant turn with tool_calls needs logprobs: ART cannot train it from its text alone",
    "tool_calls_need_logprobs",
)


@dataclass(frozen=True)
class TrajectoryIssue:
    """One problem in submitted trajectories."""

    loc: Loc
    msg: str
    type: str


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def check_collection(
    collection: TrajectoryCollection, *, require_logprobs: bool = True
) -> list[TrajectoryIssue]:
    """Every problem (at most `MAX_ISSUES`) that would keep a NAT collection from training.

    Locations start at the collection, e.g. `("trajectories", 3, 1, "episode", 4, "logprobs")`.
    """
    return list(islice(_collection_issues(collection, require_logprobs), MAX_ISSUES))


def check_groups(
    groups: Sequence[ArtTrajectoryGroup], *, require_logprobs: bool = True
) -> list[TrajectoryIssue]:
    """Every problem (at most `MAX_ISSUES`) that would keep ART-style groups from training.

    Locations start at the groups list, e.g. `(0, "trajectories", 1, "messages_and_choices", 2)`.
    """
    return list(islice(_groups_issues(groups, require_logprobs), MAX_ISSUES))


def _collection_issues(
    collection: TrajectoryCollection, require_logprobs: bool
) -> Iterator[TrajectoryIssue]:
    if not collection.trajectories:
        yield TrajectoryIssue(("trajectories",), "nothing to train: no groups", "nothing_to_train")
    for g, group in enumerate(collection.trajectories):
        yield from nat_group_issues(g, group, require_logprobs)


def nat_group_issues(
    g: int, group: Sequence[NatTrajectory], require_logprobs: bool
) -> Iterator[TrajectoryIssue]:
    """The problems of a collection's group `g` (locations start at the collection)."""
    if not group:
        yield TrajectoryIssue(("trajectories", g), "the group is empty", "empty_group")
    for t, trajectory in enumerate(group):
        for loc, msg, type_ in _nat_trajectory_problems(trajectory, require_logprobs):
            yield TrajectoryIssue(("trajectories", g, t, *loc), msg, type_)


def _nat_trajectory_problems(
    trajectory: NatTrajectory, require_logprobs: bool
) -> Iterator[_Problem]:
    episode = trajectory.episode
    if not episode:
        yield ("episode",), "the episode is empty", "empty_episode"
        return
    if episode[0].role not in (EpisodeItemRole.SYSTEM, EpisodeItemRole.USER):
        yield (
            ("episode", 0, "role"),
            f"the episode must start with a system or user turn, not {episode[0].role.value}",
            "invalid_first_role",
        )
    seen_non_system = False
    previous: EpisodeItemRole | None = None
    for k, item in enumerate(episode):
        role = item.role
        if role is EpisodeItemRole.SYSTEM and seen_non_system:
            yield (
                ("episode", k, "role"),
                "system turns are only allowed at the start of the episode",
                "misplaced_system",
            )
        seen_non_system = seen_non_system or role is not EpisodeItemRole.SYSTEM
        if role is EpisodeItemRole.ASSISTANT:
            if previous is EpisodeItemRole.ASSISTANT:
                yield (
                    ("episode", k, "role"),
                    "two assistant turns in a row",
                    "consecutive_assistant",
                )
            problem = _nat_assistant_problem(item, require_logprobs)
            if problem is not None:
                loc, msg, type_ = problem
                yield ("episode", k, *loc), msg, type_
        previous = role
    if not any(item.role is EpisodeItemRole.ASSISTANT for item in episode):
        yield ("episode",), "the episode has no assistant turn to train on", "no_assistant_turn"


def _nat_assistant_problem(item: EpisodeItem, require_logprobs: bool) -> _Problem | None:
    if item.logprobs is None:
        if require_logprobs:
            return ("logprobs",), "assistant turns need logprobs", "missing_logprobs"
        if (item.metadata or {}).get("tool_calls"):
            return _TOOL_CALLS_NEED_LOGPROBS
        return None
    problem = _logprobs_problem(item.logprobs)
    if problem is not None:
        return problem
    try:
        _choice().model_validate(_nat_choice_dict(item, logprobs=None))
    except ValidationError as exc:
        loc, msg = _first_error(exc)
        if loc[:1] == ("finish_reason",):
            loc = ("metadata", *loc)
        elif loc[:2] == ("message", "tool_calls"):
            loc = ("metadata", *loc[1:])
        return (
            _within({"content": item.content, "metadata": item.metadata}, loc),
            msg,
            "invalid_choice",
        )
    return None


def _groups_issues(
    groups: Sequence[ArtTrajectoryGroup], require_logprobs: bool
) -> Iterator[TrajectoryIssue]:
    if not groups:
        yield TrajectoryIssue((), "nothing to train: no groups", "nothing_to_train")
    for g, group in enumerate(groups):
        yield from art_group_issues(g, group, require_logprobs)


def art_group_issues(
    g: int, group: ArtTrajectoryGroup, require_logprobs: bool
) -> Iterator[TrajectoryIssue]:
    """The problems of group `g` (locations start at the groups list)."""
    if not group.trajectories:
        yield TrajectoryIssue((g, "trajectories"), "the group is empty", "empty_group")
    for t, trajectory in enumerate(group.trajectories):
        for loc, msg, type_ in _art_trajectory_problems(trajectory, require_logprobs):
            yield TrajectoryIssue((g, "trajectories", t, *loc), msg, type_)


def _art_trajectory_problems(
    trajectory: ArtTrajectory, require_logprobs: bool
) -> Iterator[_Problem]:
    items = trajectory.messages_and_choices
    if not items:
        yield ("messages_and_choices",), "messages_and_choices is empty", "empty_episode"
        return
    first = items[0]
    if _is_choice(first) or first.get("role") not in ("system", "user"):
        yield (
            ("messages_and_choices", 0),
            "the first item must be a system or user message",
            "invalid_first_role",
        )
    trainable = False
    for k, item in enumerate(items):
        if _is_choice(item):
            trainable = True
            problem = _art_choice_problem(item, require_logprobs)
        else:
            trainable = trainable or (not require_logprobs and item.get("role") == "assistant")
            problem = _art_message_problem(item, require_logprobs)
        if problem is not None:
            loc, msg, type_ = problem
            yield ("messages_and_choices", k, *loc), msg, type_
    if not trainable:
        yield (
            ("messages_and_choices",),
            "no trainable turn: add an assistant Choice with logprobs",
            "no_trainable_turn",
        )
    if trajectory.tools is not None:
        try:
            _tools_adapter().validate_python(trajectory.tools)
        except ValidationError as exc:
            loc, msg = _first_error(exc)
            yield ("tools", *_within(trajectory.tools, loc)), msg, "invalid_tools"


def _art_choice_problem(item: dict[str, Any], require_logprobs: bool) -> _Problem | None:
    message = item.get("message")
    if isinstance(message, dict) and message.get("role") != "assistant":
        return ("message", "role"), "a Choice's message must have role assistant", "invalid_role"
    logprobs = item.get("logprobs")
    if logprobs is None:
        if require_logprobs:
            return ("logprobs",), "assistant turns need logprobs", "missing_logprobs"
    else:
        problem = _logprobs_problem(logprobs)
        if problem is not None:
            return problem
    try:
        # Logprobs were checked above; validating them again with pydantic is ~10x slower.
        _choice().model_validate({**item, "logprobs": None})
    except ValidationError as exc:
        loc, msg = _first_error(exc)
        return _within(item, loc), msg, "invalid_choice"
    return None


def _art_message_problem(item: dict[str, Any], require_logprobs: bool) -> _Problem | None:
    role = item.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        allowed = ", ".join(sorted(MESSAGE_ROLES))
        return ("role",), f"role must be one of {allowed}, got {role!r}", "invalid_role"
    if role == "tool" and not isinstance(item.get("tool_call_id"), str):
        return ("tool_call_id",), "tool messages need a string tool_call_id", "missing_tool_call_id"
    if role == "assistant" and not require_logprobs and item.get("tool_calls"):
        _, msg, type_ = _TOOL_CALLS_NEED_LOGPROBS
        return ("tool_calls",), msg, type_
    return None


def _logprobs_problem(logprobs: Any) -> _Problem | None:
    """The first way `logprobs` differs from OpenAI's `ChoiceLogprobs`, if any."""
    expected = 'expected OpenAI ChoiceLogprobs {"content": [{"token": ..., "logprob": ...}, ...]}'
    if not isinstance(logprobs, dict):
        return ("logprobs",), f"{expected}, got {_json_kind(logprobs)}", "invalid_logprobs"
    content = logprobs.get("content")
    if not isinstance(content, list) or not content:
        got = f"keys {sorted(logprobs)}" if "content" not in logprobs else _json_kind(content)
        return (
            ("logprobs", "content"),
            f"{expected}: content must be a non-empty list, got {got}",
            "invalid_logprobs",
        )
    refusal = logprobs.get("refusal")
    if refusal is not None and not isinstance(refusal, list):
        return (
            ("logprobs", "refusal"),
            f"refusal must be a list of token logprobs or null, got {_json_kind(refusal)}",
            "invalid_logprobs",
        )
    for key, entries in (("content", content), ("refusal", refusal or [])):
        for i, entry in enumerate(entries):
            problem = _token_logprob_problem(entry, nested=True)
            if problem is not None:
                loc, msg = problem
                return ("logprobs", key, i, *loc), msg, "invalid_logprobs"
    return None


def _token_logprob_problem(entry: Any, *, nested: bool) -> tuple[Loc, str] | None:
    if not isinstance(entry, dict):
        return (), f"a token logprob must be an object, got {_json_kind(entry)}"
    if not isinstance(entry.get("token"), str):
        return ("token",), "token must be a string"
    logprob = entry.get("logprob")
    if isinstance(logprob, bool) or not isinstance(logprob, int | float) or not _finite(logprob):
        return ("logprob",), f"logprob must be a finite number, got {logprob!r}"
    if logprob > 0:
        return ("logprob",), f"logprob must be at most 0 (a log probability), got {logprob!r}"
    raw = entry.get("bytes")
    if raw is not None and not (isinstance(raw, list) and all(type(b) is int for b in raw)):
        return ("bytes",), "bytes must be a list of integers or null"
    top = entry.get("top_logprobs") if nested else None
    if top is not None:
        if not isinstance(top, list):
            return ("top_logprobs",), "top_logprobs must be a list or null"
        for j, alternative in enumerate(top):
            problem = _token_logprob_problem(alternative, nested=False)
            if problem is not None:
                return ("top_logprobs", j, *problem[0]), problem[1]
    return None


def _within(document: Any, loc: Loc) -> Loc:
    """`loc` as a path in the submitted `document`: without the parts pydantic adds that are
    not in it (the union member it tried, e.g. `ChatCompletionMessageFunctionToolCall`; the
    OpenAI shape a LangChain tool call was rewritten to). A last part that names a missing
    key of an object stays."""
    kept: list[str | int] = []
    node = document
    for i, part in enumerate(loc):
        present = (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        )
        if present:
            node = node[part]
        elif i < len(loc) - 1 or not isinstance(node, dict):
            continue
        kept.append(part)
    return tuple(kept)


def _finite(number: float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an integer too large for a float
        return False


def _first_error(exc: ValidationError) -> tuple[Loc, str]:
    error = exc.errors(include_url=False)[0]
    return tuple(error["loc"]), error["msg"]


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object" if value else "an empty object"
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    return type(value).__name__


def _is_choice(item: Any) -> bool:
    """ART's own test for a Choice serialised as a dict."""
    return isinstance(item, dict) and "finish_reason" in item and "message" in item


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


def collection_to_groups(collection: TrajectoryCollection) -> list[dict[str, Any]]:
    """Convert a checked NAT collection into ART-style groups (the JSON `groups` of a
    training job, what a training spec stores), one per NAT group.

    Episode items map as follows:

    - system and user: `{"role", "content"}` messages.
    - assistant with logprobs: a `Choice` (index 0) whose `finish_reason` is
      `metadata.finish_reason`, else `"tool_calls"` when it made tool calls, else `"stop"`.
      `metadata.tool_calls` become the message's `tool_calls`; LangChain-style calls
      (`{"name", "args", "id"}`, what NAT's LangChain parser records) are rewritten in
      OpenAI form with JSON-encoded arguments.
    - assistant without logprobs (only when the job trains without them): an assistant
      message keeping its `tool_calls`.
    - tool: a tool message with `tool_call_id = str(metadata.tool_call_id)`; the id is left
      out when NAT did not record one (its LlamaIndex parser drops it). NAT's own ART adapter
      relabels tool results as assistant text; we keep them tool messages.
    - function: `{"role": "function", "name": metadata.name or "", "content"}`.
    - environment and other: user messages (chat templates know no such roles).

    Rewards pass through unchanged; `shaped_rewards` are ignored (GRPO uses one reward per
    trajectory). Trajectory metadata is kept, with non-scalar values encoded as JSON text,
    because ART 0.5.18 accepts scalars only.
    """
    return [nat_group_to_art(group) for group in collection.trajectories]


def nat_group_to_art(group: Sequence[NatTrajectory]) -> dict[str, Any]:
    """One checked NAT group as an ART-style group (see `collection_to_groups`)."""
    return {
        "trajectories": [
            {
                "messages_and_choices": [_nat_item_to_art(i) for i in trajectory.episode],
                "reward": trajectory.reward,
                "metadata": _scalar_metadata(trajectory.metadata or {}),
            }
            for trajectory in group
        ]
    }


def collection_to_art(collection: TrajectoryCollection) -> list[art.TrajectoryGroup]:
    """A checked NAT collection as `art.TrajectoryGroup`s (see `collection_to_groups`)."""
    return groups_to_art(collection_to_groups(collection))


def groups_to_art(
    groups: Sequence[ArtTrajectoryGroup | Mapping[str, Any]],
) -> list[art.TrajectoryGroup]:
    """Convert checked ART-style groups (wire models, or their JSON) into
    `art.TrajectoryGroup`s.

    Items that look like a Choice (a dict with `finish_reason` and `message`) are revived as
    `Choice` objects, keeping their logprob tokens and any extra fields (`token_ids`, ...);
    other items stay message dicts.
    """
    import art

    documents = [g.model_dump(mode="json") if isinstance(g, BaseModel) else g for g in groups]
    return [
        art.TrajectoryGroup(
            [
                art.Trajectory(
                    messages_and_choices=[
                        _art_item(item) for item in trajectory["messages_and_choices"]
                    ],
                    tools=trajectory.get("tools"),
                    reward=trajectory["reward"],
                    metrics=dict(trajectory.get("metrics", {})),
                    metadata=dict(trajectory.get("metadata", {})),
                    logs=list(trajectory.get("logs", [])),
                )
                for trajectory in group["trajectories"]
            ],
            metadata=dict(group.get("metadata", {})),
            metrics=dict(group.get("metrics", {})),
            logs=list(group.get("logs", [])),
        )
        for group in documents
    ]


def groups_to_collection(groups: Sequence[ArtTrajectoryGroup], run_id: str) -> TrajectoryCollection:
    """ART-style groups as NeMo Agent Toolkit's `TrajectoryCollection`: each `Choice` an
    assistant turn with its logprobs (its finish reason and tool calls in the metadata,
    where NAT keeps them); other messages keep their text, and content that is not plain
    text (OpenAI content parts) stays whole in the item's metadata."""
    return TrajectoryCollection.model_validate(
        {
            "trajectories": [
                [
                    {
                        "episode": [_art_item_to_nat(item) for item in t.messages_and_choices],
                        "reward": t.reward,
                        "shaped_rewards": None,
                        "metadata": dict(t.metadata),
                    }
                    for t in group.trajectories
                ]
                for group in groups
            ],
            "run_id": run_id,
        }
    )


def _art_item_to_nat(item: dict[str, Any]) -> dict[str, Any]:
    if _is_choice(item):
        message = item["message"]
        metadata = {"finish_reason": item["finish_reason"]}
        if message.get("tool_calls"):
            metadata["tool_calls"] = message["tool_calls"]
        return {
            "role": "assistant",
            "content": _text(message.get("content")),
            "logprobs": item.get("logprobs"),
            "metadata": metadata,
        }
    extra = {
        k: v
        for k, v in item.items()
        if k != "role" and (k != "content" or not isinstance(v, str | None))
    }
    return {
        "role": {"developer": "system"}.get(item["role"], item["role"]),
        "content": _text(item.get("content")),
        "logprobs": None,
        "metadata": extra or None,
    }


def _text(content: Any) -> str:
    """An OpenAI message's content as NAT's text: a string as it is; of a list of content
    parts, the text parts, one per line; anything else as JSON."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return json.dumps(content)


def _nat_item_to_art(item: EpisodeItem) -> dict[str, Any]:
    meta = item.metadata or {}
    role = item.role
    if role is EpisodeItemRole.ASSISTANT:
        if item.logprobs is not None:
            return _nat_choice_dict(item, logprobs=item.logprobs)
        message: dict[str, Any] = {"role": "assistant", "content": item.content}
        tool_calls = _openai_tool_calls(meta.get("tool_calls"))
        if tool_calls:
            message["tool_calls"] = tool_calls
        return message
    if role is EpisodeItemRole.TOOL:
        message = {"role": "tool", "content": item.content}
        if meta.get("tool_call_id") is not None:
            message["tool_call_id"] = str(meta["tool_call_id"])
        return message
    if role is EpisodeItemRole.FUNCTION:
        return {"role": "function", "name": str(meta.get("name") or ""), "content": item.content}
    if role in (EpisodeItemRole.SYSTEM, EpisodeItemRole.USER):
        return {"role": role.value, "content": item.content}
    return {"role": "user", "content": item.content}


def _nat_choice_dict(item: EpisodeItem, *, logprobs: Any) -> dict[str, Any]:
    meta = item.metadata or {}
    message: dict[str, Any] = {"role": "assistant", "content": item.content}
    tool_calls = _openai_tool_calls(meta.get("tool_calls"))
    if tool_calls:
        message["tool_calls"] = tool_calls
    finish_reason = meta.get("finish_reason") or ("tool_calls" if tool_calls else "stop")
    return {"finish_reason": finish_reason, "index": 0, "message": message, "logprobs": logprobs}


def _openai_tool_calls(tool_calls: Any) -> Any:
    """OpenAI-shaped tool calls; LangChain `{"name", "args", "id"}` calls are rewritten."""
    if not isinstance(tool_calls, list):
        return tool_calls
    return [_openai_tool_call(call) for call in tool_calls]


def _openai_tool_call(call: Any) -> Any:
    if not isinstance(call, dict) or "function" in call or "name" not in call:
        return call
    args = call.get("args", {})
    return {
        "id": str(call.get("id") or ""),
        "type": "function",
        "function": {
            "name": call["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args),
        },
    }


def _art_item(item: dict[str, Any]) -> dict[str, Any] | Choice:
    if not _is_choice(item):
        return dict(item)
    logprobs = item.get("logprobs")
    if logprobs is not None:
        item = {**item, "logprobs": _complete_logprobs(logprobs)}
    return _choice().model_validate(item)


def _complete_logprobs(logprobs: Any) -> Any:
    """Fill `top_logprobs: []` where it is missing: OpenAI's type requires the field."""
    if not isinstance(logprobs, dict):
        return logprobs
    completed = dict(logprobs)
    for key in ("content", "refusal"):
        entries = logprobs.get(key)
        if isinstance(entries, list):
            completed[key] = [_with_top_logprobs(entry) for entry in entries]
    return completed


def _with_top_logprobs(entry: Any) -> Any:
    if isinstance(entry, dict) and entry.get("top_logprobs") is None:
        return {**entry, "top_logprobs": []}
    return entry


def _scalar_metadata(metadata: dict[str, Any]) -> dict[str, float | int | str | bool | None]:
    return {
        key: value
        if value is None or isinstance(value, bool | int | float | str)
        else json.dumps(value, ensure_ascii=False)
        for key, value in metadata.items()
    }


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------


def summarize_collection(collection: TrajectoryCollection) -> TrajectorySummary:
    """Group counts of a NAT collection, and the groups GRPO cannot learn from."""
    return summarize_rewards([[t.reward for t in group] for group in collection.trajectories])


def summarize_groups(groups: Sequence[ArtTrajectoryGroup]) -> TrajectorySummary:
    """Group counts of ART-style groups, and the groups GRPO cannot learn from."""
    return summarize_rewards([[t.reward for t in group.trajectories] for group in groups])


def summarize_rewards(rewards: Iterable[list[float]]) -> TrajectorySummary:
    """Group counts of groups given as their trajectories' rewards, and the groups GRPO
    cannot learn from."""
    rewards = list(rewards)
    untrainable = [g for g, group in enumerate(rewards) if len(set(group)) < 2]
    return TrajectorySummary(
        num_groups=len(rewards),
        num_trajectories=sum(len(group) for group in rewards),
        num_trainable_groups=len(rewards) - len(untrainable),
        untrainable_groups=untrainable,
    )
