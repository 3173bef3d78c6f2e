"""A real `nat finetune` trains on a live Trainyard through the client's NAT adapter.

NeMo Agent Toolkit 1.9 runs from its own environment (`make .venv-nat/.installed`): NAT's
own trainer (`openpipe_art_trainer`) and trajectory builder (`openpipe_art_traj_builder`),
a one-LLM-call workflow (`chat_completion`) whose LLM is the `demo` model through
Trainyard's gateway with logprobs, NAT's built-in `levenshtein_distance` evaluator as the
reward, and `trainyard_trainer_adapter`. The LLM and adapter blocks are the README's, as
written. Two epochs: two jobs, each one step of the model, each fed the trajectories NAT
built.

Without the NAT environment the test is skipped, except under CI, where it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer
from tests.test_readme import README, Block, Server, fenced_blocks

pytestmark = [pytest.mark.slow, pytest.mark.any_database]

ROOT = Path(__file__).resolve().parents[1]
NAT = ROOT / ".venv-nat" / "bin" / "nat"
DATA = Path(__file__).parent / "data" / "nat"
SECTION = "## NeMo Agent Toolkit"
ADDRESS = "http://localhost:8000"
KEY = "nat-users-key"  # the finetuning server has API keys


def readme_config() -> Block:
    """The section's YAML block: the LLM and trainer-adapter blocks of a NAT config."""
    text = README.read_text()
    start = text.index(f"\n{SECTION}\n")
    end = text.index("\n## ", start + 1)
    blocks = [b for b in fenced_blocks(text[start:end]) if b.language == "yaml"]
    assert len(blocks) == 1, "the NAT section has one YAML block"
    return blocks[0]


def nat_or_skip() -> Path:
    if not NAT.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{NAT} is missing: CI builds it (make .venv-nat/.installed)")
        pytest.skip("no NAT environment: make .venv-nat/.installed")
    return NAT


def write_config(tmp_path: Path, url: str, **replace: str) -> Path:
    """The test's NAT config with the README's block appended, for the server at `url`."""
    block = "\n".join(readme_config().lines).replace(ADDRESS, url)
    for old, new in replace.items():
        assert old in block, old
        block = block.replace(old, new)
    base = (DATA / "finetune.yml").read_text()
    text = base.replace("@DATA@", str(DATA)).replace("@OUT@", str(tmp_path / "out"))
    path = tmp_path / "config.yml"
    path.write_text(text + "\n" + block + "\n")
    return path


def finetune(config: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`nat finetune` with the server's key in `TRAINYARD_API_KEY` and nowhere else: the
    README's block hands it to the LLM (`${TRAINYARD_API_KEY:-unused}`); the adapter
    takes it from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "OPENAI_"))}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # NAT's ART plugin imports litellm: offline
    env["TRAINYARD_API_KEY"] = KEY
    # NAT's default INFO level ends every epoch in a RecursionError (NAT 1.9).
    command = [str(NAT), "--log-level", "warning", "finetune", "--config_file", str(config)]
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def jobs(client: httpx.Client) -> list[dict[str, Any]]:
    page = client.get("/v1/training-jobs", params={"model": "demo", "limit": 100}).json()
    return list(reversed(page["data"]))  # oldest first


def test_the_readme_block_selects_the_adapter_and_the_gateway() -> None:
    lines = readme_config().lines
    assert "trainer_adapters:" in lines and "llms:" in lines
    assert "    _type: trainyard_trainer_adapter" in lines
    assert any(line.strip() == f"base_url: {ADDRESS}/openai/v1" for line in lines)
    assert any(line.strip() == "logprobs: true" for line in lines)


async def test_the_adapter_sends_the_key_from_its_config_or_the_environment(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    """On a server with API keys: the key in the adapter's config (over a wrong one in the
    environment), in TRAINYARD_API_KEY (the config's `api_key` absent, or null as NAT reads
    `${TRAINYARD_API_KEY}` of an unset variable), and none (refused: 401)."""
    nat = nat_or_skip()
    python = nat.parent / "python"
    script = DATA / "adapter_keys.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "OPENAI_"))}
    async with serve(worker_enabled=True, api_keys=KEY) as live:
        ran = await asyncio.to_thread(
            subprocess.run,
            [str(python), str(script), live.url, KEY, str(tmp_path / "out")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout + ran.stderr


async def test_the_adapter_maps_statuses_and_raises_failures(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    nat = nat_or_skip()
    python = nat.parent / "python"
    script = DATA / "adapter_check.py"
    async with serve(worker_enabled=True) as live:
        ran = await asyncio.to_thread(
            subprocess.run,
            [str(python), str(script), live.url, str(tmp_path / "out")],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout + ran.stderr


@pytest.mark.torch  # the `demo` model is made and trained on the cpu backend
def test_nat_finetune_trains_the_demo_model_one_step_per_epoch(tmp_path: Path) -> None:
    nat_or_skip()
    server = Server(tmp_path / "var", tmp_path / "server.log")
    try:
        server.start({"TRAINYARD_API_KEYS": KEY}, demo_served=True)
        url = f"http://127.0.0.1:{server.port}"
        client = httpx.Client(base_url=url, headers=server.auth, timeout=30)
        assert httpx.get(f"{url}/v1/models/demo").status_code == 401
        # The endpoint the model JSON names is the gateway, behind the keys.
        served_at = client.get("/v1/models/demo").json()["inference_base_url"]
        assert served_at == f"{url}/openai/v1"
        assert httpx.post(f"{served_at}/chat/completions", json={}).status_code == 401

        # A hyper-parameter the backend does not take fails at start, before any rollout.
        bad = write_config(
            tmp_path, url, **{"{learning_rate: 0.02}": "{learning_rate: 0.02, beta: 0.1}"}
        )
        started = time.monotonic()
        refused = finetune(bad, tmp_path)
        assert refused.returncode != 0, refused.stdout + refused.stderr
        assert "beta: not a keyword this backend accepts" in refused.stderr, refused.stderr
        assert jobs(client) == []
        assert not (tmp_path / "out" / "eval").exists(), "a rollout ran before the check"
        print(f"refused in {time.monotonic() - started:.1f} s")

        started = time.monotonic()
        ran = finetune(write_config(tmp_path, url), tmp_path)
        print(f"nat finetune: {time.monotonic() - started:.1f} s")
        output = ran.stdout + ran.stderr
        assert ran.returncode == 0, output
        # NAT 1.9 logs a RecursionError from its eval exporter (`str()` of a config that
        # holds itself: finetuning.run_configuration.config_file), and goes on.
        for failure in ("Error during epoch", "Training failed", "Finetuning completed with"):
            assert failure not in output, output
        assert "ERROR    - trainyard_client" not in output, output  # nor did the adapter

        done = jobs(client)
        assert [job["status"] for job in done] == ["succeeded", "succeeded"], done
        assert [job["metadata"]["nat_submission"] for job in done] == [1, 2]
        assert len({job["metadata"]["nat_run_id"] for job in done}) == 1  # NAT's one run id
        assert [(j["result"]["start_step"], j["result"]["final_step"]) for j in done] == [
            (0, 1),
            (1, 2),
        ]
        assert client.get("/v1/models/demo").json()["current_step"] == 2
        for job in done:
            # Two examples, four generations each: a group of four per example.
            assert job["summary"]["num_groups"] == 2, job["summary"]
            assert job["summary"]["num_trajectories"] == 8, job["summary"]
            sent = client.get(f"/v1/training-jobs/{job['id']}/trajectories?shape=nat").json()
            episode = sent["trajectories"][0][0]["episode"]
            assert [item["role"] for item in episode] == ["system", "user", "assistant"]
            tokens = episode[-1]["logprobs"]["content"]
            assert tokens and all(t["token"].startswith("token_id:") for t in tokens)

        # The adapter's log: each job's end, with the step it made.
        logs = list((tmp_path / "out" / "finetuning" / "trainyard").glob("*.jsonl"))
        assert len(logs) == 1
        lines = [json.loads(line) for line in logs[0].read_text().splitlines()]
        ended = [line for line in lines if line["event"] == "job_ended"]
        assert [(e["job_id"], e["final_step"]) for e in ended] == [
            (job["id"], job["result"]["final_step"]) for job in done
        ]
    finally:
        server.stop()


@pytest.mark.torch  # the `demo` model trains DPO on the cpu backend
async def test_the_adapter_trains_nats_dpo_items_as_a_dpo_job(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    nat = nat_or_skip()
    python = nat.parent / "python"
    script = DATA / "adapter_dpo.py"
    async with serve(worker_enabled=True, demo_model=True) as live:
        ran = await asyncio.to_thread(
            subprocess.run,
            [str(python), str(script), live.url, str(tmp_path / "out")],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout + ran.stderr
