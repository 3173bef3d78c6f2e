"""What the CLI prints: JSON for scripts, rich tables and a live progress bar for people."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as Bar
from rich.table import Table
from rich.text import Text

from trainyard_client import models as m
from trainyard_client._sync import EvaluationJobs, RolloutJobs, Runs, TrainingJobs, Trainyard
from trainyard_client.errors import NotFoundError
from trainyard_client.progress import Progress

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CANCELLED = 3
EXIT_REFUSED = 4
EXIT_UNREACHABLE = 5
EXIT_TIMEOUT = 6
EXIT_INTERRUPTED = 130

EXIT_BY_STATUS: dict[str, int] = {
    m.JobStatus.succeeded: EXIT_OK,
    m.JobStatus.failed: EXIT_FAILED,
    m.JobStatus.cancelled: EXIT_CANCELLED,
}

NONE = "-"  # a value not reported yet

Jobs = TrainingJobs | RolloutJobs | EvaluationJobs | Runs
AnyJob = m.TrainingJob | m.RolloutJob | m.EvaluationJob | m.Run


class Output:
    """Where results go: JSON for scripts (`--json`), rich tables for people."""

    def __init__(self, as_json: bool) -> None:
        self.json = as_json
        self.console = Console(highlight=False)
        self.errors = Console(stderr=True, highlight=False)

    def data(self, value: Any) -> None:
        print(json.dumps(_plain(value), indent=2))

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str) -> None:
        table = Table(*columns, title=Text(title), box=box.SIMPLE_HEAD, title_justify="left")
        for row in rows:
            table.add_row(*(Text("" if cell is None else str(cell)) for cell in row))
        self.console.print(table)

    def line(self, text: str) -> None:
        """Plain text (no rich markup: ids and messages may hold brackets)."""
        self.console.print(text, markup=False, soft_wrap=True)

    def error(self, text: str) -> None:
        self.errors.print(text, markup=False, soft_wrap=True)

    def fields(self, title: str, values: dict[str, Any]) -> None:
        table = Table(show_header=False, box=box.SIMPLE, title=Text(title), title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for key, value in values.items():
            if isinstance(value, dict | list):
                value = json.dumps(_plain(value))
            table.add_row(Text(key), Text("" if value is None else str(value)))
        self.console.print(table)


def _plain(value: Any) -> Any:
    if isinstance(value, m.BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _number(value: float | None) -> str:
    return NONE if value is None else f"{value:.4g}"


def jobs_of(client: Trainyard, kind: str) -> Jobs:
    if kind == "training":
        return client.training_jobs
    if kind == "evaluation":
        return client.evaluations
    return client.rollout_jobs if kind == "rollout" else client.runs


def find_job(client: Trainyard, job_id: str, kind: str | None) -> tuple[Jobs, Any]:
    """The job and its resource: `kind`'s; else a run for a `run_` id; else a training job,
    else a rollout job, else an evaluation job."""
    if kind is None and job_id.startswith("run_"):
        kind = "run"
    if kind is not None:
        jobs = jobs_of(client, kind)
        return jobs, jobs.get(job_id)
    try:
        return client.training_jobs, client.training_jobs.get(job_id)
    except NotFoundError as not_training:
        try:
            return client.rollout_jobs, client.rollout_jobs.get(job_id)
        except NotFoundError:
            try:
                return client.evaluations, client.evaluations.get(job_id)
            except NotFoundError:
                raise not_training from None


def job_row(job: AnyJob) -> list[Any]:
    total: int | None
    if isinstance(job, m.Run):
        step, total = job.progress.step, job.progress.total_steps
    else:
        step, total = job.progress.step, job.progress.total
    counter = f"{step}/{'?' if total is None else total}"
    return [job.id, job.model, job.status, counter, job.created_at]


def job_fields(job: AnyJob) -> dict[str, Any]:
    values = job.model_dump(mode="json")
    kinds = {m.TrainingJob: "training", m.RolloutJob: "rollout", m.EvaluationJob: "evaluation"}
    values["kind"] = kinds.get(type(job), "run")
    return values


class Watcher:
    """Shows a job's progress as its events arrive: a live bar on a terminal, a line per
    change elsewhere, a JSON object per event with `--json`."""

    def __init__(self, out: Output, job_id: str, kind: str, reward: float | None) -> None:
        self.out, self.job_id, self.kind = out, job_id, kind
        self.reward = reward  # until an event reports one
        self.unit = "sample" if kind in ("rollout", "evaluation") else "step"
        self.bar: Bar | None = None
        self.task: Any = None
        self.last_line = ""

    def __enter__(self) -> Watcher:
        if not self.out.json and self.out.console.is_terminal:
            self.bar = Bar(
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.fields[counter]}"),
                TextColumn("reward {task.fields[reward]}"),
                TextColumn("loss {task.fields[loss]}"),
                TimeElapsedColumn(),
                console=self.out.console,
                refresh_per_second=10,
            )
            self.bar.__enter__()
            self.task = self.bar.add_task(
                self._describe("waiting"), total=None, counter="", reward=NONE, loss=NONE
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)

    def _describe(self, status: str) -> str:
        return f"{self.kind} {self.job_id} [bold]{status}[/]"

    def __call__(self, progress: Progress) -> None:
        reward = progress.reward if progress.reward is not None else self.reward
        total = "?" if progress.total is None else str(progress.total)
        counter = f"{self.unit} {progress.step}/{total}"
        if self.out.json:
            line = {
                "job_id": progress.job_id,
                "kind": self.kind,
                "event": progress.event.type,
                "seq": progress.event.seq,
                "status": progress.status,
                "step": progress.step,
                "total": progress.total,
                "reward": reward,
                "loss": progress.loss,
            }
            print(json.dumps(line), flush=True)
        elif self.bar is not None:
            self.bar.update(
                self.task,
                description=self._describe(progress.status),
                completed=progress.step,
                total=progress.total,
                counter=counter,
                reward=_number(reward),
                loss=_number(progress.loss),
            )
            self.bar.refresh()
        else:
            text = (
                f"{self.kind} {self.job_id} {progress.status} {counter} "
                f"reward {_number(reward)} loss {_number(progress.loss)}"
            )
            if text != self.last_line:
                self.out.line(text)
                self.last_line = text


def watch(
    out: Output,
    client: Trainyard,
    job_id: str,
    kind: str | None,
    *,
    follow: bool,
    timeout: float | None,
) -> int:
    """Watch a job to its end (and a rollout's training job after it, with `follow`);
    the exit code of how the last one ended."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        jobs, job = find_job(client, job_id, kind)
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        with Watcher(out, job_id, jobs.kind, _data_reward(client, job)) as show:
            job = jobs.wait(job_id, timeout=left, on_progress=show)
        _report(out, job)
        if not (follow and isinstance(job, m.RolloutJob) and job.training_job_id):
            return EXIT_BY_STATUS.get(job.status, EXIT_FAILED)
        job_id, kind = job.training_job_id, "training"


MAX_TRAJECTORIES_READ = 2000


def _data_reward(client: Trainyard, job: AnyJob) -> float | None:
    """A training job's reward: the mean reward of the trajectories it trains on (read
    once, for a job of up to MAX_TRAJECTORIES_READ; trainers seldom report one)."""
    if not isinstance(job, m.TrainingJob) or not isinstance(job.summary, m.TrajectorySummary):
        return None  # not a job of rewarded trajectories (an SFT or DPO job)
    if job.summary.num_trajectories > MAX_TRAJECTORIES_READ:
        return None
    groups = client.training_jobs.trajectories(job.id).get("groups") or []
    rewards = [
        t["reward"]
        for group in groups
        for t in group.get("trajectories", [])
        if isinstance(t.get("reward"), int | float)
    ]
    return sum(rewards) / len(rewards) if rewards else None


def _report(out: Output, job: AnyJob) -> None:
    if out.json:
        return
    text = f"{job.id} {job.status}"
    if isinstance(job, m.TrainingJob) and job.result is not None:
        text += f": model step {job.result.start_step} → {job.result.final_step}"
        if job.result.trained is False and job.result.reason:
            text += f" (nothing learned: {job.result.reason})"
    if isinstance(job, m.RolloutJob):
        text += f": {job.summary.num_graded}/{job.summary.num_samples} graded"
        text += f", mean reward {_number(job.summary.mean_reward)}"
        if job.training_job_id:
            text += f"; training job {job.training_job_id}"
    if isinstance(job, m.Run):
        text += f": step {job.progress.step}/{job.progress.total_steps}"
        if job.stop_reason:
            text += f" ({job.stop_reason})"
        if job.best_checkpoint is not None:
            best = job.best_checkpoint
            text += f"; best step {best.step} (score {_number(best.score)})"
    if job.error is not None:
        text += f": {job.error.type}: {job.error.message}"
    out.line(text)
