"""Tools on the cpu backend: offered through the model's chat template, and tool calls in
the Hermes/Qwen `<tool_call>` convention parsed back into OpenAI `tool_calls`."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from app.backends.tool_calls import parse_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def _named(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_calls_are_parsed_and_the_rest_stays_text() -> None:
    text = "let me look. " + _call("get_weather", {"city": "Paris", "days": [1, {"x": 2}]})
    content, calls = parse_tool_calls(text + " " + _call("search", {}))
    assert content == "let me look."
    assert _named(calls) == [
        ("get_weather", {"city": "Paris", "days": [1, {"x": 2}]}),
        ("search", {}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    only, [call] = parse_tool_calls(_call("search", {"q": "x"}))
    assert only is None and call["function"]["arguments"] == '{"q": "x"}'


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["get_weather"]</tool_call>',
        '<tool_call>{"name": 3}</tool_call>',
        '<tool_call>{"name": "x"}',  # never closed
    ],
)
def test_what_is_not_a_call_stays_text(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


def test_arguments_given_as_a_json_string_are_kept_as_they_are() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    [call] = parse_tool_calls(text)[1]
    assert call["function"]["arguments"] == '{"a": 1}'


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from app.backends.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tools") / "tiny")


@pytest.mark.torch
def test_the_chat_template_renders_tools_and_calls_the_parser_reads_back(tiny_model) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    arguments = {"city": "Paris"}
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
        }
    ]
    messages = [
        {"role": "user", "content": "weather"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False)
    assert text.startswith("<|system|> <tools> ") and '"get_weather"' in text.split("<|end|>")[0]
    assistant_turn = text.split("<|assistant|> ", 1)[1].split(" <|end|>", 1)[0]
    content, parsed = parse_tool_calls(assistant_turn)
    assert content is None and _named(parsed) == [("get_weather", arguments)]
    assert "<|tool|> sunny <|end|>" in text
    # Without tools and calls the template renders exactly as it always did.
    plain = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert plain == "<|user|> weather <|end|> <|assistant|> "


@pytest.mark.torch
async def test_tools_reach_the_prompt_through_the_gateway(serve, tiny_model) -> None:
    async with serve(worker_enabled=True, model_roots=[tiny_model.parent]) as live:
        created = await live.client.post(
            "/v1/models", json={"name": "toy", "base_model": str(tiny_model), "backend": "cpu"}
        )
        assert created.status_code == 201, created.text
        client = openai.AsyncOpenAI(base_url=f"{live.url}/openai/v1", api_key="-", max_retries=0)
        ask = {
            "model": "toy",
            "messages": [{"role": "user", "content": "weather"}],
            "max_tokens": 2,
        }
        plain = await client.chat.completions.create(**ask)
        offered = await client.chat.completions.create(**ask, tools=[WEATHER], tool_choice="auto")
        assert offered.usage.prompt_tokens > plain.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(**ask, tools=[WEATHER], tool_choice="required")
        assert "tool_choice" in str(refused.value)
