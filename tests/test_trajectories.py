"""Trajectory wire models, semantic checks and conversion to real ART objects.

Payloads are plain JSON built with NAT's exact field names (nulls included) and validated the
way the API validates a request body: `model_validate_json`.
"""

from __future__ import annotations

import json
from typing import Any

import art
import pytest
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from pydantic import BaseModel, ValidationError

from app.schemas.trajectories import (
    DPO_NOT_SUPPORTED,
    ArtTrajectory,
    ArtTrajectoryGroup,
    EpisodeItem,
    EpisodeItemRole,
    NatTrajectory,
    TrajectoryCollection,
    TrajectorySummary,
)
from app.trajectories import (
    MAX_ISSUES,
    TrajectoryIssue,
    check_collection,
    check_groups,
    collection_to_art,
    groups_to_art,
    summarize_collection,
    summarize_groups,
)

# ---------------------------------------------------------------------------------------------
# Payload builders (NAT wire format, as `TrajectoryCollection.model_dump_json()` emits it)
# ---------------------------------------------------------------------------------------------


def logprobs(*tokens: tuple[int, float]) -> dict[str, Any]:
    """OpenAI ChoiceLogprobs as ART's vLLM returns them (`return_tokens_as_token_ids`)."""
    return {
        "content": [
            {
                "token": f"token_id:{token_id}",
                "bytes": [65 + i],
                "logprob": logprob,
                "top_logprobs": [
                    {"token": f"token_id:{token_id}", "bytes": [65 + i], "logprob": logprob}
                ],
            }
            for i, (token_id, logprob) in enumerate(tokens)
        ],
        "refusal": None,
    }


def item(
    role: str, content: str = "", *, logprobs: Any = None, metadata: Any = None
) -> dict[str, Any]:
    return {"role": role, "content": content, "logprobs": logprobs, "metadata": metadata}


def system(content: str = "You are a calculator.") -> dict[str, Any]:
    return item("system", content)


def user(content: str = "What is 2+2?") -> dict[str, Any]:
    return item("user", content)


def assistant(content: str = "4", *, lp: Any = "default", metadata: Any = None) -> dict[str, Any]:
    return item(
        "assistant",
        content,
        logprobs=logprobs((19, -0.25)) if lp == "default" else lp,
        metadata=metadata,
    )


LANGCHAIN_TOOL_CALL = {"name": "add", "args": {"a": 2, "b": 2}, "id": "call_1", "type": "tool_call"}
OPENAI_TOOL_CALL = {
    "id": "call_2",
    "type": "function",
    "function": {"name": "mul", "arguments": '{"a": 2, "b": 3}'},
}


def tool_episode() -> list[dict[str, Any]]:
    """system, user, assistant calling a tool, the tool result, final assistant answer."""
    return [
        system(),
        user(),
        assistant(
            "",
            lp=logprobs((151657, -0.01), (42, -0.5)),
            metadata={"tool_calls": [LANGCHAIN_TOOL_CALL]},
        ),
        item("tool", "4", metadata={"tool_call_id": "call_1"}),
        assistant("2+2 is 4.", lp=logprobs((17, -0.125), (18, -0.0625), (151645, -0.001))),
    ]


def trajectory(
    episode: list[dict[str, Any]], reward: float = 1.0, metadata: Any = None
) -> dict[str, Any]:
    return {"episode": episode, "reward": reward, "shaped_rewards": None, "metadata": metadata}


def collection(*groups: list[dict[str, Any]], run_id: str = "art_run_1a2b3c4d") -> dict[str, Any]:
    return {"trajectories": list(groups), "run_id": run_id}


def parse(payload: dict[str, Any]) -> TrajectoryCollection:
    return TrajectoryCollection.model_validate_json(json.dumps(payload))


def one(episode: list[dict[str, Any]], reward: float = 1.0) -> TrajectoryCollection:
    """A collection with a single group holding a single trajectory."""
    return parse(collection([trajectory(episode, reward)]))


P = ("trajectories", 0, 0)  # location prefix of `one(...)`'s trajectory


def issues_of(payload: TrajectoryCollection, **kwargs: Any) -> list[tuple[Any, str]]:
    return [(issue.loc, issue.type) for issue in check_collection(payload, **kwargs)]


# ---------------------------------------------------------------------------------------------
# NAT wire models
# ---------------------------------------------------------------------------------------------


def test_nat_example_with_nulls_and_unknown_keys_validates() -> None:
    payload = collection(
        [
            trajectory(
                [{**user(), "extra": 1}, assistant()],
                0.73,
                {"id": 1, "reasoning": "...", "run_id": "art_run_1a2b3c4d", "generation": 0},
            )
            | {"unknown": True}
        ]
    )
    parsed = parse(payload)
    episode = parsed.trajectories[0][0].episode
    assert [i.role for i in episode] == [EpisodeItemRole.USER, EpisodeItemRole.ASSISTANT]
    assert episode[0].logprobs is None and episode[0].metadata is None
    assert episode[1].logprobs == logprobs((19, -0.25))
    assert parsed.trajectories[0][0].shaped_rewards is None
    assert parsed.run_id == "art_run_1a2b3c4d"


def test_model_does_not_require_assistant_logprobs() -> None:
    # That rule depends on the job's opt-in, so it lives in check_collection.
    parsed = one([user(), assistant(lp=None)])
    assert parsed.trajectories[0][0].episode[1].logprobs is None


@pytest.mark.parametrize("bad_role", ["human", "ai", "", None])
def test_unknown_episode_role_rejected(bad_role: Any) -> None:
    with pytest.raises(ValidationError) as exc:
        one([user(), item(bad_role, "x")])
    assert exc.value.errors()[0]["loc"] == ("trajectories", 0, 0, "episode", 1, "role")


def test_content_must_be_a_string() -> None:
    with pytest.raises(ValidationError) as exc:
        one([{**user(), "content": [{"type": "text", "text": "hi"}]}, assistant()])
    assert exc.value.errors()[0]["loc"] == ("trajectories", 0, 0, "episode", 0, "content")


@pytest.mark.parametrize("position", [0, 1])
def test_dpo_item_rejected_with_its_location(position: int) -> None:
    dpo = {
        "prompt": [{"role": "user", "content": "Board..."}],
        "chosen_response": "a",
        "rejected_response": "b",
    }
    episode = [dpo, assistant()] if position == 0 else [user(), dpo]
    payload = collection([trajectory([user(), assistant()])], [trajectory(episode)])
    with pytest.raises(ValidationError) as exc:
        parse(payload)
    errors = exc.value.errors()
    assert len(errors) == 1
    assert errors[0]["loc"] == ("trajectories", 1, 0, "episode", position)
    assert errors[0]["type"] == "dpo_not_supported"
    assert errors[0]["msg"] == DPO_NOT_SUPPORTED
    assert '"method": "dpo"' in errors[0]["msg"]  # where DPO items are trained


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_reward_rejected(reward: float) -> None:
    text = json.dumps(collection([trajectory([user(), assistant()], reward)]))
    assert "NaN" in text or "Infinity" in text  # what Python's json writes
    with pytest.raises(ValidationError) as exc:
        TrajectoryCollection.model_validate_json(text)
    assert exc.value.errors()[0]["loc"] == ("trajectories", 0, 0, "reward")
    assert exc.value.errors()[0]["type"] == "finite_number"


def test_run_id_required() -> None:
    with pytest.raises(ValidationError) as exc:
        TrajectoryCollection.model_validate_json('{"trajectories": []}')
    assert exc.value.errors()[0]["loc"] == ("run_id",)


def test_every_model_and_field_is_described() -> None:
    models: list[type[BaseModel]] = [
        EpisodeItem,
        NatTrajectory,
        TrajectoryCollection,
        ArtTrajectory,
        ArtTrajectoryGroup,
        TrajectorySummary,
    ]
    for model in models:
        assert model.__doc__, model
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}"


def test_schema_examples_are_valid_and_trainable() -> None:
    [nat_example] = TrajectoryCollection.model_json_schema()["examples"]
    assert check_collection(TrajectoryCollection.model_validate(nat_example)) == []
    [art_example] = ArtTrajectoryGroup.model_json_schema()["examples"]
    assert check_groups([ArtTrajectoryGroup.model_validate(art_example)]) == []


# ---------------------------------------------------------------------------------------------
# NAT checks
# ---------------------------------------------------------------------------------------------


def test_valid_tool_calling_collection_has_no_issues() -> None:
    payload = parse(
        collection(
            [trajectory(tool_episode(), 1.0), trajectory([user(), assistant("5")], 0.0)],
            [trajectory([system(), system("Be brief."), user(), assistant()], 0.5)],
        )
    )
    assert check_collection(payload) == []


def test_empty_collection_is_nothing_to_train() -> None:
    assert check_collection(parse(collection())) == [
        TrajectoryIssue(("trajectories",), "nothing to train: no groups", "nothing_to_train")
    ]


def test_empty_group_reported_at_its_index() -> None:
    payload = parse(collection([trajectory([user(), assistant()])], []))
    assert issues_of(payload) == [(("trajectories", 1), "empty_group")]


def test_empty_episode() -> None:
    assert issues_of(one([])) == [((*P, "episode"), "empty_episode")]


@pytest.mark.parametrize("first", ["assistant", "tool", "environment"])
def test_first_role_must_be_system_or_user(first: str) -> None:
    first_item = assistant() if first == "assistant" else item(first, "x")
    found = issues_of(one([first_item, user(), assistant()]))
    assert found[0] == ((*P, "episode", 0, "role"), "invalid_first_role")


def test_system_only_at_the_start() -> None:
    found = issues_of(one([system(), user(), assistant(), system("late"), user(), assistant()]))
    assert found == [((*P, "episode", 3, "role"), "misplaced_system")]


def test_consecutive_assistant_turns() -> None:
    found = issues_of(one([user(), assistant(), assistant("again")]))
    assert found == [((*P, "episode", 2, "role"), "consecutive_assistant")]


def test_assistant_after_tool_is_not_consecutive() -> None:
    assert issues_of(one(tool_episode())) == []


def test_every_trajectory_needs_an_assistant_turn() -> None:
    found = issues_of(one([system(), user()]))
    assert found == [((*P, "episode"), "no_assistant_turn")]


def test_missing_logprobs_when_required() -> None:
    payload = one([user(), assistant(lp=None)])
    [issue] = check_collection(payload)
    assert issue.loc == (*P, "episode", 1, "logprobs")
    assert issue.type == "missing_logprobs"
    assert check_collection(payload, require_logprobs=False) == []


@pytest.mark.parametrize(
    ("bad", "loc"),
    [
        ({}, ("logprobs", "content")),
        ({"tokens": ["a"], "token_logprobs": [-0.1]}, ("logprobs", "content")),  # ADK style
        ({"content": [], "refusal": None}, ("logprobs", "content")),
        ({"content": None, "refusal": None}, ("logprobs", "content")),
        ([{"token": "token_id:1", "logprob": -0.1}], ("logprobs",)),
        ("-0.1", ("logprobs",)),
        ({"content": [{"token": "token_id:1", "logprob": -0.1}, "x"]}, ("logprobs", "content", 1)),
        ({"content": [{"logprob": -0.1}]}, ("logprobs", "content", 0, "token")),
        ({"content": [{"token": 7, "logprob": -0.1}]}, ("logprobs", "content", 0, "token")),
        ({"content": [{"token": "token_id:1"}]}, ("logprobs", "content", 0, "logprob")),
        ({"content": [{"token": "t", "logprob": "-0.1"}]}, ("logprobs", "content", 0, "logprob")),
        ({"content": [{"token": "t", "logprob": True}]}, ("logprobs", "content", 0, "logprob")),
        (
            {"content": [{"token": "t", "logprob": -0.1, "bytes": "ab"}]},
            ("logprobs", "content", 0, "bytes"),
        ),
        (
            {"content": [{"token": "t", "logprob": -0.1, "top_logprobs": [{"token": "t"}]}]},
            ("logprobs", "content", 0, "top_logprobs", 0, "logprob"),
        ),
    ],
)
def test_logprobs_must_have_choice_logprobs_shape(bad: Any, loc: tuple[Any, ...]) -> None:
    payload = one([user(), assistant(lp=bad)])
    for require in (True, False):  # present logprobs are checked even when not required
        [issue] = check_collection(payload, require_logprobs=require)
        assert issue.loc == (*P, "episode", 1, *loc)
        assert issue.type == "invalid_logprobs"


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_token_logprob_is_reported(value: float) -> None:
    good = logprobs((1, -0.1), (2, -0.2), (3, -0.3))
    good["content"][2]["logprob"] = value
    [issue] = check_collection(one([user(), assistant(lp=good)]))
    assert issue.loc == (*P, "episode", 1, "logprobs", "content", 2, "logprob")


def test_at_most_one_logprobs_issue_per_item() -> None:
    bad = {"content": [{"token": 1, "logprob": "x"}, {"token": 2}, "nope"]}
    [issue] = check_collection(one([user(), assistant(lp=bad)]))
    assert issue.loc == (*P, "episode", 1, "logprobs", "content", 0, "token")


def test_top_logprobs_may_be_missing() -> None:
    lp = {"content": [{"token": "token_id:5", "logprob": -1.0}]}
    assert check_collection(one([user(), assistant(lp=lp)])) == []


def test_bad_finish_reason_points_at_metadata() -> None:
    payload = one([user(), assistant(metadata={"finish_reason": "eos"})])
    [issue] = check_collection(payload)
    assert issue.loc == (*P, "episode", 1, "metadata", "finish_reason")
    assert issue.type == "invalid_choice"


def test_malformed_tool_calls_point_at_metadata() -> None:
    bad_call = {"id": "c", "type": "function", "function": {"name": "f"}}  # no arguments
    payload = one([user(), assistant(metadata={"tool_calls": [bad_call]})])
    [issue] = check_collection(payload)
    assert issue.loc[: len(P) + 5] == (*P, "episode", 1, "metadata", "tool_calls", 0)
    assert issue.type == "invalid_choice"


def test_tool_calls_without_logprobs_cannot_train_even_when_opted_out() -> None:
    payload = one([user(), assistant(lp=None, metadata={"tool_calls": [LANGCHAIN_TOOL_CALL]})])
    [issue] = check_collection(payload, require_logprobs=False)
    assert issue.loc == (*P, "episode", 1, "logprobs")
    assert issue.type == "tool_calls_need_logprobs"


def test_all_issues_are_reported_across_groups() -> None:
    payload = parse(
        collection(
            [trajectory([user(), assistant(lp=None)]), trajectory([assistant()])],
            [trajectory([user(), assistant(), assistant(lp={})])],
        )
    )
    assert issues_of(payload) == [
        (("trajectories", 0, 0, "episode", 1, "logprobs"), "missing_logprobs"),
        (("trajectories", 0, 1, "episode", 0, "role"), "invalid_first_role"),
        (("trajectories", 1, 0, "episode", 2, "role"), "consecutive_assistant"),
        (("trajectories", 1, 0, "episode", 2, "logprobs", "content"), "invalid_logprobs"),
    ]


def test_issues_are_capped() -> None:
    group = [trajectory([user(), assistant(lp=None)]) for _ in range(MAX_ISSUES + 50)]
    found = check_collection(parse(collection(group)))
    assert len(found) == MAX_ISSUES == 100
    assert found[-1].loc == ("trajectories", 0, MAX_ISSUES - 1, "episode", 1, "logprobs")


# ---------------------------------------------------------------------------------------------
# NAT -> ART conversion
# ---------------------------------------------------------------------------------------------


def test_collection_converts_to_real_art_groups() -> None:
    payload = parse(
        collection(
            [
                trajectory(tool_episode(), 1.0, {"id": 7, "generation": 0}),
                trajectory([user(), assistant("5", lp=logprobs((20, -2.5)))], 0.0),
            ],
            [trajectory([user("3+3?"), assistant("6")], 0.5)],
        )
    )
    groups = collection_to_art(payload)

    assert [type(g) for g in groups] == [art.TrajectoryGroup, art.TrajectoryGroup]
    assert [len(g.trajectories) for g in groups] == [2, 1]
    assert all(isinstance(t, art.Trajectory) for g in groups for t in g.trajectories)
    assert [t.reward for g in groups for t in g.trajectories] == [1.0, 0.0, 0.5]

    first = groups[0].trajectories[0]
    items = first.messages_and_choices
    assert items[0] == {"role": "system", "content": "You are a calculator."}
    assert items[1] == {"role": "user", "content": "What is 2+2?"}

    call = items[2]
    assert isinstance(call, Choice)
    assert isinstance(call.logprobs, ChoiceLogprobs)
    assert [(t.token, t.logprob) for t in call.logprobs.content or []] == [
        ("token_id:151657", -0.01),
        ("token_id:42", -0.5),
    ]
    assert call.finish_reason == "tool_calls"
    [tool_call] = call.message.tool_calls or []
    assert tool_call.id == "call_1"
    assert tool_call.function.name == "add"  # type: ignore[union-attr]
    assert json.loads(tool_call.function.arguments) == {"a": 2, "b": 2}  # type: ignore[union-attr]

    assert items[3] == {"role": "tool", "content": "4", "tool_call_id": "call_1"}

    answer = items[4]
    assert isinstance(answer, Choice)
    assert answer.finish_reason == "stop"
    assert answer.message.content == "2+2 is 4."
    assert [t.token for t in answer.logprobs.content or []] == [  # type: ignore[union-attr]
        "token_id:17",
        "token_id:18",
        "token_id:151645",
    ]
    assert first.metadata == {"id": 7, "generation": 0}


def test_art_reads_converted_turns_as_openai_messages() -> None:
    [group] = collection_to_art(one(tool_episode()))
    messages = group.trajectories[0].messages()  # ART's own Choice -> message conversion
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"] == [  # type: ignore[typeddict-item]
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'},
        }
    ]


def test_openai_style_tool_calls_and_finish_reason_survive() -> None:
    episode = [
        user(),
        assistant("", metadata={"tool_calls": [OPENAI_TOOL_CALL], "finish_reason": "length"}),
    ]
    [group] = collection_to_art(one(episode))
    choice = group.trajectories[0].messages_and_choices[1]
    assert isinstance(choice, Choice)
    assert choice.finish_reason == "length"
    assert [c.model_dump() for c in choice.message.tool_calls or []] == [OPENAI_TOOL_CALL]


def test_other_roles_map_to_chat_messages() -> None:
    episode = [
        user(),
        assistant(),
        item("tool", "r0", metadata={"tool_call_id": 0}),  # NAT's LangChain fallback id
        item("tool", "r1"),
        item("function", "f", metadata={"name": "lookup"}),
        item("environment", "env says"),
        item("other", "misc"),
        assistant("ok"),
    ]
    [group] = collection_to_art(one(episode))
    assert group.trajectories[0].messages_and_choices[2:7] == [
        {"role": "tool", "content": "r0", "tool_call_id": "0"},
        {"role": "tool", "content": "r1"},
        {"role": "function", "name": "lookup", "content": "f"},
        {"role": "user", "content": "env says"},
        {"role": "user", "content": "misc"},
    ]


def test_assistant_without_logprobs_becomes_a_message_when_opted_out() -> None:
    payload = one([user(), assistant("4", lp=None)])
    assert check_collection(payload, require_logprobs=False) == []
    [group] = collection_to_art(payload)
    assert group.trajectories[0].messages_and_choices[1] == {"role": "assistant", "content": "4"}


def test_missing_top_logprobs_are_filled_in() -> None:
    lp = {"content": [{"token": "token_id:5", "logprob": -1.0, "bytes": None}], "refusal": None}
    [group] = collection_to_art(one([user(), assistant(lp=lp)]))
    choice = group.trajectories[0].messages_and_choices[1]
    assert isinstance(choice, Choice) and choice.logprobs and choice.logprobs.content
    token = choice.logprobs.content[0]
    assert (token.token, token.logprob, token.top_logprobs) == ("token_id:5", -1.0, [])


def test_trajectory_metadata_keeps_scalars_and_encodes_the_rest() -> None:
    metadata = {"id": "q1", "n": 2, "x": 0.5, "ok": True, "none": None, "r": {"a": [1, "é"]}}
    payload = parse(collection([trajectory([user(), assistant()], 1.0, metadata)]))
    [group] = collection_to_art(payload)
    assert group.trajectories[0].metadata == {
        "id": "q1",
        "n": 2,
        "x": 0.5,
        "ok": True,
        "none": None,
        "r": '{"a": [1, "é"]}',
    }


def test_shaped_rewards_are_ignored() -> None:
    raw = trajectory([user(), assistant()], 0.25) | {"shaped_rewards": [1.0, 2.0]}
    [group] = collection_to_art(parse(collection([raw])))
    assert group.trajectories[0].reward == 0.25


# ---------------------------------------------------------------------------------------------
# ART-style groups
# ---------------------------------------------------------------------------------------------


def choice(
    content: str = "4", *, lp: Any = "default", role: str = "assistant", **extra: Any
) -> dict[str, Any]:
    """An OpenAI Choice as `completion.choices[0].model_dump()` gives it."""
    return {
        "finish_reason": "stop",
        "index": 0,
        "message": {"role": role, "content": content},
        "logprobs": logprobs((19, -0.25)) if lp == "default" else lp,
        **extra,
    }


TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
    }
]


def art_trajectory(messages: list[dict[str, Any]], reward: float = 1.0, **extra: Any) -> dict:
    return {"messages_and_choices": messages, "reward": reward, **extra}


def art_groups(*groups: list[dict[str, Any]]) -> list[ArtTrajectoryGroup]:
    payload = json.dumps([{"trajectories": group} for group in groups])
    return [ArtTrajectoryGroup.model_validate(g) for g in json.loads(payload)]


def art_issues(groups: list[ArtTrajectoryGroup], **kwargs: Any) -> list[tuple[Any, str]]:
    return [(issue.loc, issue.type) for issue in check_groups(groups, **kwargs)]


A = (0, "trajectories", 0, "messages_and_choices")  # location prefix of the first trajectory
USER = {"role": "user", "content": "hi"}


def tool_calling_art_trajectory(reward: float = 1.0) -> dict[str, Any]:
    call = choice("", token_ids=[151657, 42]) | {"finish_reason": "tool_calls"}
    call["message"]["tool_calls"] = [OPENAI_TOOL_CALL]
    return art_trajectory(
        [
            {"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": "2*3?"},
            call,
            {"role": "tool", "content": "6", "tool_call_id": "call_2"},
            choice("6"),
        ],
        reward,
        tools=TOOLS,
        metrics={"turns": 2},
        metadata={"example": "e1"},
        logs=["called mul"],
    )


def test_valid_art_groups_have_no_issues() -> None:
    groups = art_groups(
        [tool_calling_art_trajectory(1.0), tool_calling_art_trajectory(0.0)],
        [art_trajectory([USER, {"role": "developer", "content": "Be brief."}, choice()])],
    )
    assert check_groups(groups) == []


def test_art_groups_convert_to_real_art_objects() -> None:
    raw = tool_calling_art_trajectory(1.0)
    raw["messages_and_choices"][2]["logprobs"]["content"][0]["extra_logprobs"] = {"ref": -0.5}
    [group_in] = art_groups([raw, tool_calling_art_trajectory(0.0)])
    group_in.metadata = {"example_id": 3}
    group_in.metrics = {"accuracy": 0.5}
    group_in.logs = ["group log"]

    [group] = groups_to_art([group_in])
    assert type(group) is art.TrajectoryGroup
    assert len(group.trajectories) == 2
    assert (group.metadata, group.metrics, group.logs) == (
        {"example_id": 3},
        {"accuracy": 0.5},
        ["group log"],
    )
    first = group.trajectories[0]
    assert isinstance(first, art.Trajectory)
    assert (first.reward, first.metrics, first.metadata, first.logs) == (
        1.0,
        {"turns": 2},
        {"example": "e1"},
        ["called mul"],
    )
    assert first.tools == TOOLS

    items = first.messages_and_choices
    assert items[:2] == raw["messages_and_choices"][:2]
    call = items[2]
    assert isinstance(call, Choice) and isinstance(call.logprobs, ChoiceLogprobs)
    assert [(t.token, t.logprob) for t in call.logprobs.content or []] == [("token_id:19", -0.25)]
    assert call.model_extra == {"token_ids": [151657, 42]}  # vLLM extras survive
    assert (call.logprobs.content or [])[0].model_extra == {"extra_logprobs": {"ref": -0.5}}
    assert [c.model_dump() for c in call.message.tool_calls or []] == [OPENAI_TOOL_CALL]
    assert items[3] == {"role": "tool", "content": "6", "tool_call_id": "call_2"}
    assert isinstance(items[4], Choice)


def test_art_check_empty_inputs() -> None:
    assert art_issues([]) == [((), "nothing_to_train")]
    assert art_issues(art_groups([])) == [((0, "trajectories"), "empty_group")]
    assert art_issues(art_groups([art_trajectory([])])) == [(A, "empty_episode")]


@pytest.mark.parametrize(
    "first",
    [choice(), {"role": "assistant", "content": "hi"}, {"role": "tool", "content": "x"}],
)
def test_art_first_item_must_be_system_or_user_message(first: dict[str, Any]) -> None:
    found = art_issues(art_groups([art_trajectory([first, choice()])]))
    assert found[0] == ((*A, 0), "invalid_first_role")


@pytest.mark.parametrize("role", ["human", None, "environment"])
def test_art_message_needs_a_valid_role(role: Any) -> None:
    message = {"content": "x"} if role is None else {"role": role, "content": "x"}
    found = art_issues(art_groups([art_trajectory([USER, message, choice()])]))
    assert found == [((*A, 1, "role"), "invalid_role")]


def test_art_tool_message_needs_tool_call_id() -> None:
    tool = {"role": "tool", "content": "6"}
    found = art_issues(art_groups([art_trajectory([USER, choice(), tool, choice()])]))
    assert found == [((*A, 2, "tool_call_id"), "missing_tool_call_id")]


def test_art_choice_message_must_be_assistant() -> None:
    groups = art_groups([art_trajectory([USER, choice(role="user")])])
    assert art_issues(groups) == [((*A, 1, "message", "role"), "invalid_role")]


def test_art_choice_needs_logprobs_when_required() -> None:
    groups = art_groups([art_trajectory([USER, choice(lp=None)])])
    assert art_issues(groups) == [((*A, 1, "logprobs"), "missing_logprobs")]
    assert art_issues(groups, require_logprobs=False) == []


def test_art_choice_logprobs_shape() -> None:
    bad = {"content": [{"token": "token_id:1", "logprob": -0.1}, {"token": "token_id:2"}]}
    groups = art_groups([art_trajectory([USER, choice(lp=bad)])])
    assert art_issues(groups) == [
        ((*A, 1, "logprobs", "content", 1, "logprob"), "invalid_logprobs")
    ]


def test_art_choice_must_validate_as_openai_choice() -> None:
    bad = choice() | {"finish_reason": "eos"}
    [issue] = check_groups(art_groups([art_trajectory([USER, bad])]))
    assert issue.loc == (*A, 1, "finish_reason")
    assert issue.type == "invalid_choice"
    assert "stop" in issue.msg  # pydantic's message lists the allowed values


def test_art_needs_a_trainable_turn() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}]
    groups = art_groups([art_trajectory(messages)])
    assert art_issues(groups) == [(A, "no_trainable_turn")]
    assert art_issues(groups, require_logprobs=False) == []


def test_art_assistant_message_with_tool_calls_needs_logprobs_when_opted_out() -> None:
    call = {"role": "assistant", "content": "", "tool_calls": [OPENAI_TOOL_CALL]}
    groups = art_groups([art_trajectory([USER, call, choice()])])
    assert art_issues(groups) == []  # context only when logprobs are required
    assert art_issues(groups, require_logprobs=False) == [
        ((*A, 1, "tool_calls"), "tool_calls_need_logprobs")
    ]


def test_art_tools_must_be_openai_tools() -> None:
    groups = art_groups([art_trajectory([USER, choice()], tools=[{"name": "add"}])])
    [issue] = check_groups(groups)
    assert issue.loc[:4] == (0, "trajectories", 0, "tools")
    assert issue.type == "invalid_tools"


def test_art_trajectory_metadata_must_be_scalar() -> None:
    with pytest.raises(ValidationError) as exc:
        ArtTrajectory.model_validate_json(
            '{"messages_and_choices": [], "reward": 1, "metadata": {"tags": ["a"]}}'
        )
    assert exc.value.errors()[0]["loc"][:2] == ("metadata", "tags")


def test_art_reward_must_be_finite() -> None:
    with pytest.raises(ValidationError) as exc:
        ArtTrajectoryGroup.model_validate_json(
            '{"trajectories": [{"messages_and_choices": [], "reward": NaN}]}'
        )
    assert exc.value.errors()[0]["loc"] == ("trajectories", 0, "reward")


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------


def test_summarize_collection_flags_groups_grpo_cannot_learn_from() -> None:
    def t(reward: float) -> dict[str, Any]:
        return trajectory([user(), assistant()], reward)

    payload = parse(
        collection(
            [t(1.0), t(0.0)],  # trainable
            [t(1.0)],  # single trajectory
            [t(0.5), t(0.5), t(0.5)],  # equal rewards
            [t(0.5), t(0.5), t(0.7)],  # trainable
        )
    )
    assert summarize_collection(payload) == TrajectorySummary(
        num_groups=4, num_trajectories=9, num_trainable_groups=2, untrainable_groups=[1, 2]
    )


def test_summarize_groups_flags_groups_grpo_cannot_learn_from() -> None:
    def t(reward: float) -> dict[str, Any]:
        return art_trajectory([USER, choice()], reward)

    groups = art_groups([t(0.0), t(0.0)], [t(0.0), t(1.0)], [t(1.0)])
    assert summarize_groups(groups) == TrajectorySummary(
        num_groups=3, num_trajectories=5, num_trainable_groups=1, untrainable_groups=[0, 2]
    )
    assert summarize_groups([]) == TrajectorySummary(
        num_groups=0, num_trajectories=0, num_trainable_groups=0, untrainable_groups=[]
    )
