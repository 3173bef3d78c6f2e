"""What runs used: their children's usage summed (a run itself samples and trains
nothing), and its estimated cost by the model's prices."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Executable, or_, select

from app.jobs.usage import job_usage, summed
from app.models import JobRow
from app.runs.schedule import run_of
from app.schemas.usage import JobUsage

_CHILD_COLUMNS = (
    JobRow.id,
    JobRow.kind,
    JobRow.prompt_tokens,
    JobRow.completion_tokens,
    JobRow.trained_tokens,
    JobRow.started_at,
    JobRow.finished_at,
    JobRow.attempts,
    JobRow.returned_at_attempt,
    JobRow.earlier_seconds,
)


def children_query(runs: Sequence[JobRow]) -> Executable:
    """The children of `runs`: each made after its run, on its model (the index on
    (model_name, created_at)), with an id under the run's (`schedule.child_id`)."""
    each = [
        (JobRow.model_name == run.model_name)
        & (JobRow.created_at >= run.created_at)
        & JobRow.id.startswith(f"job_{run.id.removeprefix('run_')}-", autoescape=True)
        for run in runs
    ]
    return select(*_CHILD_COLUMNS).where(or_(*each))


def usage_by_run(runs: Sequence[JobRow], children: Sequence[Any]) -> dict[str, JobUsage]:
    """Each run's usage from the rows `children_query` read."""
    parts: dict[str, list[JobUsage]] = defaultdict(list)
    for row in children:
        run_id = run_of(row.id)
        if run_id is None:
            continue
        parts[run_id].append(job_usage(row))
    return {run.id: summed(parts.get(run.id, [])) for run in runs}
