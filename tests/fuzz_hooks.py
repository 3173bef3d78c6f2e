"""Schemathesis hooks for the fuzz run (`SCHEMATHESIS_HOOKS=tests.fuzz_hooks`): how to put a
JSON Lines body (a dataset upload) on the wire."""

from __future__ import annotations

import json
from typing import Any

import schemathesis


@schemathesis.serializer("application/jsonl")
def jsonl(ctx: Any, value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json.dumps(value).encode()
