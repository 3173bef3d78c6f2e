"""The graders' wire models: what a rollout, a run or a webhook grader's request says.

Each grader is a strict pydantic model (a member of the `Grader` union, told apart by
`type`); `app.rollouts.graders` scores answers with them. A regex is checked here, once,
when the request is read: RE2 compiles it within a memory and a program-size bound.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

import re2
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, HttpUrl, field_validator

from app.egress import check_headers

# Memory one compiled regex may use (RE2's own bound; a pattern that needs more is refused).
REGEX_MAX_MEM = 8 << 20
# RE2 is linear in the answer, times up to its program's size when its DFA gives up: the
# largest program accepted, and the most (characters x instructions) one answer may cost
# (about 1.5 s of a thread at worst; most patterns run far below it).
MAX_REGEX_PROGRAM = 2000
MAX_REGEX_WORK = 500_000_000


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
        description="A regular expression in RE2 syntax (https://github.com/google/re2/wiki/"
        "Syntax), searched for anywhere in the answer. RE2 runs in time linear in the "
        "answer; it has no backreferences or lookaround, and `\\d`, `\\w`, `\\b` are "
        "ASCII-only. A pattern RE2 cannot compile, or that compiles to more than 2000 RE2 "
        "instructions, is refused.",
        examples=[r"\bParis\b"],
    )
    ignore_case: bool = Field(default=False, description="Match case-insensitively.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        for ignore_case in (False, True):
            size = compile_regex(pattern, ignore_case).programsize
            if size > MAX_REGEX_PROGRAM:
                raise ValueError(
                    f"the regular expression compiles to {size} RE2 instructions; at most "
                    f"{MAX_REGEX_PROGRAM} are accepted"
                )
        return pattern


@functools.lru_cache(maxsize=256)
def compile_regex(pattern: str, ignore_case: bool) -> Any:
    """`pattern` compiled by RE2 (cached); ValueError with RE2's reason if it cannot be."""
    options = re2.Options()
    options.log_errors = False
    options.case_sensitive = not ignore_case
    options.max_mem = REGEX_MAX_MEM
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else "no detail"
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        if len(reason) > 200:
            reason = reason[:197] + "..."
        raise ValueError(f"invalid regular expression for RE2: {reason}") from None


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


def no_credentials(url: HttpUrl) -> HttpUrl:
    """Refuses a URL with user info (credentials go in `headers`, which no route shows),
    and one naming port 0 (nothing listens there; a send could only fail)."""
    if url.username is not None or url.password is not None:
        raise ValueError("the URL must not hold credentials; send them in `headers`")
    if url.port == 0:
        raise ValueError("port 0 is no port a request can be sent to")
    return url


def _sendable(headers: dict[str, str]) -> dict[str, str]:
    check_headers(headers)
    return headers


# What every outbound call a job names takes (webhook graders, agents, webhook endpoints):
# a URL without credentials or port 0, and headers a call can send.
OutboundUrl = Annotated[HttpUrl, AfterValidator(no_credentials)]
OutboundHeaders = Annotated[dict[str, str], AfterValidator(_sendable)]


class WebhookGrader(_Grader):
    """Your service grades: Trainyard POSTs `{example, answer, generation}` as JSON and
    expects a 2xx JSON answer `{"reward": number, "reasoning": string | null}`."""

    type: Literal["webhook"] = Field(description="Grader kind.")
    url: OutboundUrl = Field(
        description="Where to POST each answer. Subject to the egress policy "
        "(`TRAINYARD_EGRESS_ALLOW`, `TRAINYARD_EGRESS_DENY`); redirects are not followed."
    )
    timeout_s: float = Field(
        default=30, gt=0, le=600, description="Seconds one grading request may take in all."
    )
    headers: OutboundHeaders = Field(
        default_factory=dict,
        description="Extra request headers, e.g. `Authorization`. Write-only: sent with "
        "each request, never shown by any route.",
    )


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
