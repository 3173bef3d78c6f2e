"""Graders: every local grader on answers that could trip it, the webhook grader against a
real grading service over loopback HTTP, and the union's validation."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter, ValidationError

from app.egress import EgressClient, EgressPolicy
from app.rollouts import graders
from app.rollouts.graders import MAX_GRADED_CHARS, THREAD_CHARS, Grade, grade
from app.schemas.graders import (
    MAX_REGEX_PROGRAM,
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
from tests.conftest import LiveServer

GRADER = TypeAdapter(Grader)


def make(**spec: Any) -> Any:
    return GRADER.validate_python(spec)


async def score(spec: dict[str, Any], answer: str, expected: Any = None) -> Grade:
    async with EgressClient(EgressPolicy()) as client:
        return await grade(
            make(**spec),
            example={"id": 1, "expected": expected},
            answer=answer,
            generation=0,
            client=client,
        )


# -- exact match, contains, regex ----------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "answer", "expected", "reward"),
    [
        ({}, "  Paris \n", "paris", 1.0),
        ({"case_sensitive": True}, "Paris", "paris", 0.0),
        ({"case_sensitive": True}, "Paris", "Paris", 1.0),
        ({"strip": False}, " Paris", "Paris", 0.0),
        ({}, "42", 42, 1.0),
        ({}, "Paris, France", "Paris", 0.0),
        ({}, "STRASSE", "straße", 1.0),  # casefold, not just lower()
    ],
)
async def test_exact_match(spec: dict[str, Any], answer: str, expected: Any, reward: float) -> None:
    result = await score({"type": "exact_match", **spec}, answer, expected)
    assert result == Grade(reward)


@pytest.mark.parametrize(
    ("spec", "answer", "expected", "reward"),
    [
        ({}, "The capital is PARIS.", "Paris", 1.0),
        ({"case_sensitive": True}, "The capital is PARIS.", "Paris", 0.0),
        ({}, "The capital is Lyon.", "Paris", 0.0),
        ({}, "x = 12345", 234, 1.0),
    ],
)
async def test_contains(spec: dict[str, Any], answer: str, expected: Any, reward: float) -> None:
    assert (await score({"type": "contains", **spec}, answer, expected)).reward == reward


async def test_graders_that_need_expected_give_an_error_grade_without_it() -> None:
    for kind in sorted(NEEDS_EXPECTED):
        spec: dict[str, Any] = {"type": kind}
        if kind == "json_field":
            spec["path"] = "a"
        result = await score(spec, "anything", expected=None)
        assert result.reward is None
        assert result.error is not None and "expected" in result.error and kind in result.error
    assert {"exact_match", "contains", "numeric", "json_field"} == NEEDS_EXPECTED


@pytest.mark.parametrize(
    ("spec", "answer", "reward"),
    [
        ({"pattern": r"\bParis\b"}, "It is Paris.", 1.0),
        ({"pattern": r"\bParis\b"}, "It is paris.", 0.0),
        ({"pattern": r"\bParis\b", "ignore_case": True}, "It is paris.", 1.0),
        ({"pattern": r"\bParis\b"}, "Parisian food", 0.0),
        ({"pattern": r"^\d+$"}, "answer: 42", 0.0),
    ],
)
async def test_regex(spec: dict[str, Any], answer: str, reward: float) -> None:
    assert (await score({"type": "regex", **spec}, answer)).reward == reward


def test_regex_rejects_an_invalid_pattern_with_the_regex_error() -> None:
    with pytest.raises(ValidationError) as info:
        make(type="regex", pattern="([a-z")
    message = str(info.value)
    assert "invalid regular expression" in message
    assert "missing ]: [a-z" in message


# Patterns that take Python's backtracking `re` exponential or polynomial time on answers
# like the ones beside them (the first held a worker's event loop 8 s at 26, each +1
# doubling it); RE2 runs each in time linear in the answer.
CATASTROPHIC = [
    (r"^(.?){26}.{26}$", "a" * 26),
    (r"^(.?){40}.{40}$", "a" * 40),
    (r"(a+)+$", "a" * 5000 + "!"),
    (r"(a|aa)+$", "a" * 5000 + "!"),
    (r"(\w+\s?)*$", "word " * 2000 + "!"),
    (r"(x+x+)+y", "x" * 5000),
    (r"(.*a){20}", "a" * 5000),
    (r"^(([a-z])+.)+[A-Z]([a-z])+$", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!"),
    (r"(?i)(a+)+b", "A" * 5000),
]


@pytest.mark.parametrize(("pattern", "answer"), CATASTROPHIC)
async def test_regex_that_backtracks_catastrophically_in_re_is_linear(
    pattern: str, answer: str
) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    for ignore_case in (False, True):
        result = await score(
            {"type": "regex", "pattern": pattern, "ignore_case": ignore_case}, answer
        )
        assert result.error is None and result.reward in (0.0, 1.0)
    # Linear: a few ms here; `re` would backtrack for years. 2 s: no load reaches it.
    assert loop.time() - start < 2.0


async def test_regex_on_the_longest_answer_keeps_the_event_loop_serving() -> None:
    """The worst program accepted, on answers a thread grades: the loop never waits."""
    loop = asyncio.get_running_loop()
    lags: list[float] = []

    async def tick() -> None:
        while True:
            begin = loop.time()
            await asyncio.sleep(0.01)
            lags.append(loop.time() - begin - 0.01)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    pattern = r"(.*a){180}"  # just under MAX_REGEX_PROGRAM; its DFA gives up
    size = compile_regex(pattern, False).programsize
    assert MAX_REGEX_PROGRAM - 100 < size <= MAX_REGEX_PROGRAM
    answer = "abcdefghij " * (MAX_REGEX_WORK // size // 11)  # the most work allowed
    begin = loop.time()
    result = await score({"type": "regex", "pattern": pattern}, answer)  # ~0.9 s of RE2
    elapsed = loop.time() - begin
    ticker.cancel()
    assert result.error is None and result.reward == 1.0
    # Graded on the loop, the loop would wait the whole grading (lag ≈ elapsed); graded
    # in a thread, its longest wait is a few switch intervals however loaded the machine.
    assert max(lags) < max(0.5, elapsed / 2), (max(lags), elapsed)
    assert elapsed < 30, elapsed
    over = answer + "x" * 20_000  # a little more work than allowed: not graded
    result = await score({"type": "regex", "pattern": pattern}, over)
    assert result.error is not None and "too long for this pattern" in result.error


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        (r"(a)\1", "invalid escape sequence: \\1"),  # backreference
        (r"(?P<x>a)(?P=x)", "invalid perl operator: (?P"),
        (r"(?=a)b", "invalid perl operator: (?="),  # lookahead
        (r"(?!a)b", "invalid perl operator: (?!"),
        (r"(?<=a)b", "invalid perl operator: (?<="),  # lookbehind
        (r"(?<!a)b", "invalid perl operator: (?<!"),
        (r"(?>a+)b", "invalid perl operator: (?>"),  # atomic group
        (r"a*+b", "bad repetition operator: *+"),  # possessive
        (r"a{1001}", "invalid repetition size"),
        (r"((a{100}){100}){100}", "invalid repetition size"),
        (r"\p{L}{1000}", "pattern too large"),
        (r"(\w+\s?){1000}x", "compiles to 10005 RE2 instructions; at most 2000"),
        (r"(.*a){1000}", "RE2 instructions; at most 2000"),
        (r"[a-z]{500}", "RE2 instructions; at most 2000"),  # only ignoring case: 3004
    ],
)
def test_regex_refuses_what_re2_cannot_run_in_bounded_time(pattern: str, reason: str) -> None:
    with pytest.raises(ValidationError) as info:
        make(type="regex", pattern=pattern)
    assert reason in str(info.value)


@pytest.mark.parametrize(
    ("spec", "answer"),
    [
        ({"type": "exact_match"}, "x"),
        ({"type": "contains"}, "x"),
        ({"type": "regex", "pattern": "x"}, "x"),
        ({"type": "numeric"}, "1"),
        ({"type": "json_field", "path": "a"}, "{"),
    ],
)
async def test_an_answer_over_the_limit_is_not_graded(spec: dict[str, Any], answer: str) -> None:
    long = answer * (MAX_GRADED_CHARS + 1)
    result = await score(spec, long, expected="x")
    assert result.reward is None
    assert result.error == (
        f"the answer is {len(long)} characters long; graders read at most {MAX_GRADED_CHARS}"
    )


def embedded_json_worst_case(length: int) -> str:
    """Braces that each open a long JSON prefix that never closes: every candidate reads
    to the end of the answer unless the search is bounded."""
    text = '{"a":' * 300 + "[" + "0," * length
    return text[:length]


@pytest.mark.parametrize(
    ("spec", "answer"),
    [
        ({"type": "json_field", "path": "a"}, embedded_json_worst_case(MAX_GRADED_CHARS)),
        ({"type": "json_field", "path": "a"}, "[" * MAX_GRADED_CHARS),
        ({"type": "json_field", "path": "a"}, "{" * MAX_GRADED_CHARS),
        ({"type": "json_field", "path": "a"}, embedded_json_worst_case(THREAD_CHARS)),
        ({"type": "json_field", "path": "a"}, '{"a":"' + " {" * (MAX_GRADED_CHARS // 2 - 4)),
        ({"type": "numeric"}, "1" + ",234" * (MAX_GRADED_CHARS // 4 - 1)),
        ({"type": "numeric"}, "-" * MAX_GRADED_CHARS),
        ({"type": "contains"}, "ab" * (MAX_GRADED_CHARS // 2)),
        ({"type": "exact_match"}, " " * MAX_GRADED_CHARS),
        ({"type": "regex", "pattern": "^(.?){26}.{26}$"}, "a" * MAX_GRADED_CHARS),
    ],
)
async def test_long_hostile_answers_never_hold_the_event_loop(
    spec: dict[str, Any], answer: str
) -> None:
    loop = asyncio.get_running_loop()
    lags: list[float] = []

    async def tick() -> None:
        while True:
            begin = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - begin - 0.005)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    begin = loop.time()
    expected = "1" if spec["type"] == "numeric" else "a" * 1000
    result = await score(spec, answer, expected=expected)
    elapsed = loop.time() - begin
    ticker.cancel()
    assert result.error is None or "too long" in result.error
    # As above: on the loop its longest wait would be the whole grading. (The speed of
    # grading is bench material, not a test's.)
    assert max(lags) < max(0.5, elapsed / 2), (max(lags), elapsed)
    assert elapsed < 20, elapsed


def test_regex_rejects_a_pattern_over_1000_characters() -> None:
    make(type="regex", pattern="a" * 1000)
    with pytest.raises(ValidationError, match="at most 1000 characters"):
        make(type="regex", pattern="a" * 1001)


# -- numeric -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "expected", "reward"),
    [
        ("The answer is 42.", 42, 1.0),
        ("I first thought 41, but it is 42", "42", 1.0),
        ("42, or maybe 41", 42, 0.0),  # the LAST number counts
        ("So x = -3.5e2", -350, 1.0),
        ("Total: 1,234 apples", 1234, 1.0),
        ("Total: $1,234,567.50", "1,234,567.5", 1.0),
        ("pages 3-4", 4, 1.0),  # a hyphen between numbers is not a minus sign
        ("the result is \u22127", -7, 1.0),  # unicode minus
        ("0.1 + 0.2 = 0.30000000000000004", 0.3, 1.0),
        ("42.0000001", 42, 1.0),  # within the default 1e-6
        ("42.00001", 42, 0.0),
        ("\\boxed{12}", 12.0, 1.0),
    ],
)
async def test_numeric_takes_the_last_number(answer: str, expected: Any, reward: float) -> None:
    assert (await score({"type": "numeric"}, answer, expected)).reward == reward


@pytest.mark.parametrize(
    ("spec", "answer", "reward"),
    [
        ({"tolerance": 1}, "100.5", 1.0),
        ({"tolerance": 0.1}, "100.5", 0.0),
        ({"tolerance": 0.01, "relative": True}, "100.5", 1.0),  # |0.5| <= 1% of 100
        ({"tolerance": 0.001, "relative": True}, "100.5", 0.0),  # |0.5| > 0.1
        ({"tolerance": 0.01, "relative": True}, "99", 1.0),
        ({"tolerance": 0.01, "relative": True}, "98.9", 0.0),
    ],
)
async def test_numeric_tolerance(spec: dict[str, Any], answer: str, reward: float) -> None:
    assert (await score({"type": "numeric", **spec}, answer, 100)).reward == reward


def _last_number_everywhere(text: str) -> float | None:
    """The reference: the last match of a search of the whole text."""
    matches = list(graders._NUMBER.finditer(text))
    return graders._to_float(matches[-1].group()) if matches else None


@given(st.text(alphabet="0123456789,.eE+-\u2212 a)]x_", max_size=60))
@settings(max_examples=500, deadline=None)
def test_last_number_reads_the_same_number_as_a_search_of_the_whole_text(text: str) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graders, "NUMBER_WINDOW", 8)
        digits = [i for i, c in enumerate(text) if c.isdigit()]
        if digits:  # the window only falls short for a run of number characters over it
            run = text[: digits[-1] + 1]
            assume(len(run) - len(run.rstrip(graders._NUMBER_CHARS)) <= 8)
        assert graders.last_number(text) == _last_number_everywhere(text)


async def test_numeric_without_a_number_in_the_answer_is_a_wrong_answer() -> None:
    result = await score({"type": "numeric"}, "I do not know.", 42)
    assert result.reward == 0.0
    assert result.error is None
    assert result.reasoning == "no number in the answer"


@pytest.mark.parametrize("expected", ["forty-two", True, [42], {"n": 42}, "nan", float("inf")])
async def test_numeric_with_an_expected_value_that_is_not_a_number_is_an_error(
    expected: Any,
) -> None:
    result = await score({"type": "numeric"}, "42", expected)
    assert result.reward is None
    assert result.error is not None and "not a number" in result.error


def test_numeric_tolerance_must_not_be_negative() -> None:
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        make(type="numeric", tolerance=-1)


# -- json_field ----------------------------------------------------------------------------

NESTED = '{"result": {"items": [{"name": "a"}, {"name": "b", "tags": [1, 2]}], "ok": true}}'


@pytest.mark.parametrize(
    ("path", "answer", "expected", "reward"),
    [
        ("answer", '{"answer": 42}', 42, 1.0),
        ("answer", '{"answer": 42}', 42.0, 1.0),  # the same JSON number
        ("answer", '{"answer": 42}', "42", 0.0),  # a string is not a number
        ("answer", '{"answer": 1}', True, 0.0),  # true is not 1
        ("answer", '{"answer": true}', True, 1.0),
        ("answer", '{"answer": null}', 0, 0.0),
        ("result.items.1.name", NESTED, "b", 1.0),
        ("result.items.0.name", NESTED, "b", 0.0),
        ("result.items.-1.tags", NESTED, [1, 2], 1.0),
        ("result.items.1", NESTED, {"tags": [1, 2], "name": "b"}, 1.0),
        ("result.ok", NESTED, True, 1.0),
        ("0.x", '[{"x": "first"}]', "first", 1.0),  # a whole-answer JSON list
        ("m.0", '{"m": {"0": "key"}}', "key", 1.0),  # integer-looking dict keys are keys
    ],
)
async def test_json_field(path: str, answer: str, expected: Any, reward: float) -> None:
    result = await score({"type": "json_field", "path": path}, answer, expected)
    assert result.reward == reward
    assert result.error is None


@pytest.mark.parametrize(
    "answer",
    [
        'Sure! Here it is:\n```json\n{"a": {"b": [1, 2]}}\n```\nHope that helps {.',
        'I set {x} and {y: 1}; then {"a": {"b": [1, 2]}} and {"a": {"b": 0}}',
    ],
)
async def test_json_field_finds_the_first_json_object_embedded_in_text(answer: str) -> None:
    assert (await score({"type": "json_field", "path": "a.b"}, answer, [1, 2])).reward == 1.0


@pytest.mark.parametrize(
    ("path", "answer", "reasoning"),
    [
        ("a.c", '{"a": {"b": 1}}', "the answer's JSON has no `a.c`"),
        ("a.b.c", '{"a": {"b": 1}}', "the answer's JSON has no `a.b.c`"),
        ("items.5", '{"items": [1, 2]}', "the answer's JSON has no `items.5`"),
        ("items.x", '{"items": [1, 2]}', "the answer's JSON has no `items.x`"),
        ("a", "no json here { at all", "no JSON in the answer"),
        ("a", "[" * 100_000, "no JSON in the answer"),  # too deep to parse: not a crash
    ],
)
async def test_json_field_missing_is_zero(path: str, answer: str, reasoning: str) -> None:
    result = await score({"type": "json_field", "path": path}, answer, 1)
    assert result == Grade(0.0, reasoning=reasoning)


def test_json_field_rejects_empty_path_segments() -> None:
    with pytest.raises(ValidationError, match="must not be empty"):
        make(type="json_field", path="a..b")


# -- the union -----------------------------------------------------------------------------


def test_the_union_rejects_an_unknown_type_naming_the_known_ones() -> None:
    with pytest.raises(ValidationError) as info:
        make(type="llm_judge")
    message = str(info.value)
    assert "'llm_judge'" in message
    for known in ("exact_match", "contains", "regex", "numeric", "json_field", "webhook"):
        assert f"'{known}'" in message


def test_the_union_needs_a_type_and_forbids_unknown_fields() -> None:
    with pytest.raises(ValidationError, match="Unable to extract tag using discriminator 'type'"):
        make(pattern="x")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        make(type="contains", case_sensitve=True)


def test_each_grader_picks_its_model_and_documents_every_field() -> None:
    classes: list[type[BaseModel]] = [
        ExactMatchGrader,
        ContainsGrader,
        RegexGrader,
        NumericGrader,
        JsonFieldGrader,
        WebhookGrader,
    ]
    assert isinstance(make(type="regex", pattern="x"), RegexGrader)
    assert isinstance(make(type="webhook", url="http://127.0.0.1:1/g"), WebhookGrader)
    for cls in classes:
        schema = cls.model_json_schema()
        assert schema["additionalProperties"] is False
        assert schema.get("description"), cls.__name__
        for name, field in schema["properties"].items():
            assert field.get("description"), f"{cls.__name__}.{name}"


# -- webhook -------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GradingService:
    """A grading service on loopback; `seen` holds each request's headers and body."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.release = asyncio.Event()
        app = FastAPI()

        async def record(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.seen.append((dict(request.headers), body))
            return body

        @app.post("/grade")
        async def good(request: Request) -> dict[str, Any]:
            body = await record(request)
            right = body["answer"] == body["example"]["expected"]
            return {"reward": 1.0 if right else 0.25, "reasoning": f"g{body['generation']}"}

        @app.post("/int-reward")
        async def int_reward(request: Request) -> dict[str, Any]:
            await record(request)
            return {"reward": 1}

        @app.post("/crash")
        async def crash() -> Response:
            return PlainTextResponse("grader crashed: KeyError 'answer'", status_code=500)

        @app.post("/slow")
        async def slow() -> dict[str, Any]:
            await asyncio.wait_for(self.release.wait(), 5)
            return {"reward": 1.0}

        @app.post("/no-reward")
        async def no_reward() -> dict[str, Any]:
            return {"score": 1.0}

        @app.post("/nan")
        async def nan() -> Response:
            return Response('{"reward": NaN}', media_type="application/json")

        @app.post("/bool")
        async def boolean() -> dict[str, Any]:
            return {"reward": True}

        @app.post("/bad-reasoning")
        async def bad_reasoning() -> dict[str, Any]:
            return {"reward": 1.0, "reasoning": {"why": "x"}}

        @app.post("/text")
        async def text() -> Response:
            return PlainTextResponse("looks right to me")

        @app.post("/huge")
        async def huge() -> Response:
            return Response(b'{"reward": 1, "pad": "' + b"x" * 2_000_000 + b'"}')

        self.live = LiveServer(app)


@pytest.fixture
async def service() -> AsyncIterator[GradingService]:
    grading = GradingService()
    async with grading.live:
        yield grading
        grading.release.set()  # let a request the client gave up on finish


async def hook(
    url: str, *, example: dict[str, Any] | None = None, answer: str = "Paris", **spec: Any
) -> Grade:
    async with EgressClient(EgressPolicy()) as client:
        return await grade(
            make(type="webhook", url=url, **spec),
            example=example or {"id": "q1", "expected": "Paris"},
            answer=answer,
            generation=3,
            client=client,
        )


async def test_webhook_returns_the_services_reward_and_reasoning(service: GradingService) -> None:
    url = f"{service.live.url}/grade"
    example = {
        "id": "q1",
        "messages": [{"role": "user", "content": "Capital?"}],
        "expected": "Paris",
    }
    assert await hook(url, example=example, headers={"Authorization": "Bearer k"}) == Grade(
        1.0, reasoning="g3"
    )
    assert await hook(url, answer="Lyon") == Grade(0.25, reasoning="g3")
    headers, body = service.seen[0]
    assert body == {"example": example, "answer": "Paris", "generation": 3}
    assert headers["authorization"] == "Bearer k"
    assert headers["content-type"] == "application/json"
    assert await hook(f"{service.live.url}/int-reward") == Grade(1.0)


async def test_webhook_500_is_an_error_grade_with_status_and_length_not_body(
    service: GradingService,
) -> None:
    result = await hook(f"{service.live.url}/crash")
    assert result.reward is None
    assert result.error == "webhook grader answered HTTP 500 (33 bytes)"


async def test_webhook_404_is_an_error_grade(service: GradingService) -> None:
    result = await hook(f"{service.live.url}/nowhere")
    assert result.reward is None
    assert result.error is not None and "HTTP 404" in result.error


async def test_webhook_timeout_is_an_error_grade(service: GradingService) -> None:
    start = asyncio.get_running_loop().time()
    result = await hook(f"{service.live.url}/slow", timeout_s=0.2)
    elapsed = asyncio.get_running_loop().time() - start
    assert result == Grade(None, error="webhook grader timed out after 0.2 s")
    # It waited for the timeout (a lower bound no load can break), then gave up: the
    # grader's /slow holds its answer far longer than this upper bound.
    assert 0.15 < elapsed < 4.5


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/no-reward", "HTTP 200 with no numeric `reward` (13 bytes)"),
        ("/bool", "no numeric `reward`"),
        ("/nan", "a reward that is not finite"),
        ("/bad-reasoning", "a `reasoning` that is not a string or null"),
        ("/text", "HTTP 200 with a body that is not JSON (17 bytes)"),
        ("/huge", "answered more than 1048576 bytes"),
    ],
)
async def test_webhook_bad_body_is_an_error_grade(
    service: GradingService, path: str, error: str
) -> None:
    result = await hook(f"{service.live.url}{path}")
    assert result.reward is None
    assert result.error is not None and error in result.error


async def test_webhook_connection_refused_is_an_error_grade() -> None:
    result = await hook(f"http://127.0.0.1:{closed_port()}/grade")
    assert result.reward is None
    assert result.error is not None
    assert result.error.startswith("webhook grader request failed: ConnectError: ")


async def test_webhook_example_that_is_not_json_is_an_error_grade() -> None:
    result = await hook(
        f"http://127.0.0.1:{closed_port()}/grade", example={"id": 1, "x": float("nan")}
    )
    assert result.reward is None
    assert result.error is not None and "not JSON-serialisable" in result.error


def test_webhook_validates_its_fields() -> None:
    with pytest.raises(ValidationError, match="URL"):
        make(type="webhook", url="not a url")
    with pytest.raises(ValidationError, match="less than or equal to 600"):
        make(type="webhook", url="http://127.0.0.1/g", timeout_s=601)
    with pytest.raises(ValidationError, match="greater than 0"):
        make(type="webhook", url="http://127.0.0.1/g", timeout_s=0)
    with pytest.raises(ValidationError, match="not a valid header name"):
        make(type="webhook", url="http://127.0.0.1/g", headers={"bad name": "x"})
    with pytest.raises(ValidationError, match="line break"):
        make(type="webhook", url="http://127.0.0.1/g", headers={"X-Key": "a\r\nX-Evil: 1"})
    assert make(type="webhook", url="https://grader.example/g").headers == {}
