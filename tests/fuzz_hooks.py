"""Schemathesis hooks for the fuzz run (`SCHEMATHESIS_HOOKS=tests.fuzz_hooks`): how to put a
JSON Lines body (a dataset upload) on the wire, and a check of our own: every 422 names
paths of the body that was sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import schemathesis


@schemathesis.serializer("application/jsonl")
def jsonl(ctx: Any, value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json.dumps(value).encode()


@schemathesis.check
def error_paths_name_the_body(ctx: Any, response: Any, case: Any) -> None:
    """A 422's body errors name a value of the body sent, a field missing from one of its
    objects (a `missing` error), or an object's key (`….[key]`): never a branch of a union
    (`grader.regex.…`, `id.str`), which names nothing the client sent."""
    if response.status_code != 422 or not (case.media_type or "").endswith("json"):
        return
    try:
        errors = json.loads(response.content).get("errors") or []
    except ValueError:
        return
    nodes = dict(_nodes(case.body, ""))
    for error in errors:
        path = error.get("path", "")
        if error.get("location") != "body" or path in nodes:
            continue
        head, _, last = path.rpartition(".")
        missing = error.get("type") == "missing"
        if missing and isinstance(nodes.get(head), dict) and last not in nodes[head]:
            continue  # a missing field
        if last == "[key]" and head in nodes:
            continue
        raise AssertionError(f"a 422 names {path!r}, which is not a path of the body sent")


def _nodes(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _nodes(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _nodes(item, f"{path}[{i}]")
