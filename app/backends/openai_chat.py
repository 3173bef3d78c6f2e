"""The OpenAI chat completion request, read whole: what the gateway checks before it
forwards a request, and what the cpu backend's endpoint checks before it samples.

- `messages[i].role` is one OpenAI has (`system`, `developer`, `user`, `assistant`,
  `tool`, `function`); `content` is a string, null (an assistant turn with tool calls), or
  an array of parts: `text` parts (and an assistant's `refusal` parts) are joined, parts a
  text model cannot take (`image_url`, `input_audio`, `file`, ...) are refused by path,
  e.g. `messages[0].content[1]`.
- `tools[i]` is `{"type": "function", "function": {"name": ...}}`; an assistant's
  `tool_calls[j]` is `{"id", "type": "function", "function": {"name", "arguments"}}`;
  `name` and `tool_call_id` are strings.
- Numeric fields are range-checked as OpenAI defines them (`seed` a signed 64-bit integer,
  `temperature` in [0, 2], `top_p` in [0, 1], `n` >= 1, `max_tokens` >= 1, ...).

Every refusal is a `ChatInvalid` naming the path of the field.
"""

from __future__ import annotations

import math
from typing import Any

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
TEXT_PARTS = frozenset({"text", "refusal"})
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_PARTS = 4096
MAX_TOOLS = 128


class ChatInvalid(Exception):
    def __init__(self, path: str, message: str, code: str = "invalid_request") -> None:
        super().__init__(f"`{path}` {message}")
        self.path, self.code = path, code
        self.message = f"`{path}` {message}"


def is_step(text: str) -> bool:
    """A step as a model name writes it after `@`: ASCII digits, no leading zero (but
    `0`), not empty."""
    return text.isascii() and text.isdigit() and (text == "0" or not text.startswith("0"))


def _text(path: str, content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatInvalid(path, "must be a string or an array of content parts.")
    if len(content) > MAX_PARTS:
        raise ChatInvalid(path, f"has more than {MAX_PARTS} parts.")
    texts = []
    for index, part in enumerate(content):
        where = f"{path}[{index}]"
        if not isinstance(part, dict):
            raise ChatInvalid(where, "must be an object with a `type`.")
        kind = part.get("type")
        if not isinstance(kind, str) or kind not in TEXT_PARTS:
            shown = kind if isinstance(kind, str) else repr(kind)
            raise ChatInvalid(
                where,
                f"is a `{shown[:40]}` part: this model takes text parts only.",
                "unsupported_content",
            )
        text = part.get(kind)
        if not isinstance(text, str):
            raise ChatInvalid(f"{where}.{kind}", "must be a string.")
        texts.append(text)
    return "".join(texts)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages with every `content` as a string (or null); `ChatInvalid` otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ChatInvalid("messages", "must be a non-empty array.", "invalid_messages")
    normalized = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ChatInvalid(where, "must be an object.", "invalid_messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ChatInvalid(
                f"{where}.role",
                f"must be one of {', '.join(sorted(ROLES))}.",
                "invalid_messages",
            )
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise ChatInvalid(f"{where}.{key}", "must be a string.", "invalid_messages")
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise ChatInvalid(
                    f"{where}.tool_calls", "is for assistant messages only.", "invalid_messages"
                )
            _check_tool_calls(f"{where}.tool_calls", message["tool_calls"])
        content = _text(f"{where}.content", message.get("content"))
        if content is None and role != "assistant":
            raise ChatInvalid(f"{where}.content", "must be given.", "invalid_messages")
        normalized.append({**message, "content": content})
    return normalized


def _check_tool_calls(path: str, calls: Any) -> None:
    """`[{"id", "type": "function", "function": {"name", "arguments"}}]`, as OpenAI
    returns them."""
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise ChatInvalid(path, f"must be an array of at most {MAX_TOOLS} tool calls.")
    for index, call in enumerate(calls):
        where = f"{path}[{index}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise ChatInvalid(where, "must be a tool call of type `function`.", "invalid_messages")
        if not isinstance(call.get("id"), str):
            raise ChatInvalid(f"{where}.id", "must be a string.", "invalid_messages")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ChatInvalid(f"{where}.function", "must be an object.", "invalid_messages")
        for key in ("name", "arguments"):
            if not isinstance(function.get(key), str):
                raise ChatInvalid(
                    f"{where}.function.{key}", "must be a string.", "invalid_messages"
                )


def check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ChatInvalid("tools", "must be an array.", "invalid_tools")
    if len(tools) > MAX_TOOLS:
        raise ChatInvalid("tools", f"has more than {MAX_TOOLS} tools.", "invalid_tools")
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ChatInvalid(f"{where}.type", "must be `function`.", "invalid_tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ChatInvalid(f"{where}.function", "must be an object.", "invalid_tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ChatInvalid(f"{where}.function.name", "must be a name.", "invalid_tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ChatInvalid(f"{where}.function.parameters", "must be an object.", "invalid_tools")


# field: (integer only, lowest, highest)
_NUMBERS: dict[str, tuple[bool, float, float]] = {
    "seed": (True, INT64_MIN, INT64_MAX),
    "n": (True, 1, 128),
    "max_tokens": (True, 1, INT64_MAX),
    "max_completion_tokens": (True, 1, INT64_MAX),
    "top_logprobs": (True, 0, 20),
    "temperature": (False, 0, 2),
    "top_p": (False, 0, 1),
    "frequency_penalty": (False, -2, 2),
    "presence_penalty": (False, -2, 2),
}
_BOOLEANS = ("stream", "logprobs", "parallel_tool_calls")


def check_fields(body: dict[str, Any]) -> None:
    """The numeric and boolean fields of a chat request are in OpenAI's ranges."""
    for name, (integer, low, high) in _NUMBERS.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ChatInvalid(name, "must be a number.", "invalid_value")
        if integer and not isinstance(value, int):
            raise ChatInvalid(name, "must be an integer.", "invalid_value")
        if isinstance(value, float) and not math.isfinite(value):
            raise ChatInvalid(name, "must be a finite number.", "invalid_value")
        if not low <= value <= high:
            raise ChatInvalid(name, f"must be between {low} and {high}.", "invalid_value")
    for name in _BOOLEANS:
        if name in body and body[name] is not None and not isinstance(body[name], bool):
            raise ChatInvalid(name, "must be a boolean.", "invalid_value")
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise ChatInvalid("stop", "must be a string or up to 4 strings.", "invalid_value")


def check_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The request with its messages normalized; `ChatInvalid` names what is wrong."""
    check_fields(body)
    check_tools(body.get("tools"))
    return {**body, "messages": normalize_messages(body.get("messages"))}
