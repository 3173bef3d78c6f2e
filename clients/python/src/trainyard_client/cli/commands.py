"""The CLI's commands: each takes the output, a client and the parsed arguments, and
returns the exit code."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from trainyard_client import _calls
from trainyard_client import models as m
from trainyard_client._sync import Runs, Trainyard
from trainyard_client.cli.output import (
    EXIT_FAILED,
    EXIT_OK,
    Jobs,
    Output,
    find_job,
    job_fields,
    job_row,
    jobs_of,
    watch,
)


class UsageError(Exception):
    """Bad input from the command line or a file: exit 2."""


def _read_body(path: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise UsageError(f"{path} must hold a JSON object (a request body)")
    return body


def _kind_of(body: dict[str, Any], kind: str | None, path: str) -> str:
    if kind is not None:
        return kind
    if "recipe" in body or "schedule" in body:
        return "run"
    if "samples_per_example" in body or ("dataset" in body and "grader" in body):
        return "evaluation"
    if "examples" in body:
        return "rollout"
    if "collection" in body or "groups" in body:
        return "training"
    raise UsageError(
        f"{path}: not a training job (`collection` or `groups`), a rollout job (`examples`), "
        "an evaluation job (`samples_per_example`, or `dataset` and `grader`) or a run "
        "(`recipe`, `schedule`); say which with --kind"
    )


def _with_fields(create: Callable[..., Any], body: dict[str, Any], what: str) -> Any:
    # The body goes as the SDK method's keywords, whose names are the schema's fields.
    try:
        return create(**body)
    except TypeError as exc:
        raise UsageError(f"not a {what} body: {exc}") from exc


def cmd_submit(out: Output, client: Trainyard, args: argparse.Namespace) -> int:
    body = _read_body(args.file)
    kind = _kind_of(body, args.kind, args.file)
    key = args.idempotency_key or _calls.new_idempotency_key()
    if kind == "training":
        job = _with_fields(
            lambda **b: client.training_jobs.create(**b, idempotency_key=key),
            body,
            "training job",
        )
    elif kind == "run":
        job = _with_fields(lambda **b: client.runs.create(**b, idempotency_key=key), body, "run")
    elif kind == "evaluation":
        job = _with_fields(
            lambda **b: client.evaluations.create(**b, idempotency_key=key),
            body,
            "evaluation job",
        )
    else:
        job = _with_fields(
            lambda **b: client.rollout_jobs.create(**b, idempotency_key=key),
            body,
            "rollout job",
        )
    if out.json and not args.watch:
        out.data(job)
    elif not out.json:
        what = "run" if kind == "run" else f"{kind} job"
        out.line(f"submitted {what} {job.id} ({job.status})")
    if args.watch:
        return watch(out, client, job.id, kind, follow=not args.no_follow, timeout=args.timeout)
    return EXIT_OK


def cmd_watch(out: Output, client: Trainyard, args: argparse.Namespace) -> int:
    return watch(
        out, client, args.job_id, args.kind, follow=not args.no_follow, timeout=args.timeout
    )


def cmd_jobs(out: Output, client: Trainyard, args: argparse.Namespace) -> int:
    if args.action == "list":
        labels = dict(_label(item) for item in getattr(args, "metadata", None) or [])
        jobs = jobs_of(client, args.kind or "training")
        if isinstance(jobs, Runs):
            if labels:
                raise UsageError("runs are not filtered by --metadata")
            page: m.Page[Any] = jobs.list(
                status=args.status, model=args.model, after=args.after, limit=args.limit
            )
        else:
            page = jobs.list(
                status=args.status,
                model=args.model,
                metadata=labels,
                after=args.after,
                limit=args.limit,
            )
        if out.json:
            out.data(page)
        else:
            title = {"run": "runs"}.get(args.kind, f"{args.kind or 'training'} jobs")
            title += _more(page)
            out.table(
                ["id", "model", "status", "progress", "created"],
                [job_row(j) for j in page.data],
                title,
            )
        return EXIT_OK
    jobs, job = find_job(client, args.job_id, args.kind)
    if args.action == "cancel":
        job = jobs.cancel(args.job_id)
    if args.action in ("pause", "resume"):
        if not isinstance(jobs, Runs):
            raise UsageError(f"only a run can {args.action}; {args.job_id} is a {jobs.kind} job")
        job = jobs.pause(args.job_id) if args.action == "pause" else jobs.resume(args.job_id)
    if args.action == "metrics":
        return _run_metrics(out, client, args.job_id)
    if args.action == "events":
        events = list(_all_events(jobs, args.job_id))
        if out.json:
            out.data(events)
        else:
            rows = [[e.seq, e.type, e.created_at, json.dumps(e.data)] for e in events]
            out.table(["seq", "type", "at", "data"], rows, f"events of {args.job_id}")
        return EXIT_OK
    if out.json:
        out.data(job)
    else:
        out.fields(f"{jobs.kind} job {job.id}", job_fields(job))
    return EXIT_OK


def cmd_runs(out: Output, client: Trainyard, args: argparse.Namespace) -> int:
    args.kind = "run"
    return cmd_jobs(out, client, args)


def cmd_evaluations(out: Output, client: Trainyard, args: argparse.Namespace) -> int:
    evaluations = client.evaluations
    if args.action == "compare":
        comparison = evaluations.compare(args.a, args.b)
        if out.json:
            out.data(comparison)
            return EXIT_OK
        rows = [[d.example, d.example_id, d.a, d.b, d.delta] for d in comparison.examples]
        title = (
            f"{args.b} (step {comparison.b_step}) against {args.a} (step {comparison.a_step}): "
            f"mean delta {comparison.mean_delta}, {comparison.wins} wins, "
            f"{comparison.losses} losses, {comparison.ties} ties"
        )
        out.table(["example", "id", "a", "b", "delta"], rows, title)
        return EXIT_OK
    if args.action == "summary":
        report = evaluations.summary(args.job_id)
        if out.json:
            out.data(report)
            return EXIT_OK
        rows = [
            [e.example, e.example_id, e.mean, e.min, e.max, e.stddev, e.num_errors]
            for e in report.examples
        ]
        title = (
            f"{args.job_id} (step {report.step}): mean {report.mean_score}, pass rate "
            f"{report.pass_rate}, {report.num_errors} errors"
        )
        out.table(["example", "id", "mean", "min", "max", "stddev", "errors"], rows, title)
        return EXIT_OK
    page = evaluations.results(args.job_id, after=args.after, limit=args.limit)
    if out.json:
        out.data(page)
        return EXIT_OK
    rows = [[r.example, r.example_id, r.sample, r.score, r.error, r.answer] for r in page.data]
    title = f"answers of {args.job_id}" + _more(page)
    out.table(["example", "id", "sample", "score", "error", "answer"], rows, title)
    return EXIT_OK


def _run_metrics(out: Output, client: Trainyard, run_id: str) -> int:
    rows: list[m.RunMetric] = []
    after = 0
    while True:
        page = client.runs.metrics(run_id, after=after, limit=1000)
        rows += page.data
        if not page.has_more or not page.data:
            break
        after = page.data[-1].seq
    if out.json:
        out.data(rows)
        return EXIT_OK
    table = []
    for row in rows:
        data = row.data
        figure = data.get("reward_mean") if row.kind == "step" else data.get("score")
        table.append([row.step, row.kind, row.epoch, figure, data.get("loss")])
    out.table(["step", "kind", "epoch", "reward / score", "loss"], table, f"curve of {run_id}")
    return EXIT_OK


def cmd_datasets(out: Output, client: Trainyard, args: argparse.Namespace) -> int:
    if args.action == "list":
        page = client.datasets.list(name=args.name, after=args.after, limit=args.limit)
        if out.json:
            out.data(page)
        else:
            rows = [[d.id, d.name, d.num_examples, json.dumps(d.splits)] for d in page.data]
            out.table(["id", "name", "examples", "splits"], rows, "datasets" + _more(page))
        return EXIT_OK
    if args.action == "delete":
        client.datasets.delete(args.dataset_id)
        if not out.json:
            out.line(f"deleted {args.dataset_id}")
        return EXIT_OK
    if args.action == "upload":
        try:
            lines = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read {args.file}: {exc.strerror}") from exc
        dataset = client.datasets.upload(args.name, lines)
    else:
        dataset = client.datasets.get(args.dataset_id)
    if out.json:
        out.data(dataset)
    else:
        out.fields(f"dataset {dataset.name}", dataset.model_dump(mode="json"))
    return EXIT_OK


def _all_events(jobs: Jobs, job_id: str) -> Any:
    after = 0
    while True:
        page = jobs.list_events(job_id, after=after, limit=1000)
        yield from page.data
        if not page.has_more or not page.data:
            return
        after = page.data[-1].seq


def _label(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise UsageError(f"--metadata takes KEY=VALUE, not {item!r}")
    return key, value


def _more(page: m.Page[Any]) -> str:
    return f" (more: --after {page.next_cursor})" if page.has_more else ""


def cmd_models(out: Output, client: Trainyard, args: argparse.Namespace) -> int:
    if args.action == "list":
        page = client.models.list(after=args.after, limit=args.limit)
        if out.json:
            out.data(page)
        else:
            rows = [[x.name, x.backend, x.current_step, x.base_model] for x in page.data]
            out.table(["name", "backend", "step", "base model"], rows, "models" + _more(page))
        return EXIT_OK
    if args.action == "create":
        model = _with_fields(client.models.create, _read_body(args.file), "model")
    else:
        model = client.models.get(args.name)
    if out.json:
        out.data(model)
    else:
        out.fields(f"model {model.name}", model.model_dump(mode="json"))
    return EXIT_OK


def cmd_checkpoints(out: Output, client: Trainyard, args: argparse.Namespace) -> int:
    if args.action == "list":
        page = client.checkpoints.list(args.model, after=args.after, limit=args.limit)
        if out.json:
            out.data(page)
        else:
            rows = [
                [c.step, ", ".join(c.aliases), c.job_id, c.size_bytes, c.created_at]
                for c in page.data
            ]
            title = f"checkpoints of {args.model}" + _more(page)
            out.table(["step", "aliases", "job", "bytes", "created"], rows, title)
        return EXIT_OK
    if args.action == "export":
        suffix = "-merged.tar" if args.format == "merged" else f".{args.format}"
        target = args.output or f"{args.model}-step{args.step:04d}{suffix}"
        size = client.checkpoints.export(args.model, args.step, target, format=args.format)
        if out.json:
            out.data({"path": str(target), "bytes": size})
        else:
            out.line(f"wrote {target} ({size} bytes)")
        return EXIT_OK
    checkpoint = client.checkpoints.get(args.model, args.step)
    if out.json:
        out.data(checkpoint)
    else:
        out.fields(f"{args.model}@{checkpoint.step}", checkpoint.model_dump(mode="json"))
    return EXIT_OK


def cmd_backends(out: Output, client: Trainyard, args: argparse.Namespace) -> int:
    backends = client.backends.list()
    if out.json:
        out.data(backends)
    else:
        out.table(["name", "description"], [[b.name, b.description] for b in backends], "backends")
    return EXIT_OK


def cmd_health(out: Output, client: Trainyard, args: argparse.Namespace) -> int:
    ready = client.ready()
    if out.json:
        out.data(ready)
    else:
        rows = [[name, "ok" if c.ok else "FAILING", c.detail] for name, c in ready.checks.items()]
        out.table(["check", "", "detail"], rows, f"{client.url}: {ready.status}")
    return EXIT_OK if ready.status == "ready" else EXIT_FAILED


def _when(value: str | None, flag: str) -> datetime | None:
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError as exc:
        raise UsageError(f"{flag} takes an RFC 3339 time, not {value!r}") from exc
    if when.tzinfo is None:
        raise UsageError(f"{flag}: give the time's offset (`Z` or `+02:00`)")
    return when


def cmd_projects(out: Output, client: Trainyard, args: argparse.Namespace) -> int:
    result: Any
    if args.action == "list":
        page = client.projects.list(after=args.after, limit=args.limit)
        if out.json:
            out.data(page)
        else:
            rows = [[p.id, p.name, p.created_at] for p in page.data]
            out.table(["id", "name", "created"], rows, "projects" + _more(page))
        return EXIT_OK
    if args.action == "keys":
        keys = client.projects.list_keys(args.project_id, after=args.after, limit=args.limit)
        if out.json:
            out.data(keys)
        else:
            rows = [
                [k.id, k.name, ",".join(k.scopes), k.prefix, k.expires_at, k.revoked_at]
                for k in keys.data
            ]
            header = ["id", "name", "scopes", "prefix", "expires", "revoked"]
            out.table(header, rows, "keys" + _more(keys))
        return EXIT_OK
    if args.action == "revoke-key":
        client.projects.revoke_key(args.project_id, args.key_id)
        if not out.json:
            out.line(f"revoked {args.key_id}")
        return EXIT_OK
    if args.action == "create":
        result = client.projects.create(name=args.name)
    elif args.action == "create-key":
        result = client.projects.create_key(
            args.project_id,
            name=args.name,
            scopes=args.scopes,
            expires_at=_when(args.expires_at, "--expires-at"),
        )
    else:
        result = client.projects.get(args.project_id)
    if out.json:
        out.data(result)
    else:
        out.fields(f"{args.action} {result.id}", result.model_dump(mode="json"))
    return EXIT_OK


def cmd_audit(out: Output, client: Trainyard, args: argparse.Namespace) -> int:
    page = client.audit_events.list(
        after=args.after,
        limit=args.limit,
        key_id=args.key_id,
        project_id=args.project_id,
        route=args.route,
        since=_when(args.since, "--since"),
        until=_when(args.until, "--until"),
    )
    if out.json:
        out.data(page)
    else:
        rows = [
            [e.at, e.method, e.route, e.status, e.key_id or "-", e.resource_id or "-"]
            for e in page.data
        ]
        out.table(
            ["at", "method", "route", "status", "key", "resource"], rows, "audit" + _more(page)
        )
    return EXIT_OK
