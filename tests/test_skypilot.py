"""The SkyPilot task (deploy/skypilot/worker-gpu.yaml), loaded by the `skypilot` library.

SkyPilot's dependencies and the server's are not one set (it pins click < 8.2 and uvicorn <
0.36), so it lives in an environment of its own, .venv-sky (`make .venv-sky/.installed`),
and the task is loaded there, in a subprocess, exactly as `sky jobs launch` loads it
(`sky.Task.from_yaml`, which validates it against SkyPilot's task schema). No cloud account
or cluster is reachable here: nothing is launched.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "deploy" / "skypilot" / "worker-gpu.yaml"
SKY_PYTHON = ROOT / ".venv-sky" / "bin" / "python"
SECRETS = {
    "TRAINYARD_DATABASE_URL",
    "TRAINYARD_CHECKPOINT_URL",
    "TRAINYARD_CHECKPOINT_S3_ENDPOINT",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
}
# Settings the task names that arrive with a branch not merged yet (checkpoint storage);
# empty this once they are in app/settings.py.
ARRIVING_SETTINGS: set[str] = set()  # settings the manifests name before the code has them

LOAD = """
import json, sys
import sky
import yaml

path = sys.argv[1]
task = sky.Task.from_yaml(path)
# As `sky jobs launch --secret NAME` does: each secret reference given a value.
config = yaml.safe_load(open(path))
names = [r.name for r in task.managed_secret_refs]
launched = sky.Task.from_yaml_config(config, secrets_overrides=[(n, "v-" + n) for n in names])
print(json.dumps({
    "version": sky.__version__,
    "name": task.name,
    "run": task.run,
    "setup": task.setup,
    "num_nodes": task.num_nodes,
    "envs": task.envs,
    "secret_refs": names,
    "launched_secrets": {k: v.get_secret_value() for k, v in launched.secrets.items()},
    "resources": [
        {
            "accelerators": r.accelerators,
            "use_spot": r.use_spot,
            "image_id": r.image_id,
            "job_recovery": r.job_recovery,
            "disk_size": r.disk_size,
        }
        for r in task.resources
    ],
}))
"""


def sky(*args: str, source: str = LOAD) -> subprocess.CompletedProcess[str]:
    if not SKY_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(".venv-sky is missing under CI (make .venv-sky/.installed)")
        pytest.skip(".venv-sky is not installed (make .venv-sky/.installed)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(SKY_PYTHON), "-c", source, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def task() -> dict[str, Any]:
    done = sky(str(TASK))
    assert done.returncode == 0, done.stderr
    loaded: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


def test_the_task_loads_with_skypilot(task: dict[str, Any]) -> None:
    assert task["version"] == "0.14.1"
    assert task["name"] == "trainyard-worker-gpu"
    assert task["num_nodes"] == 1


def test_it_runs_a_gpu_pool_worker(task: dict[str, Any]) -> None:
    command = shlex.split(task["run"])
    assert command == [
        "exec",
        "trainyard",
        "worker",
        "--pool",
        "gpu",
        "--backends",
        "art-local,cpu",
        "--labels",
        "gpu=h100",
    ]


def test_it_asks_for_one_gpu_and_recovers_from_preemption(task: dict[str, Any]) -> None:
    resources = task["resources"]
    assert [r["accelerators"] for r in resources] == [{"H100": 1}]
    for r in resources:
        assert r["use_spot"] is True
        assert r["job_recovery"] == {
            "strategy": "EAGER_NEXT_REGION",
            "max_restarts_on_errors": 3,
        }
        assert list(r["image_id"].values()) == ["docker:trainyard-gpu:latest"]
        assert r["disk_size"] >= 100


def test_it_reaches_postgres_and_the_object_store_by_secrets(task: dict[str, Any]) -> None:
    assert set(task["secret_refs"]) == SECRETS
    assert task["launched_secrets"] == {name: f"v-{name}" for name in SECRETS}
    assert not SECRETS & set(task["envs"]), "no secret in plain envs"
    known = {f"TRAINYARD_{name.upper()}" for name in Settings.model_fields} | ARRIVING_SETTINGS
    names = {n for n in [*task["envs"], *task["secret_refs"]] if n.startswith("TRAINYARD_")}
    assert names <= known, names - known
    settings = {k[len("TRAINYARD_") :].lower(): v for k, v in task["envs"].items()}
    assert Settings(**{k: v for k, v in settings.items() if k in Settings.model_fields})


def test_skypilot_refuses_a_broken_task(tmp_path: Path) -> None:
    """The load is a real validation: a misspelt field fails it."""
    broken = tmp_path / "broken.yaml"
    broken.write_text(TASK.read_text().replace("job_recovery:", "job_recovry:"))
    done = sky(str(broken))
    assert done.returncode != 0
    assert "job_recovry" in done.stderr
