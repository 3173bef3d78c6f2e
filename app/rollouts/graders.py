"""Graders that score one sampled answer, in the spirit of OpenAI's RFT graders.

Each grader is a strict pydantic model (a member of the `Grader` union, told apart by
`type`); `grade()` scores an answer with one. Local graders are pure and fast. The webhook
grader asks a service of yours. `grade()` never raises for a grader's problem: a webhook
that fails, or an example the grader cannot use, gives a `Grade` with `error` set and no
reward, so one bad answer never sinks a rollout.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator

MAX_WEBHOOK_RESPONSE_BYTES = 1024 * 1024
# How many `{` an answer's embedded-JSON search tries before giving up: bounds the work
# on a long answer full of braces that never close.
MAX_JSON_CANDIDATES = 256

_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_LIST_INDEX = re.compile(r"-?[0-9]+")
# A number as models write it: optional sign (not a hyphen between two words or numbers),
# thousands separators, decimals, scientific notation.
_NUMBER = re.compile(
    r"(?:(?<![\w)\]])[-+\u2212])?"
    r"(?:(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:[eE][-+]?[0-9]+)?"
)


class _Grader(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ExactMatchGrader(_Grader):
    """Reward 1 when the answer equals the example's `expected` (as a string), else 0."""

    type: Literal["exact_match"] = Field(description="Grader kind.")
    case_sensitive: bool = Field(
        default=False, description="Compare case-sensitively; by default case is ignored."
    )
    strip: bool = Field(
        default=True,
        description="Ignore leading and trailing whitespace of the answer and of `expected`.",
    )


class ContainsGrader(_Grader):
    """Reward 1 when the example's `expected` (as a string) occurs in the answer, else 0."""

    type: Literal["contains"] = Field(description="Grader kind.")
    case_sensitive: bool = Field(
        default=False, description="Match case-sensitively; by default case is ignored."
    )


class RegexGrader(_Grader):
    """Reward 1 when the regular expression matches somewhere in the answer, else 0."""

    type: Literal["regex"] = Field(description="Grader kind.")
    pattern: str = Field(
        max_length=1000,
        description="A Python regular expression, searched for anywhere in the answer.",
        examples=[r"\bParis\b"],
    )
    ignore_case: bool = Field(default=False, description="Match case-insensitively.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"invalid regular expression: {exc}") from None
        return pattern


class NumericGrader(_Grader):
    """Reward 1 when the last number in the answer is within `tolerance` of `expected`.

    Numbers may carry a sign, decimals, an exponent and thousands separators (`-3.5e2`,
    `1,234.5`). An answer without a number gets reward 0.
    """

    type: Literal["numeric"] = Field(description="Grader kind.")
    tolerance: float = Field(
        default=1e-6, ge=0, description="Largest accepted difference from `expected`."
    )
    relative: bool = Field(
        default=False,
        description="Read `tolerance` as a fraction of |expected| instead of an absolute "
        "difference.",
    )


class JsonFieldGrader(_Grader):
    """Reward 1 when a field of the answer's JSON equals `expected` (as JSON values), else 0.

    The answer may be a JSON document or text around one: then the first `{...}` block
    that parses is used. A missing field or an answer without JSON gets reward 0.
    """

    type: Literal["json_field"] = Field(description="Grader kind.")
    path: str = Field(
        min_length=1,
        max_length=1000,
        description="Dot-separated keys to the field; integer segments index lists "
        "(negative ones count from the end).",
        examples=["result.items.0.name"],
    )

    @field_validator("path")
    @classmethod
    def _segments(cls, path: str) -> str:
        if "" in path.split("."):
            raise ValueError("path segments must not be empty (e.g. `a.b.0`)")
        return path


class WebhookGrader(_Grader):
    """Your service grades: Trainyard POSTs `{example, answer, generation}` as JSON and
    expects a 2xx JSON answer `{"reward": number, "reasoning": string | null}`."""

    type: Literal["webhook"] = Field(description="Grader kind.")
    url: HttpUrl = Field(description="Where to POST each answer.")
    timeout_s: float = Field(
        default=30, gt=0, le=600, description="Seconds one grading request may take in all."
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="Extra request headers, e.g. `Authorization`.",
    )

    @field_validator("headers")
    @classmethod
    def _valid_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        for name, value in headers.items():
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a valid header name")
            if any(c in value for c in "\r\n\0"):
                raise ValueError(f"the value of header {name!r} contains a line break or NUL")
        return headers


Grader = Annotated[
    ExactMatchGrader
    | ContainsGrader
    | RegexGrader
    | NumericGrader
    | JsonFieldGrader
    | WebhookGrader,
    Field(discriminator="type"),
]

NEEDS_EXPECTED: frozenset[str] = frozenset({"exact_match", "contains", "numeric", "json_field"})


@dataclass(frozen=True)
class Grade:
    """One answer's score: `reward`, or `error` when the grader could not score it."""

    reward: float | None
    reasoning: str | None = None
    error: str | None = None


async def grade(
    grader: Grader,
    *,
    example: dict[str, Any],
    answer: str,
    generation: int,
    client: httpx.AsyncClient,
) -> Grade:
    """Score `answer` to `example`. Never raises for the grader's own problems."""
    if isinstance(grader, WebhookGrader):
        return await _webhook(grader, example, answer, generation, client)
    if grader.type in NEEDS_EXPECTED and example.get("expected") is None:
        return Grade(
            None, error=f"the example has no `expected` value for the {grader.type} grader"
        )
    expected = example.get("expected")
    if isinstance(grader, ExactMatchGrader):
        return _exact_match(grader, str(expected), answer)
    if isinstance(grader, ContainsGrader):
        return _contains(grader, str(expected), answer)
    if isinstance(grader, RegexGrader):
        flags = re.IGNORECASE if grader.ignore_case else 0
        return Grade(1.0 if re.search(grader.pattern, answer, flags) else 0.0)
    if isinstance(grader, NumericGrader):
        return _numeric(grader, expected, answer)
    if isinstance(grader, JsonFieldGrader):
        return _json_field(grader, expected, answer)
    return Grade(None, error=f"unknown grader {grader!r}")  # pragma: no cover


# -- local graders -------------------------------------------------------------------------


def _exact_match(grader: ExactMatchGrader, expected: str, answer: str) -> Grade:
    if grader.strip:
        expected, answer = expected.strip(), answer.strip()
    if not grader.case_sensitive:
        expected, answer = expected.casefold(), answer.casefold()
    return Grade(1.0 if answer == expected else 0.0)


def _contains(grader: ContainsGrader, expected: str, answer: str) -> Grade:
    if not grader.case_sensitive:
        expected, answer = expected.casefold(), answer.casefold()
    return Grade(1.0 if expected in answer else 0.0)


def _to_float(text: str) -> float:
    return float(text.replace(",", "").replace("\u2212", "-"))


def last_number(text: str) -> float | None:
    """The last number written in `text`, or None when there is none."""
    last = None
    for match in _NUMBER.finditer(text):
        last = match
    return _to_float(last.group()) if last is not None else None


def _expected_number(expected: Any) -> float | None:
    if isinstance(expected, bool):
        return None
    if isinstance(expected, int | float):
        try:
            value = float(expected)
        except OverflowError:  # an integer too large for a float
            return None
    elif isinstance(expected, str) and _NUMBER.fullmatch(expected.strip()):
        value = _to_float(expected.strip())
    else:
        return None
    return value if math.isfinite(value) else None


def _numeric(grader: NumericGrader, expected: Any, answer: str) -> Grade:
    target = _expected_number(expected)
    if target is None:
        return Grade(
            None, error=f"the numeric grader's expected value {expected!r} is not a number"
        )
    got = last_number(answer)
    if got is None:
        return Grade(0.0, reasoning="no number in the answer")
    allowed = grader.tolerance * abs(target) if grader.relative else grader.tolerance
    if abs(got - target) <= allowed:
        return Grade(1.0)
    return Grade(0.0, reasoning=f"the answer's last number is {got:g}, expected {target:g}")


_MISSING = object()


def _parse_json(answer: str) -> Any:
    """The answer as JSON, or the first `{...}` block in it that parses; else `_MISSING`."""
    try:
        return json.loads(answer)
    except (ValueError, RecursionError):
        pass
    decoder = json.JSONDecoder()
    start = answer.find("{")
    for _ in range(MAX_JSON_CANDIDATES):
        if start < 0:
            break
        try:
            return decoder.raw_decode(answer, start)[0]
        except (ValueError, RecursionError):
            start = answer.find("{", start + 1)
    return _MISSING


def _follow(document: Any, path: str) -> Any:
    for segment in path.split("."):
        if isinstance(document, dict):
            if segment not in document:
                return _MISSING
            document = document[segment]
        elif isinstance(document, list) and _LIST_INDEX.fullmatch(segment):
            index = int(segment)
            if not -len(document) <= index < len(document):
                return _MISSING
            document = document[index]
        else:
            return _MISSING
    return document


def json_equal(a: Any, b: Any) -> bool:
    """Equality of two JSON values: numbers by value, but `true` is not `1`."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if a is None or b is None:
        return a is None and b is None
    return type(a) is type(b) and a == b


def _json_field(grader: JsonFieldGrader, expected: Any, answer: str) -> Grade:
    document = _parse_json(answer)
    if document is _MISSING:
        return Grade(0.0, reasoning="no JSON in the answer")
    value = _follow(document, grader.path)
    if value is _MISSING:
        return Grade(0.0, reasoning=f"the answer's JSON has no `{grader.path}`")
    return Grade(1.0 if json_equal(value, expected) else 0.0)


# -- webhook -------------------------------------------------------------------------------


class _TooLarge(Exception):
    pass


def _snippet(body: bytes, limit: int = 200) -> str:
    text = body.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


async def _webhook(
    grader: WebhookGrader,
    example: dict[str, Any],
    answer: str,
    generation: int,
    client: httpx.AsyncClient,
) -> Grade:
    try:
        payload = json.dumps(
            {"example": example, "answer": answer, "generation": generation},
            allow_nan=False,
            separators=(",", ":"),
        ).encode()
    except (TypeError, ValueError) as exc:
        return Grade(None, error=f"webhook grader: the example is not JSON-serialisable: {exc}")
    headers = httpx.Headers(grader.headers)
    headers["content-type"] = "application/json"
    try:
        async with (
            asyncio.timeout(grader.timeout_s),
            client.stream(
                "POST", str(grader.url), content=payload, headers=headers, timeout=grader.timeout_s
            ) as response,
        ):
            status = response.status_code
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_WEBHOOK_RESPONSE_BYTES:
                    raise _TooLarge
    except (TimeoutError, httpx.TimeoutException):
        return Grade(None, error=f"webhook grader timed out after {grader.timeout_s:g} s")
    except _TooLarge:
        return Grade(
            None, error=f"webhook grader answered more than {MAX_WEBHOOK_RESPONSE_BYTES} bytes"
        )
    except Exception as exc:
        detail = str(exc) or "no detail"
        return Grade(None, error=f"webhook grader request failed: {type(exc).__name__}: {detail}")
    if not 200 <= status < 300:
        return Grade(None, error=f"webhook grader answered HTTP {status}: {_snippet(bytes(body))}")
    return _webhook_body(bytes(body), status)


def _webhook_body(body: bytes, status: int) -> Grade:
    bad = f"webhook grader answered HTTP {status} with"
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return Grade(None, error=f"{bad} a body that is not JSON: {_snippet(body)}")
    if not isinstance(parsed, dict):
        return Grade(None, error=f"{bad} a JSON {type(parsed).__name__}, not an object")
    reward = parsed.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        return Grade(None, error=f"{bad} no numeric `reward`: {_snippet(body)}")
    try:
        reward = float(reward)
    except OverflowError:
        reward = math.inf
    if not math.isfinite(reward):
        return Grade(None, error=f"{bad} a reward that is not finite: {reward}")
    reasoning = parsed.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        return Grade(None, error=f"{bad} a `reasoning` that is not a string or null")
    return Grade(reward, reasoning=reasoning)
