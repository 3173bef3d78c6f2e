"""The README's "SDK and CLI" section runs as written against a live server: its Python
example in a fresh interpreter, then its `trainyard-client` commands in bash, in one
scratch directory (the Python writes the job.json the commands submit). Only the server's
address changes."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import LiveServer
from tests.test_readme import README, Block, fenced_blocks

pytestmark = pytest.mark.any_database

SECTION = "## SDK and CLI"
ADDRESS = "http://localhost:8000"


def section_blocks() -> list[Block]:
    text = README.read_text()
    start = text.index(f"\n{SECTION}\n")
    end = text.index("\n## ", start + 1)
    offset = text[:start].count("\n") + 1
    blocks = fenced_blocks(text[start:end])
    for block in blocks:
        block.line += offset
    return blocks


def test_the_section_has_one_python_example_and_one_command_example() -> None:
    blocks = section_blocks()
    assert [b.language for b in blocks if b.language == "python"] == ["python"]
    commands = [b for b in blocks if any("trainyard-client " in line for line in b.lines)]
    assert len(commands) == 1 and commands[0].language == "sh"
    assert any(ADDRESS in line for b in blocks for line in b.lines)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


async def test_the_sdk_and_cli_examples_run_against_a_live_server(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    for tool in ("bash", "jq"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    blocks = section_blocks()
    python = next(b for b in blocks if b.language == "python")
    commands = next(b for b in blocks if any("trainyard-client " in x for x in b.lines))
    async with serve(worker_enabled=True) as live:
        code = "\n".join(python.lines).replace(ADDRESS, live.url)
        ran = await asyncio.to_thread(_run, [sys.executable, "-c", code], tmp_path)
        assert ran.returncode == 0, f"README.md:{python.line}\n{ran.stdout}\n{ran.stderr}"
        script = "set -euo pipefail\n" + "\n".join(commands.lines).replace(ADDRESS, live.url)
        shell = await asyncio.to_thread(_run, ["bash", "-c", script], tmp_path)
        assert shell.returncode == 0, f"README.md:{commands.line}\n{shell.stdout}\n{shell.stderr}"

    printed = ran.stdout.splitlines()
    assert printed[0] == "job_queued step 0/None" and "gradient_step step 1/1" in printed
    assert "succeeded 1" in printed
    assert printed[-1].startswith("['groups[0].trajectories[0].messages_and_choices[1].logprobs")
    assert (tmp_path / "job.json").exists()
    lines = shell.stdout.splitlines()
    assert lines[0].startswith("submitted training job job_")
    finished = [line for line in lines if " succeeded: model step " in line]
    assert [line.split(": ", 1)[1] for line in finished] == [
        "model step 1 → 2",  # the submit --watch
        "model step 1 → 2",  # watch $JOB: the same job, finished
    ]
    assert '"status": "succeeded"' in shell.stdout  # jobs get --json
