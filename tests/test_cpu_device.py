"""The cpu backend's device: `auto` takes CUDA where torch sees it, the CPU here; a CUDA
device named where there is none is refused with the setting's name; a bad value is
refused at start. (The CUDA path itself runs on a lent GPU: scripts/gpu_smoke.py.) Its
torch threads: TRAINYARD_CPU_THREADS, else every CPU but one, wherever a policy is made
(through the cpu backend's worker: tests/test_cpu_backend.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.backends.admission import Admission
from app.settings import Settings

pytestmark = pytest.mark.torch


def test_auto_is_the_cpu_where_torch_sees_no_gpu_and_cuda_there_is_refused() -> None:
    import torch

    from app.backends.cpu_policy import resolve_device

    assert resolve_device("cpu") == "cpu"
    if torch.cuda.is_available():  # a lent GPU machine
        assert resolve_device("auto") == "cuda"
    else:
        assert resolve_device("auto") == "cpu"
        with pytest.raises(RuntimeError, match="TRAINYARD_CPU_DEVICE=cuda:1"):
            resolve_device("cuda:1")


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:x", "CPU", ""])
def test_a_device_setting_it_cannot_use_is_refused_at_start(value: str) -> None:
    with pytest.raises(ValidationError, match="cpu_device"):
        Settings(cpu_device=value)


@pytest.mark.parametrize("value", [0, -1, "many"])
def test_a_thread_count_it_cannot_use_is_refused_at_start(value: object) -> None:
    with pytest.raises(ValidationError, match="cpu_threads"):
        Settings(cpu_threads=value)


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Torch's thread count is the process's: put back what the suite had."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("torch_threads")
def test_torch_takes_every_cpu_but_one_unless_the_setting_says(tmp_path: Path) -> None:
    import torch

    from app.backends.cpu_policy import Policy, available_cpus, default_threads, use_threads
    from app.backends.lora_pool import AdapterPool
    from app.backends.storage import Storage
    from app.backends.tiny_model import make_tiny_model
    from app.tinker.service import TinkerService
    from app.tinker.spec import Lora

    assert default_threads() == max(1, available_cpus() - 1)
    torch.set_num_threads(3)
    use_threads(None)
    assert torch.get_num_threads() == default_threads()

    base = make_tiny_model(tmp_path / "tiny")
    Policy(str(base), rank=2, alpha=4, seed=1, threads=3)
    assert torch.get_num_threads() == 3
    # Each place that makes a policy from the settings: a Tinker run, a serving pool.
    settings = Settings(data_dir=tmp_path / "data", cpu_threads=2)
    TinkerService(settings, None, None)._load_policy(str(base), Lora(rank=2, seed=0))  # type: ignore[arg-type]
    assert torch.get_num_threads() == 2
    torch.set_num_threads(3)
    pool = AdapterPool(str(base), Storage(settings), Admission(), threads=settings.cpu_threads)
    pool.policy(None)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        ({"cpu.max": "max 100000\n"}, None),  # cgroup v2, no limit
        ({"cpu.max": "150000 100000\n"}, 2),  # a limit of 1.5 CPUs: two threads' worth
        ({"cpu.max": "100000 100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1
        ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
        ({}, None),  # no cgroup files to read
    ],
)
def test_the_cpus_a_process_may_use_are_capped_by_its_containers_limit(
    tmp_path: Path, files: dict[str, str], cpus: int | None
) -> None:
    from app.backends.cpu_policy import available_cpus

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path) == (affinity if cpus is None else min(affinity, cpus))


def test_a_policy_samples_and_trains_on_the_device_it_was_given(tmp_path: Path) -> None:
    from app.backends.cpu_policy import Policy, Turn
    from app.backends.tiny_model import make_tiny_model

    base = make_tiny_model(tmp_path / "tiny")
    policy = Policy(str(base), rank=2, alpha=4, seed=1, device="auto")
    assert {p.device.type for p in policy.model.parameters()} == {policy.device.type}
    prompt = policy.encode_prompt([{"role": "user", "content": "hi"}])
    [sample] = policy.sample(
        prompt,
        n=1,
        max_tokens=3,
        temperature=1.0,
        top_p=1.0,
        top_logprobs=0,
        stop_ids=set(),
        seed=7,
    )
    turn = Turn(prompt, sample.token_ids, sample.logprobs, advantage=1.0)
    metrics = policy.step(
        [turn], learning_rate=0.01, epsilon=0.2, kl_penalty_coef=0.0, max_grad_norm=1.0
    )
    assert metrics["loss/grad_norm"] > 0


@pytest.mark.slow
def test_the_gpu_smoke_script_runs_end_to_end_on_the_cpu() -> None:
    """scripts/gpu_smoke.py with the tiny shape: a real `trainyard serve`, the gateway,
    training jobs, the bare step; its report adds up."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRAINYARD_CPU_DEVICE": "cpu"}
    done = subprocess.run(
        [sys.executable, "scripts/gpu_smoke.py", "--shape", "tiny", "--steps", "2"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{") :])
    assert report["device"] == "cpu" and report["shape"] == "tiny"
    assert report["current_step"] == 3 and report["sampled_after"] == "smoke@3"  # 1 + 2 steps
    assert report["step_wall_s"] > 0 and report["bare_step_s"] > 0
    assert report["sample_tokens_per_s"] > 0 and report["params_m"] > 0
