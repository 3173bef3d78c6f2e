"""Tokens trained: counted in what the trainer is handed, without its tokenizer (which
lives in the backend, often in another process): a sampled answer whose logprobs name its
tokens counts one token a logprob; other text (prompts, messages, SFT examples, DPO
pairs) counts at `BYTES_PER_TOKEN` UTF-8 bytes a token, rounded up, an estimate."""

from __future__ import annotations

from typing import Any

BYTES_PER_TOKEN = 4
TEXT_KEYS = frozenset({"content", "prompt", "chosen", "rejected", "text", "arguments"})


def count(value: Any) -> int:
    """Tokens in the JSON a job stored (groups, examples or pairs)."""
    if isinstance(value, list):
        return sum(count(item) for item in value)
    if not isinstance(value, dict):
        return 0
    logprobs = value.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
        return len(logprobs["content"])  # a sampled choice: its tokens, exactly
    total = 0
    for key, item in value.items():
        if isinstance(item, str):
            total += _text(item) if key in TEXT_KEYS else 0
        else:
            total += count(item)
    return total


def _text(text: str) -> int:
    return -(-len(text.encode()) // BYTES_PER_TOKEN)
