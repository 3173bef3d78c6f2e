"""Check training keywords against a backend's hyper-parameter schema (`GET /v1/backends`)
before anything is spent on them: the server checks them again when a job is submitted.

The schemas are what pydantic writes for the server's strict models, so this reads the
part of JSON Schema they use: `properties`, `additionalProperties`, `type`, `anyOf`,
`enum`, `const` and the numeric bounds, reading values as leniently as the server's
models do (a number may come as a string of one).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def _number(value: Any) -> float | None:
    """`value` as the server's models read a number (leniently, as pydantic does: `1e-5`
    in YAML is the string "1e-5"), or None when it is none."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _is(kind: str, value: Any) -> bool:
    if kind == "number":
        return _number(value) is not None
    if kind == "integer":
        number = _number(value)
        if isinstance(value, str):
            return value.strip().lstrip("+-").isdigit()
        return number is not None and number.is_integer()
    if kind == "boolean":
        if isinstance(value, str):
            return value.strip().lower() in _TRUE | _FALSE
        return isinstance(value, bool) or (isinstance(value, int | float) and value in (0, 1))
    if kind == "string":
        return isinstance(value, str)
    if kind == "null":
        return value is None
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list | tuple)
    return True


def check_hyperparameters(schema: Mapping[str, Any], values: Mapping[str, Any]) -> list[str]:
    """What is wrong with `values` under `schema` (a backend's `hyperparameters`), one
    message per bad keyword naming it; empty when they are acceptable."""
    properties: Mapping[str, Any] = schema.get("properties") or {}
    problems = []
    for key, value in values.items():
        if key not in properties:
            if schema.get("additionalProperties") is False:
                known = ", ".join(sorted(properties))
                problems.append(f"{key}: not a keyword this backend accepts (it accepts {known})")
            continue
        reason = _mismatch(properties[key], value, schema.get("$defs") or {})
        if reason:
            problems.append(f"{key}: {reason}")
    return problems


def _mismatch(schema: Mapping[str, Any], value: Any, defs: Mapping[str, Any]) -> str | None:
    if "$ref" in schema:
        schema = defs.get(str(schema["$ref"]).rsplit("/", 1)[-1], {})
    if "anyOf" in schema:
        reasons = [_mismatch(option, value, defs) for option in schema["anyOf"]]
        if all(reasons):
            return " or ".join(r for r in reasons if r)
        return None
    if "const" in schema and value != schema["const"]:
        return f"must be {schema['const']!r}, got {value!r}"
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {schema['enum']!r}, got {value!r}"
    kind = schema.get("type")
    if isinstance(kind, str) and not _is(kind, value):
        return f"must be {_article(kind)}, got {value!r}"
    number = _number(value) if kind in ("number", "integer") else None
    if number is not None:
        for bound, fails, words in (
            ("minimum", operator.lt, "at least"),
            ("exclusiveMinimum", operator.le, "greater than"),
            ("maximum", operator.gt, "at most"),
            ("exclusiveMaximum", operator.ge, "less than"),
        ):
            if bound in schema and fails(number, schema[bound]):
                return f"must be {words} {schema[bound]}, got {value!r}"
    return None


def _article(kind: str) -> str:
    return {"integer": "an integer", "array": "an array", "object": "an object"}.get(
        kind, "null" if kind == "null" else f"a {kind}"
    )
