"""`trainyard-client`, the CLI of clients/python, run as a process against a live server
over loopback: `watch` draws a progress bar that moves (read from a pseudo-terminal, as a
person would see it), exit codes say how a watched job ended, `--json` output parses."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import tarfile
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import factories as f
from tests.conftest import LiveServer
from tests.processes import PATIENCE, free_port
from trainyard_client.cli import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)

pytestmark = pytest.mark.any_database

CLI = str(Path(sys.executable).parent / "trainyard-client")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Four trainable groups: four gradient steps. Their mean reward, which watch shows.
REWARDS = [[1.0, 0.0], [0.5, 0.25], [1.0, 0.5], [0.0, 1.0]]
MEAN_REWARD = "0.5312"


@dataclass
class Run:
    code: int
    out: str
    err: str = ""

    def json_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.out.splitlines() if line.startswith("{")]


def _environment(url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update(TRAINYARD_URL=url, COLUMNS="120", TERM="xterm-256color", **extra)
    env.pop("NO_COLOR", None)
    return env


def run_cli(*args: str, url: str, timeout: float = PATIENCE, **extra: str) -> Run:
    """The CLI with pipes (not a terminal): plain lines, or JSON with --json."""
    done = subprocess.run(
        [CLI, *args],
        env=_environment(url, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(done.returncode, done.stdout, done.stderr)


def run_in_terminal(*args: str, url: str, timeout: float = PATIENCE) -> Run:
    """The CLI on a pseudo-terminal 120 columns wide; everything it drew, as drawn."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(
        [CLI, *args],
        env=_environment(url),
        stdin=follower,
        stdout=follower,
        stderr=follower,
        close_fds=True,
    )
    os.close(follower)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the terminal's other end is closed
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            elif process.poll() is not None:
                break
        code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()
        os.close(leader)
    return Run(code, b"".join(chunks).decode("utf-8", "replace"))


def frames(drawn: str) -> list[str]:
    """What the terminal showed, redraw by redraw: escape codes out, a frame per line."""
    text = ANSI.sub("", drawn)
    return [frame.strip() for frame in re.split(r"[\r\n]+", text) if frame.strip()]


async def _job(live: LiveServer, model: str, **body: Any) -> str:
    response = await f.submit(live.client, model, **body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


async def test_watch_draws_a_progress_bar_that_moves(serve: Callable[..., LiveServer]) -> None:
    async with serve(worker_enabled=True) as live:
        await f.create_model(live.client, "bar", seconds_per_step=0.5)
        job = await _job(live, "bar", collection=f.nat_collection(REWARDS))
        run = await asyncio.to_thread(run_in_terminal, "watch", job, url=live.url)

    assert run.code == EXIT_OK, run.out
    shown = frames(run.out)
    bars = [frame for frame in shown if "━" in frame and job in frame]
    assert bars, shown
    percents = [int(m.group(1)) for b in bars if (m := re.search(r"(\d+)%", b))]
    counters = [m.group(1) for b in bars if (m := re.search(r"step (\d/\d)", b))]
    # The bar moved through every gradient step, in order, while the job ran.
    assert [p for i, p in enumerate(percents) if i == 0 or p != percents[i - 1]] == [
        25,
        50,
        75,
        100,
    ], percents
    assert list(dict.fromkeys(counters)) == ["1/4", "2/4", "3/4", "4/4"], counters
    assert any("running" in b and "50%" in b for b in bars)
    assert f"reward {MEAN_REWARD}" in bars[-1] and "loss 0" in bars[-1]
    assert "succeeded" in bars[-1]
    assert shown[-1] == f"{job} succeeded: model step 0 → 1"


async def test_watch_exit_codes_say_how_the_job_ended(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    async with serve(worker_enabled=True) as live:
        await f.create_model(live.client, "fails", fail_with="boom")
        await f.create_model(live.client, "slow", seconds_per_step=30)
        await f.create_model(live.client, "cancelled", seconds_per_step=30)
        failing = await _job(live, "fails")
        slow = await _job(live, "slow")
        running = await _job(live, "cancelled")
        (tmp_path / "nothing.json").write_text('{"model": "x"}')
        url = live.url

        async def cancel_once_running() -> None:
            for _ in range(200):
                job = (await live.client.get(f"/v1/training-jobs/{running}")).json()
                if job["status"] == "running":
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the watch below has started by now, or will find it
            response = await live.client.post(f"/v1/training-jobs/{running}/cancel")
            assert response.status_code == 200, response.text

        runs = await asyncio.gather(
            asyncio.to_thread(run_cli, "--json", "watch", failing, url=url),
            asyncio.to_thread(run_cli, "watch", running, url=url),
            asyncio.to_thread(run_cli, "watch", slow, "--timeout", "1", url=url),
            asyncio.to_thread(run_cli, "watch", "job_nope", url=url),
            asyncio.to_thread(run_cli, "submit", str(tmp_path / "nothing.json"), url=url),
            asyncio.to_thread(
                run_cli, "watch", slow, "--retries", "0", url=f"http://127.0.0.1:{free_port()}"
            ),
            cancel_once_running(),
        )
        failed, cancelled, timed_out, missing, usage, unreachable, _ = runs
        # Cancelled, the slow job lets the server stop at once (it waits for running jobs).
        assert (await live.client.post(f"/v1/training-jobs/{slow}/cancel")).status_code == 200

    assert failed.code == EXIT_FAILED, failed
    lines = failed.json_lines()
    assert lines[-1]["status"] == "failed" and lines[-1]["event"] == "training_failed"
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    assert cancelled.code == EXIT_CANCELLED, cancelled
    assert cancelled.out.splitlines()[-1] == f"{running} cancelled"
    assert timed_out.code == EXIT_TIMEOUT, timed_out
    assert "had not ended" in timed_out.err
    assert missing.code == EXIT_REFUSED, missing
    assert "404 Not Found: no training job 'job_nope'" in missing.err
    assert usage.code == EXIT_USAGE and "not a training job" in usage.err
    assert unreachable.code == EXIT_UNREACHABLE, unreachable
    assert "ConnectError" in unreachable.err


async def test_submit_list_and_inspect_as_json(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    model_file = tmp_path / "model.json"
    model_file.write_text(json.dumps(f.model_body("cli", seconds_per_step=0.05)))
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({"model": "cli", "collection": f.nat_collection()}))
    async with serve(worker_enabled=True, api_keys="cli-key") as live:

        def session() -> dict[str, Run]:
            def cli(*args: str) -> Run:
                return run_cli("--json", *args, url=live.url, TRAINYARD_API_KEY="cli-key")

            runs = {"model": cli("models", "create", str(model_file))}
            runs["submit"] = cli("submit", str(job_file), "--watch")
            job_id = runs["submit"].json_lines()[0]["job_id"]
            runs["jobs"] = cli("jobs", "list", "--model", "cli")
            runs["job"] = cli("jobs", "get", job_id)
            runs["events"] = cli("jobs", "events", job_id)
            runs["models"] = cli("models", "list")
            runs["checkpoints"] = cli("checkpoints", "list", "cli")
            runs["checkpoint"] = cli("checkpoints", "get", "cli", "1")
            runs["backends"] = cli("backends")
            runs["health"] = cli("health")
            runs["cancel"] = cli("jobs", "cancel", job_id)
            runs["table"] = run_cli(
                "jobs", "list", "--after", "", url=live.url, TRAINYARD_API_KEY="cli-key"
            )
            runs["nokey"] = run_cli("models", "list", url=live.url)
            return runs

        runs = await asyncio.to_thread(session)

    assert all(run.code == EXIT_OK for name, run in runs.items() if name not in {"cancel", "nokey"})
    assert json.loads(runs["model"].out)["name"] == "cli"
    watched = runs["submit"].json_lines()
    assert watched[-1]["status"] == "succeeded" and watched[-1]["event"] == "training_ended"
    job_id = watched[0]["job_id"]
    assert [j["id"] for j in json.loads(runs["jobs"].out)["data"]] == [job_id]
    job = json.loads(runs["job"].out)
    assert job["status"] == "succeeded" and job["result"]["final_step"] == 1
    assert [e["type"] for e in json.loads(runs["events"].out)][-1] == "training_ended"
    assert [m["name"] for m in json.loads(runs["models"].out)["data"]] == ["cli"]
    assert [c["step"] for c in json.loads(runs["checkpoints"].out)["data"]] == [1, 0]
    assert json.loads(runs["checkpoint"].out)["job_id"] == job_id
    assert "dry-run" in {b["name"] for b in json.loads(runs["backends"].out)}
    assert json.loads(runs["health"].out)["status"] == "ready"
    assert runs["cancel"].code == EXIT_REFUSED
    assert json.loads(runs["cancel"].out)["status"] == 409  # the problem, for scripts
    assert job_id in runs["table"].out and "succeeded" in runs["table"].out
    assert runs["nokey"].code == EXIT_REFUSED and "401 Unauthorized" in runs["nokey"].err


@pytest.mark.torch
async def test_a_rollout_followed_into_its_training_job_and_a_run_with_its_curve(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    from app.backends.tiny_model import make_tiny_model

    tiny = await asyncio.to_thread(make_tiny_model, tmp_path / "models" / "tiny")
    prompt = [{"role": "user", "content": "hi"}]
    sampling = {"max_tokens": 1, "temperature": 1.0}
    CONTAINS = {"type": "contains"}
    rollout = {
        "model": "toy",
        "examples": [{"id": "q", "messages": prompt, "expected": "a"}],
        "num_generations": 4,
        "sampling": sampling,
        "grader": CONTAINS,
        "train": {"hyperparameters": {"learning_rate": 0.02}},
    }
    (tmp_path / "rollout.json").write_text(json.dumps(rollout))
    lines = [{"id": i, "messages": prompt, "expected": "a"} for i in range(2)]
    (tmp_path / "toy.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    async with serve(worker_enabled=True, model_roots=[tiny.parent]) as live:
        response = await live.client.post(
            "/v1/models", json={"name": "toy", "base_model": str(tiny), "backend": "cpu"}
        )
        assert response.status_code == 201, response.text

        def session() -> dict[str, Run]:
            rollout_file = str(tmp_path / "rollout.json")
            runs = {"rollout": run_cli("submit", rollout_file, "--watch", url=live.url)}
            merged = str(tmp_path / "toy-merged.tar")
            runs["export"] = run_cli(
                "--json", "checkpoints", "export", "toy", "1", "--format", "merged", "-o", merged,
                url=live.url,
            )  # fmt: skip
            runs["upload"] = run_cli(
                "--json",
                "datasets",
                "upload",
                str(tmp_path / "toy.jsonl"),
                "--name",
                "toy",
                url=live.url,
            )
            body = {
                "model": "toy",
                "dataset": {"id": json.loads(runs["upload"].out)["id"]},
                "recipe": {"num_generations": 2, "sampling": sampling, "grader": CONTAINS},
                "schedule": {"max_steps": 2, "examples_per_step": 1},
            }
            (tmp_path / "run.json").write_text(json.dumps(body))
            runs["run"] = run_cli("submit", str(tmp_path / "run.json"), "--watch", url=live.url)
            run_id = runs["run"].out.split()[2]
            runs["curve"] = run_cli("--json", "runs", "metrics", run_id, url=live.url)
            runs["list"] = run_cli("runs", "list", url=live.url)
            runs["get"] = run_cli("--json", "jobs", "get", run_id, url=live.url)
            runs["pause"] = run_cli("runs", "pause", run_id, url=live.url)
            runs["datasets"] = run_cli("--json", "datasets", "list", url=live.url)
            return runs

        runs = await asyncio.to_thread(session)
        jobs = (await live.client.get("/v1/training-jobs?limit=100")).json()["data"]

    rolled = runs["rollout"]
    assert rolled.code == EXIT_OK, rolled
    printed = rolled.out.splitlines()
    assert printed[0].startswith("submitted rollout job job_")
    assert any(x.startswith("rollout job_") and "sample 4/4" in x for x in printed), printed
    ended = [line for line in printed if " succeeded: " in line]
    trained = jobs[-1]["id"]  # the first training job: the rollout's
    assert len(ended) == 2 and f"training job {trained}" in ended[0], printed
    assert ended[1].startswith(f"{trained} succeeded: model step 0 → 1")

    exported = json.loads(runs["export"].out)
    with tarfile.open(exported["path"]) as tar:  # the merged model's directory
        assert "toy-step0001-merged/config.json" in tar.getnames()
    assert exported["bytes"] == Path(exported["path"]).stat().st_size

    ran = runs["run"]
    assert ran.code == EXIT_OK, ran
    printed = ran.out.splitlines()
    run_id = printed[0].split()[2]
    assert printed[0].startswith("submitted run run_")
    assert any("step 1/2" in line for line in printed) and any("step 2/2" in x for x in printed)
    assert printed[-1] == f"{run_id} succeeded: step 2/2 (completed)"
    curve = json.loads(runs["curve"].out)
    assert [(row["kind"], row["step"]) for row in curve] == [("step", 1), ("step", 2)]
    assert run_id in runs["list"].out
    assert json.loads(runs["get"].out)["status"] == "succeeded"
    assert runs["pause"].code == EXIT_REFUSED and "409" in runs["pause"].err
    assert [d["name"] for d in json.loads(runs["datasets"].out)["data"]] == ["toy"]


def test_every_command_and_action_prints_its_help() -> None:
    """`--help` of the command, of each command and of each action exits 0 with a usage."""
    import argparse
    import contextlib
    import io

    from trainyard_client.cli import build_parser

    def paths(parser: argparse.ArgumentParser, path: list[str]) -> list[list[str]]:
        found = [path]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += paths(sub, [*path, name])
        return found

    every = paths(build_parser(), [])
    assert ["models", "create"] in every and ["jobs", "events"] in every
    for path in every:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
            build_parser().parse_args([*path, "--help"])
        assert exited.value.code == 0, path
        assert out.getvalue().startswith("usage: trainyard-client"), path


async def test_projects_keys_and_the_audit_log_from_the_cli(
    serve: Callable[..., LiveServer],
) -> None:
    async with serve(api_keys="cli-key", key_cache_seconds=0) as live:

        def session() -> dict[str, Run]:
            def cli(*args: str, key: str = "cli-key") -> Run:
                return run_cli("--json", *args, url=live.url, TRAINYARD_API_KEY=key)

            runs = {"project": cli("projects", "create", "team-a")}
            project = json.loads(runs["project"].out)["id"]
            runs["key"] = cli(
                "projects", "create-key", project, "--name", "ci", "--scope", "read",
                "--expires-at", "2999-01-01T00:00:00Z",
            )  # fmt: skip
            made = json.loads(runs["key"].out)
            runs["own"] = cli("projects", "get", project, key=made["secret"])
            runs["refused"] = cli("projects", "create", "team-b", key=made["secret"])
            runs["list"] = cli("projects", "list")
            runs["keys"] = cli("projects", "keys", project)
            runs["revoke"] = cli("projects", "revoke-key", project, made["id"])
            runs["revoked"] = cli("projects", "get", project, key=made["secret"])
            runs["audit"] = cli("audit", "--route", "/v1/projects")
            runs["naive"] = cli("audit", "--since", "2026-01-01T00:00:00")
            return runs

        runs = await asyncio.to_thread(session)
    ok = {"project", "key", "own", "list", "keys", "revoke", "audit"}
    assert all(runs[name].code == EXIT_OK for name in ok), {n: runs[n].err for n in ok}
    made = json.loads(runs["key"].out)
    assert made["secret"].startswith("ty_") and made["scopes"] == ["read"]
    assert json.loads(runs["own"].out)["name"] == "team-a"
    assert runs["refused"].code == EXIT_REFUSED
    assert json.loads(runs["refused"].out)["missing_scope"] == "write"  # a read key
    assert {p["name"] for p in json.loads(runs["list"].out)["data"]} == {"default", "team-a"}
    listed = json.loads(runs["keys"].out)["data"]
    assert [k["id"] for k in listed] == [made["id"]] and "secret" not in listed[0]
    assert runs["revoked"].code == EXIT_REFUSED and "401" in runs["revoked"].err
    events = json.loads(runs["audit"].out)["data"]
    assert [(e["method"], e["status"]) for e in events] == [("POST", 403), ("POST", 201)]
    assert runs["naive"].code != EXIT_OK and "offset" in runs["naive"].err
