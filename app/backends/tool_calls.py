"""Tool calls in generated text, the Hermes/Qwen convention: the model writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and the chat template renders an
assistant turn's `tool_calls` the same way. Parsed back into OpenAI's `tool_calls`."""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside tool calls or None, OpenAI `tool_calls`). A block that is not a
    JSON object with a string `name` stays in the text: nothing is invented."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    end = 0
    for match in _CALL.finditer(text):
        call = _openai_call(match.group(1))
        if call is None:
            continue
        kept.append(text[end : match.start()])
        end = match.end()
        calls.append(call)
    kept.append(text[end:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _openai_call(block: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(block)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    return {
        "id": f"call_{secrets.token_hex(8)}",
        "type": "function",
        "function": {
            "name": parsed["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }
