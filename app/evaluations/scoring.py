"""Scoring answers: the one code a run's validation (a rollout that trains nothing) and an
evaluation job score with. An answer is read from the endpoint's choice, scored by the
grader (`app.rollouts.graders.grade`), and a set of scores is summed up the same way for
both: the mean and the population standard deviation, over the answers that got a score.

A unit of its own (tests/test_architecture.py): rollouts import it, and it imports only the
graders, so the rollouts and evaluations packages never import each other around a loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.egress import EgressClient
from app.rollouts.graders import Grade, Grader, grade


class Unscorable(Exception):
    """An answer that cannot be scored; the message is safe to record (no remote text)."""


def answer_of(choice: Any) -> str:
    """The text of one choice of an OpenAI chat answer ("" for none); `Unscorable` if the
    choice is not an answer."""
    if not isinstance(choice, dict):
        raise Unscorable("the endpoint answered a choice that is not an object")
    message = choice.get("message")
    answer = (message.get("content") if isinstance(message, dict) else None) or ""
    if not isinstance(answer, str):
        raise Unscorable("the endpoint answered a message whose content is not text")
    return answer


async def score(
    grader: Grader,
    *,
    example: dict[str, Any],
    answer: str,
    generation: int,
    client: EgressClient,
) -> Grade:
    """`answer`'s score for `example` (its JSON, as `Example.model_dump(mode="json")`), or
    the grader's error. Never raises for the grader's own problems."""
    return await grade(grader, example=example, answer=answer, generation=generation, client=client)


@dataclass(frozen=True)
class Stats:
    """Scores summed up: how many, their mean, population standard deviation, min and max
    (None when there are none)."""

    count: int
    mean: float | None
    std: float | None
    min: float | None
    max: float | None


def stats(scores: Sequence[float]) -> Stats:
    if not scores:
        return Stats(0, None, None, None, None)
    mean = sum(scores) / len(scores)
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
    return Stats(len(scores), mean, std, min(scores), max(scores))


def passes(value: float) -> bool:
    """Whether a score passes: above 0. No grader has a threshold of its own; the local
    graders score 0 or 1, so this is "was right" for them."""
    return value > 0
