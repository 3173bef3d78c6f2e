"""An evaluation's stored answers (`evaluation_results`): written in batches by its runner,
read a page at a time, summed up in the database (an example's mean, min, max and
population standard deviation; the job's mean and pass rate), and compared between two
jobs that evaluated the same examples.

A row's key is its place (job, example index, sample index) and a write skips a row
already there: a job retried after its worker died writes again what it had written
without adding a row, and its runner skips the examples already complete.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Float, and_, case, cast, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import Reader, utcnow, write_connection
from app.errors import ConflictError, InvalidInputError, field_errors
from app.jobs.lifecycle import JobKind, JobStatus
from app.jobs.service import JobView, read_job
from app.models import EvaluationResultRow
from app.schemas.evaluations import (
    EvaluationComparison,
    EvaluationReport,
    EvaluationResult,
    ExampleDelta,
    ExampleScores,
)

R = EvaluationResultRow
BATCH = 64  # answers written in one statement
MAX_ERROR_CHARS = 500


async def write(engine: AsyncEngine, job_id: str, rows: Sequence[dict[str, Any]]) -> None:
    """Store answers (`example`, `sample`, `example_id`, `answer`, `score`, `error`), each
    written once: one already stored is left as it is."""
    if not rows:
        return
    now = utcnow()
    values = [{"job_id": job_id, "created_at": now, **row} for row in rows]
    insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
    statement = insert(EvaluationResultRow).values(values).on_conflict_do_nothing()
    async with write_connection(engine) as conn:
        await conn.execute(statement)


async def complete_examples(engine: AsyncEngine, job_id: str, samples: int) -> set[int]:
    """The examples whose every sample is stored (a retried job skips them)."""
    query = (
        select(R.example)
        .where(R.job_id == job_id)
        .group_by(R.example)
        .having(func.count() >= samples)
    )
    async with engine.connect() as conn:
        return set((await conn.scalars(query)).all())


def cursor_of(example: int, sample: int) -> str:
    return f"{example}.{sample}"


def _after(cursor: str | None) -> tuple[int, int] | None:
    if cursor is None:
        return None
    if not re.fullmatch(r"[0-9]{1,9}\.[0-9]{1,9}", cursor):  # each within 32 bits
        raise InvalidInputError(
            "bad cursor",
            errors=field_errors(
                [
                    {
                        "loc": ("query", "after"),
                        "msg": "give the `next_cursor` of the previous page",
                        "type": "value_error",
                    }
                ]
            ),
        )
    example, _, sample = cursor.partition(".")
    return int(example), int(sample)


async def page(
    reader: Reader, job_id: str, *, after: str | None, limit: int
) -> tuple[list[EvaluationResult], bool]:
    """Answers in example then sample order, after the cursor."""
    start = _after(after)
    query = (
        select(R.example, R.example_id, R.sample, R.answer, R.score, R.error, R.created_at)
        .where(R.job_id == job_id)
        .order_by(R.example, R.sample)
        .limit(limit + 1)
    )
    if start is not None:
        example, sample = start
        query = query.where(or_(R.example > example, and_(R.example == example, R.sample > sample)))
    rows = await reader.rows(query)
    results = [
        EvaluationResult(
            example=r[0],
            example_id=r[1],
            sample=r[2],
            answer=r[3],
            score=r[4],
            error=r[5],
            created_at=r[6],
        )
        for r in rows[:limit]
    ]
    return results, len(rows) > limit


def _per_example(job_id: str) -> Any:
    score = cast(R.score, Float)
    return (
        select(
            R.example,
            func.min(R.example_id),
            func.count(R.score),
            func.count(R.error),
            func.avg(score),
            func.min(score),
            func.max(score),
            func.avg(score * score),
        )
        .where(R.job_id == job_id)
        .group_by(R.example)
        .order_by(R.example)
    )


def _example_scores(row: Any) -> ExampleScores:
    example, example_id, scored, errors, mean, low, high, mean_square = row
    stddev = None
    if mean is not None:  # population: sqrt(E[x²] - E[x]²), never below 0 from rounding
        stddev = max(0.0, float(mean_square) - float(mean) ** 2) ** 0.5
    return ExampleScores(
        example=example,
        example_id=example_id,
        num_scored=scored,
        num_errors=errors,
        mean=None if mean is None else float(mean),
        min=None if low is None else float(low),
        max=None if high is None else float(high),
        stddev=stddev,
    )


def _overall(job_id: str) -> Any:
    score = cast(R.score, Float)
    return select(
        func.count(R.score),
        func.count(R.error),
        func.avg(score),
        func.sum(case((R.score > 0, 1), else_=0)),
    ).where(R.job_id == job_id)


def _totals(row: Any) -> dict[str, Any]:
    scored, errors, mean, passed = row
    return {
        "num_scored": scored,
        "num_errors": errors,
        "mean_score": None if mean is None else float(mean),
        "pass_rate": (passed or 0) / scored if scored else None,
    }


async def totals(engine: AsyncEngine, job_id: str) -> dict[str, Any]:
    """The job's answers summed up (what its summary shows once it succeeded)."""
    async with engine.connect() as conn:
        return _totals((await conn.execute(_overall(job_id))).one())


async def report(reader: Reader, job_id: str, project_id: str | None = None) -> EvaluationReport:
    job = await read_job(reader, job_id, kind=JobKind.evaluation, project_id=project_id)
    overall = _totals(await reader.row(_overall(job_id)))
    examples = [_example_scores(r) for r in await reader.rows(_per_example(job_id))]
    return EvaluationReport(
        job_id=job.id,
        step=job.summary["step"],
        num_examples=job.summary["num_examples"],
        examples=examples,
        **overall,
    )


async def compare(
    reader: Reader, a: str, b: str, project_id: str | None = None
) -> EvaluationComparison:
    """`b` against `a`: each example's mean score, their delta, wins and losses. 404 for an
    unknown job (or another project's, with `project_id`); 409 unless both succeeded on the
    same examples."""
    job_a, job_b = [
        await read_job(
            reader,
            ref,
            kind=JobKind.evaluation,
            project_id=project_id,
            param=param,
            location="query",
        )
        for ref, param in ((a, "a"), (b, "b"))
    ]
    _comparable(job_a, job_b)
    means_a = {r[0]: _example_scores(r) for r in await reader.rows(_per_example(a))}
    means_b = {r[0]: _example_scores(r) for r in await reader.rows(_per_example(b))}
    deltas: list[ExampleDelta] = []
    wins = losses = ties = 0
    for example in sorted(means_a.keys() | means_b.keys()):
        sa, sb = means_a.get(example), means_b.get(example)
        score_a = sa.mean if sa else None
        score_b = sb.mean if sb else None
        delta = None if score_a is None or score_b is None else score_b - score_a
        if delta is not None:
            wins, losses, ties = wins + (delta > 0), losses + (delta < 0), ties + (delta == 0)
        either = sa or sb
        example_id = either.example_id if either is not None else str(example)
        deltas.append(
            ExampleDelta(example=example, example_id=example_id, a=score_a, b=score_b, delta=delta)
        )
    known = [d.delta for d in deltas if d.delta is not None]
    return EvaluationComparison(
        a=a,
        b=b,
        a_step=job_a.summary["step"],
        b_step=job_b.summary["step"],
        num_examples=job_a.summary["num_examples"],
        mean_delta=sum(known) / len(known) if known else None,
        wins=wins,
        losses=losses,
        ties=ties,
        examples=deltas,
    )


def _comparable(a: JobView, b: JobView) -> None:
    for job in (a, b):
        if job.status != JobStatus.succeeded.value:
            raise ConflictError(
                f"evaluation job {job.id} is {job.status}; jobs are compared once they "
                "have succeeded"
            )
    if a.summary.get("examples_sha256") != b.summary.get("examples_sha256"):
        raise ConflictError(
            f"evaluation jobs {a.id} and {b.id} did not evaluate the same examples "
            "(another dataset, split or inline content); compare jobs of the same examples"
        )
