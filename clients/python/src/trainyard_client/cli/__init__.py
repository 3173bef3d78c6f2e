"""`trainyard-client`: submit, watch, list and inspect against a Trainyard server.

Exit codes (`watch`, and `submit --watch`, say how the job ended):

  0  done: the command worked; the watched job succeeded
  1  the watched job failed (`health`: the server is not ready)
  2  usage: bad arguments, or a file that is not a request body
  3  the watched job was cancelled
  4  the server refused the request (4xx problem: not found, invalid, unauthorized)
  5  the server could not be reached, or kept failing (5xx), after retries
  6  `--timeout` passed before the watched job ended (the job goes on)
  130 interrupted (Ctrl-C); a watched job goes on
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from trainyard_client import models as m
from trainyard_client._base import DEFAULT_URL
from trainyard_client._retry import RetryPolicy
from trainyard_client._sync import Trainyard
from trainyard_client.errors import (
    APIError,
    ServerError,
    TrainyardConnectionError,
    WaitTimeoutError,
)

try:
    from trainyard_client.cli import commands as c
    from trainyard_client.cli.output import (
        EXIT_CANCELLED,
        EXIT_FAILED,
        EXIT_INTERRUPTED,
        EXIT_OK,
        EXIT_REFUSED,
        EXIT_TIMEOUT,
        EXIT_UNREACHABLE,
        EXIT_USAGE,
        Output,
    )
except ImportError as missing:  # pragma: no cover - the `cli` extra is not installed
    if missing.name != "rich":
        raise
    print("the CLI needs rich: pip install 'trainyard-client[cli]'", file=sys.stderr)
    sys.exit(2)

KINDS = ["training", "rollout", "evaluation", "run"]

__all__ = [
    "EXIT_CANCELLED",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_TIMEOUT",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "build_parser",
    "main",
]


# --------------------------------------------------------------------------- parsing


def _common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # On the top parser with defaults; repeated on each command (so they may come after
    # it) without, so a command's copy never hides the top one's value.
    default: Any = (lambda value: value) if top else (lambda value: argparse.SUPPRESS)
    parser.add_argument(
        "--url",
        default=default(os.environ.get("TRAINYARD_URL") or DEFAULT_URL),
        help=f"server URL (env TRAINYARD_URL; default {DEFAULT_URL})",
    )
    parser.add_argument(
        "--api-key",
        default=default(os.environ.get("TRAINYARD_API_KEY")),
        help="API key, sent as a bearer token (env TRAINYARD_API_KEY)",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON, for scripts"
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=default(RetryPolicy.max_retries),
        # Not `%(default)s`: on a command's copy the default is SUPPRESS, which argparse
        # leaves out of what it formats help with (every command's --help raised KeyError).
        help=f"resend a failed request up to this many times (default {RetryPolicy.max_retries})",
    )


def _watch_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout", type=float, help="give up watching after this many seconds (exit 6)"
    )
    parser.add_argument(
        "--no-follow",
        action="store_true",
        help="for a rollout job that trains: stop at the rollout, not its training job",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainyard-client",
        description="Submit, watch, list and inspect Trainyard jobs, runs, models, checkpoints "
        "and datasets.",
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        _common(sub, top=False)
        return sub

    def kind_option(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--kind", choices=KINDS, help="job kind (default: found by its id)")

    submit = command(
        "submit", "submit a training, rollout or evaluation job, or a run, from a JSON file"
    )
    submit.add_argument("file", help="the request body (`-`: stdin)")
    kind_option(submit)
    submit.add_argument(
        "--idempotency-key",
        help="a key for this submission (default: a new one, reused on retries)",
    )
    submit.add_argument("--watch", action="store_true", help="then watch it (exit codes below)")
    _watch_options(submit)
    submit.set_defaults(run=c.cmd_submit)

    watch_ = command("watch", "follow a job or run live until it ends; the exit code says how")
    watch_.add_argument("job_id")
    kind_option(watch_)
    _watch_options(watch_)
    watch_.set_defaults(run=c.cmd_watch)

    jobs = command("jobs", "list, show, cancel jobs, or list a job's events")
    jobs_actions = jobs.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = jobs_actions.add_parser("list", help="newest first")
    _common(listing, top=False)
    listing.add_argument("--kind", choices=KINDS, help="default: training")
    listing.add_argument("--status", choices=[s.value for s in m.JobStatus])
    listing.add_argument("--model")
    listing.add_argument("--metadata", action="append", metavar="KEY=VALUE")
    listing.add_argument("--after", help="cursor of the next page")
    listing.add_argument("--limit", type=int, default=20)
    for action, help in (("get", "show a job"), ("cancel", "cancel a job"), ("events", "")):
        sub = jobs_actions.add_parser(action, help=help or "a job's event log")
        _common(sub, top=False)
        sub.add_argument("job_id")
        kind_option(sub)
    jobs.set_defaults(run=c.cmd_jobs)

    runs = command("runs", "list, show, pause, resume or cancel runs, or show a run's curve")
    runs_actions = runs.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = runs_actions.add_parser("list", help="newest first")
    _common(listing, top=False)
    listing.add_argument("--status", choices=[s.value for s in m.JobStatus])
    listing.add_argument("--model")
    listing.add_argument("--after", help="cursor of the next page")
    listing.add_argument("--limit", type=int, default=20)
    for action, help in (
        ("get", "show a run"),
        ("metrics", "the run's curve: a row per step and per validation"),
        ("pause", "let the child job under way finish, start no other"),
        ("resume", "resume a paused run"),
        ("cancel", "cancel a run and its child job under way"),
        ("events", "a run's event log"),
    ):
        sub = runs_actions.add_parser(action, help=help)
        _common(sub, top=False)
        sub.add_argument("job_id", metavar="run_id")
    runs.set_defaults(run=c.cmd_runs)

    evaluations = command(
        "evaluations", "an evaluation's answers or summary, or two evaluations compared"
    )
    actions = evaluations.add_subparsers(dest="action", required=True, metavar="ACTION")
    results = actions.add_parser("results", help="the answers, with their scores or errors")
    _common(results, top=False)
    results.add_argument("job_id")
    results.add_argument("--after", help="cursor of the next page")
    results.add_argument("--limit", type=int, default=100)
    summary = actions.add_parser("summary", help="scores summed up, overall and per example")
    _common(summary, top=False)
    summary.add_argument("job_id")
    compare = actions.add_parser("compare", help="B against A, example by example")
    _common(compare, top=False)
    compare.add_argument("a")
    compare.add_argument("b")
    evaluations.set_defaults(run=c.cmd_evaluations)

    models = command("models", "list, show or register models")
    models_actions = models.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = models_actions.add_parser("list")
    _common(listing, top=False)
    listing.add_argument("--after")
    listing.add_argument("--limit", type=int, default=20)
    get = models_actions.add_parser("get")
    _common(get, top=False)
    get.add_argument("name")
    create = models_actions.add_parser("create", help="register a model from a JSON file")
    _common(create, top=False)
    create.add_argument("file")
    models.set_defaults(run=c.cmd_models)

    checkpoints = command("checkpoints", "list, show or export a model's checkpoints")
    actions = checkpoints.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="newest first")
    _common(listing, top=False)
    listing.add_argument("model")
    listing.add_argument("--after")
    listing.add_argument("--limit", type=int, default=20)
    get = actions.add_parser("get")
    _common(get, top=False)
    get.add_argument("model")
    get.add_argument("step", type=int)
    export = actions.add_parser(
        "export", help="download the step's LoRA adapter, or the base model with it merged in"
    )
    _common(export, top=False)
    export.add_argument("model")
    export.add_argument("step", type=int)
    export.add_argument(
        "--format",
        choices=["tar.gz", "zip", "merged"],
        default="tar.gz",
        help="tar.gz or zip: the adapter; merged: the merged model's directory in a tar",
    )
    export.add_argument(
        "-o",
        "--output",
        help="file to write (default: MODEL-stepNNNN.FORMAT, MODEL-stepNNNN-merged.tar)",
    )
    checkpoints.set_defaults(run=c.cmd_checkpoints)

    datasets = command("datasets", "upload, list, show or delete datasets (JSON Lines)")
    actions = datasets.add_subparsers(dest="action", required=True, metavar="ACTION")
    upload = actions.add_parser("upload", help="one example a line, each with its split")
    _common(upload, top=False)
    upload.add_argument("file", help="a JSON Lines file (`-`: stdin)")
    upload.add_argument("--name", required=True)
    listing = actions.add_parser("list", help="newest first")
    _common(listing, top=False)
    listing.add_argument("--name")
    listing.add_argument("--after")
    listing.add_argument("--limit", type=int, default=20)
    for action in ("get", "delete"):
        sub = actions.add_parser(action)
        _common(sub, top=False)
        sub.add_argument("dataset_id")
    datasets.set_defaults(run=c.cmd_datasets)

    projects = command("projects", "create, list or show projects; make, list or revoke keys")
    actions = projects.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create")
    _common(create, top=False)
    create.add_argument("name")
    listing = actions.add_parser("list")
    _common(listing, top=False)
    listing.add_argument("--after")
    listing.add_argument("--limit", type=int, default=20)
    get = actions.add_parser("get")
    _common(get, top=False)
    get.add_argument("project_id")
    key = actions.add_parser("create-key", help="the secret is printed once, never again")
    _common(key, top=False)
    key.add_argument("project_id")
    key.add_argument("--name", required=True)
    key.add_argument(
        "--scope",
        dest="scopes",
        action="append",
        required=True,
        choices=["admin", "write", "read", "sample"],
        help="repeat for several",
    )
    key.add_argument("--expires-at", help="an RFC 3339 time with its offset")
    keys = actions.add_parser("keys", help="the project's keys, never their secrets")
    _common(keys, top=False)
    keys.add_argument("project_id")
    keys.add_argument("--after")
    keys.add_argument("--limit", type=int, default=20)
    revoke = actions.add_parser("revoke-key")
    _common(revoke, top=False)
    revoke.add_argument("project_id")
    revoke.add_argument("key_id")
    projects.set_defaults(run=c.cmd_projects)

    audit = command("audit", "the audit log, newest first (an admin key)")
    for flag in ("--after", "--key-id", "--project-id", "--route", "--since", "--until"):
        audit.add_argument(flag)
    audit.add_argument("--limit", type=int, default=50)
    audit.set_defaults(run=c.cmd_audit)

    command("backends", "trainer backends").set_defaults(run=c.cmd_backends)
    command("health", "whether the server is ready (exit 1 if not)").set_defaults(run=c.cmd_health)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Output(args.json)
    retry = RetryPolicy(max_retries=max(0, args.retries))
    try:
        with Trainyard(args.url, api_key=args.api_key or None, retry=retry) as client:
            code: int = args.run(out, client, args)
            return code
    except c.UsageError as exc:
        out.error(f"error: {exc}")
        return EXIT_USAGE
    except WaitTimeoutError as exc:
        out.error(f"timed out: {exc}")
        return EXIT_TIMEOUT
    except (TrainyardConnectionError, ServerError) as exc:
        out.error(f"error: {exc}")
        return EXIT_UNREACHABLE
    except APIError as exc:
        if out.json:
            print(json.dumps(exc.problem.model_dump(mode="json", exclude_none=True)))
        out.error(f"error: {exc}")
        return EXIT_REFUSED
    except KeyboardInterrupt:
        out.error("interrupted")
        return EXIT_INTERRUPTED
