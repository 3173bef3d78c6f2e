"""Graders that score one sampled answer, in the spirit of OpenAI's RFT graders.

Each grader is a strict pydantic model (a member of the `Grader` union, told apart by
`type`, in `app.schemas.graders`); `grade()` scores an answer with one. Local graders are
pure and bounded: work linear in the answer (`regex` runs on RE2, a linear-time engine),
answers over
`MAX_GRADED_CHARS` are not graded, and long answers are graded off the event loop. The
webhook grader asks a service of yours, through `app.egress` (its policy, a total deadline,
a bounded answer). `grade()` never raises for a grader's problem: a webhook that fails, or
an example the grader cannot use, gives a `Grade` with `error` set and no reward, so one
bad answer never sinks a rollout. Errors say what went wrong (a status, a length), never
what a remote service answered.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from app.egress import EgressClient, EgressError
from app.schemas.graders import (  # the wire models, re-exported for the graders' callers
    MAX_REGEX_WORK,
    NEEDS_EXPECTED,
    ContainsGrader,
    ExactMatchGrader,
    Grader,
    JsonFieldGrader,
    NumericGrader,
    RegexGrader,
    WebhookGrader,
    compile_regex,
)

MAX_WEBHOOK_RESPONSE_BYTES = 1024 * 1024
# Longest answer a grader reads: a longer one gets an error grade, not a reward.
MAX_GRADED_CHARS = 1_000_000
# Answers longer than this are graded in a thread, so the event loop keeps serving.
THREAD_CHARS = 64 * 1024
# How many `{` an answer's embedded-JSON search tries before giving up, and how many
# characters all tries may read together: bounds the work on a long answer full of braces
# that never close.
MAX_JSON_CANDIDATES = 256
MAX_JSON_SCAN_CHARS = 2 * MAX_GRADED_CHARS

_LIST_INDEX = re.compile(r"-?[0-9]+")
# Characters a number may be written with (see `_NUMBER`), and how far back from the last
# digit `last_number` looks for where its number starts.
_NUMBER_CHARS = "0123456789,.eE+-\u2212"
NUMBER_WINDOW = 64 * 1024
MAX_EXPECTED_NUMBER_CHARS = 1000
# A number as models write it: optional sign (not a hyphen between two words or numbers),
# thousands separators, decimals, scientific notation.
_NUMBER = re.compile(
    r"(?:(?<![\w)\]])[-+\u2212])?"
    r"(?:(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:[eE][-+]?[0-9]+)?"
)


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
    client: EgressClient,
) -> Grade:
    """Score `answer` to `example`. Never raises for the grader's own problems."""
    if len(answer) > MAX_GRADED_CHARS:
        return Grade(
            None,
            error=f"the answer is {len(answer)} characters long; graders read at most "
            f"{MAX_GRADED_CHARS}",
        )
    if isinstance(grader, WebhookGrader):
        return await _webhook(grader, example, answer, generation, client)
    expected = example.get("expected")
    if grader.type in NEEDS_EXPECTED and expected is None:
        return Grade(
            None, error=f"the example has no `expected` value for the {grader.type} grader"
        )
    size = len(answer)
    if isinstance(grader, ExactMatchGrader | ContainsGrader):
        expected = str(expected)  # compared as text, as long as the answer may be
        if len(expected) > MAX_GRADED_CHARS:
            return Grade(
                None,
                error=f"the example's `expected` is {len(expected)} characters long; graders "
                f"read at most {MAX_GRADED_CHARS}",
            )
        size += len(expected)
    if size > THREAD_CHARS:
        return await asyncio.to_thread(grade_locally, grader, expected, answer)
    return grade_locally(grader, expected, answer)


def grade_locally(grader: Grader, expected: Any, answer: str) -> Grade:
    """A local grader's score: bounded work, linear in the answer."""
    if isinstance(grader, ExactMatchGrader):
        return _exact_match(grader, str(expected), answer)
    if isinstance(grader, ContainsGrader):
        return _contains(grader, str(expected), answer)
    if isinstance(grader, RegexGrader):
        regex = compile_regex(grader.pattern, grader.ignore_case)
        if len(answer) * regex.programsize > MAX_REGEX_WORK:
            return Grade(
                None,
                error=f"the answer ({len(answer)} characters) is too long for this pattern "
                f"({regex.programsize} RE2 instructions)",
            )
        return Grade(1.0 if regex.search(answer) else 0.0)
    if isinstance(grader, NumericGrader):
        return _numeric(grader, expected, answer)
    if isinstance(grader, JsonFieldGrader):
        return _json_field(grader, expected, answer)
    return Grade(None, error=f"unknown grader {grader.type!r}")  # pragma: no cover


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
    """The last number written in `text`, or None when there is none.

    The last number holds the last digit, so only the text before it is searched, from the
    start of the run of number characters it stands in, at most `NUMBER_WINDOW` back: the
    same number a search of the whole text finds (no number spans another character), in
    bounded time. (`re` holds the GIL for a whole search: a long one would stall the event
    loop even from a thread.)"""
    end = max(text.rfind(digit) for digit in "0123456789")
    if end < 0:
        return None
    start = max(0, end - NUMBER_WINDOW)
    if start > 0 and text[start - 1] in _NUMBER_CHARS:  # inside a run: begin after it
        window = text[start : end + 1]
        after_run = start + len(window) - len(window.lstrip(_NUMBER_CHARS))
        if after_run <= end:
            start = after_run
    last = None
    for match in _NUMBER.finditer(text, start, end + 2):  # + a "." that may end it
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
    elif (
        isinstance(expected, str)
        and len(expected) <= MAX_EXPECTED_NUMBER_CHARS
        and _NUMBER.fullmatch(expected.strip())
    ):
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
    budget = MAX_JSON_SCAN_CHARS
    for _ in range(MAX_JSON_CANDIDATES):
        if start < 0 or budget <= 0:
            break
        try:
            return decoder.raw_decode(answer, start)[0]
        except json.JSONDecodeError as exc:
            # The decoder reads left to right and stops where it failed, except in a string
            # that never ends: that it read to the end of the answer.
            unterminated = exc.msg.startswith("Unterminated string")
            budget -= (len(answer) if unterminated else exc.pos + 1) - start
        except (ValueError, RecursionError):
            budget -= len(answer) - start
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


async def _webhook(
    grader: WebhookGrader,
    example: dict[str, Any],
    answer: str,
    generation: int,
    client: EgressClient,
) -> Grade:
    try:
        payload = json.dumps(
            {"example": example, "answer": answer, "generation": generation},
            allow_nan=False,
            separators=(",", ":"),
        ).encode()
    except (TypeError, ValueError) as exc:
        return Grade(None, error=f"webhook grader: the example is not JSON-serialisable: {exc}")
    try:
        reply = await client.post_json(
            str(grader.url),
            payload,
            headers=grader.headers,
            timeout_s=grader.timeout_s,
            max_bytes=MAX_WEBHOOK_RESPONSE_BYTES,
        )
    except EgressError as exc:
        return Grade(None, error=f"webhook grader {exc}")
    if not reply.ok:
        return Grade(None, error=f"webhook grader answered {reply.describe()}")
    return _webhook_body(reply.body, reply.status)


def _webhook_body(body: bytes, status: int) -> Grade:
    bad = f"webhook grader answered HTTP {status} with"
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return Grade(None, error=f"{bad} a body that is not JSON ({len(body)} bytes)")
    if not isinstance(parsed, dict):
        return Grade(None, error=f"{bad} a JSON {type(parsed).__name__}, not an object")
    reward = parsed.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        return Grade(None, error=f"{bad} no numeric `reward` ({len(body)} bytes)")
    try:
        reward = float(reward)
    except OverflowError:
        reward = math.inf
    if not math.isfinite(reward):
        return Grade(None, error=f"{bad} a reward that is not finite")
    reasoning = parsed.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        return Grade(None, error=f"{bad} a `reasoning` that is not a string or null")
    return Grade(reward, reasoning=reasoning)
