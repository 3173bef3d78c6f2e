"""The cpu backend on a GPU, end to end through the API: a smoke check and its figures.

A random-initialised model of a real shape (Qwen2-style, 0.5B-class: 24 layers, hidden
896, 14 heads, 2 KV heads; no download: the vocabulary is the offline test tokenizer's),
registered on `trainyard serve` (with its worker, `TRAINYARD_CPU_DEVICE=auto`), sampled
through the gateway, trained `--steps` steps through `POST /v1/training-jobs`, sampled
again. It prints JSON: the device, sampling tokens/s, each step's wall time from the POST
to `succeeded`, the same step bare (the policy in this process, the same batch, the same
device), the orchestration overhead (API + queue + worker ÷ the bare step; goal ≤ 2 % on
a GPU, where a step is large next to a request), and the GPU memory the bare step took.

    python scripts/gpu_smoke.py                  # on a CUDA host (the shape above)
    python scripts/gpu_smoke.py --shape tiny     # anywhere, in seconds (CI runs this)

Needs the server's environment with its cpu extra (torch, transformers, peft); no ART.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

SHAPES: dict[str, dict[str, int]] = {
    # Qwen2.5-0.5B's body (its embedding is the test tokenizer's, a few hundred tokens).
    "0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
    },
}
PROMPT = [{"role": "user", "content": "say a number"}]


def make_model(path: Path, shape: str) -> Path:
    """A random Qwen2 model of `shape` with the offline test tokenizer, saved to `path`."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from app.backends.seeding import seeded
    from app.backends.tiny_model import make_tiny_model

    make_tiny_model(path)  # the tokenizer and its chat template (the model is replaced)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SHAPES[shape],
    )
    with seeded(0):
        model = Qwen2ForCausalLM(config)
    for stale in path.glob("*.safetensors"):
        stale.unlink()
    model.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(client: httpx.Client, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"trainyard serve exited with {process.returncode}")
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise SystemExit("trainyard serve did not answer /healthz in time")


def sample(client: httpx.Client, n: int, max_tokens: int) -> tuple[dict[str, Any], float]:
    body = {
        "model": "smoke",
        "messages": PROMPT,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "logprobs": True,
        "seed": 1,
    }
    start = time.perf_counter()
    response = client.post("/openai/v1/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - start
    response.raise_for_status()
    return response.json(), seconds


def groups_of(completion: dict[str, Any]) -> list[dict[str, Any]]:
    """One group of the completion's choices, rewarded by a rule that splits them (so
    every answer has an advantage): the longer half of the answers gets 1."""
    choices = completion["choices"]
    lengths = sorted(len(c["logprobs"]["content"]) for c in choices)
    middle = lengths[len(lengths) // 2]
    trajectories = []
    for i, choice in enumerate(choices):
        longer = len(choice["logprobs"]["content"]) >= middle
        reward = 1.0 if (longer if len(set(lengths)) > 1 else i % 2) else 0.0
        trajectories.append({"messages_and_choices": [*PROMPT, choice], "reward": reward})
    return [{"trajectories": trajectories}]


def train_step(client: httpx.Client, groups: list[dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    """POST a training job and wait for it: (seconds from the POST to `succeeded`, job)."""
    start = time.perf_counter()
    created = client.post(
        "/v1/training-jobs",
        json={"model": "smoke", "groups": groups, "hyperparameters": {"learning_rate": 1e-5}},
    )
    created.raise_for_status()
    job_id = created.json()["id"]
    while True:
        job = client.get(f"/v1/training-jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.01)
    seconds = time.perf_counter() - start
    if job["status"] != "succeeded":
        raise SystemExit(f"training job {job_id} {job['status']}: {job.get('error')}")
    return seconds, job


def bare_steps(model: Path, groups: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """The same step with no service around it: the policy in this process."""
    import torch

    from app.backends.cpu_policy import Policy
    from app.trajectories import groups_to_art

    policy = Policy(str(model), rank=8, alpha=16, seed=0, device="auto")
    [batch] = policy.sequences(
        groups_to_art(groups), scale_rewards=True, allow_without_logprobs=False
    )
    cuda = policy.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps + 1):  # the first builds the optimizer: not counted
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with policy.lock:
            policy.step(
                batch, learning_rate=1e-5, epsilon=0.2, kl_penalty_coef=0.0, max_grad_norm=1.0
            )
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {
        "device": str(policy.device),
        "bare_step_s": statistics.median(times[1:]),
        "gpu_peak_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20) if cuda else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--n", type=int, default=8, help="completions a sample asks for")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    import torch

    shape = args.shape or ("0.5b" if torch.cuda.is_available() else "tiny")
    work = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    try:
        model = make_model(work / "models" / "smoke", shape)
        port = free_port()
        env = {
            **os.environ,
            "TRAINYARD_DATABASE_URL": f"sqlite+aiosqlite:///{work / 'trainyard.db'}",
            "TRAINYARD_DATA_DIR": str(work / "data"),
            "TRAINYARD_MODEL_ROOTS": str(work / "models"),
            "TRAINYARD_CPU_DEVICE": os.environ.get("TRAINYARD_CPU_DEVICE", "auto"),
            "TRAINYARD_PORT": str(port),
            "TRAINYARD_DEMO_MODEL": "false",
        }
        env.pop("TRAINYARD_API_KEYS", None)
        trainyard = Path(sys.executable).with_name("trainyard")
        log = (work / "serve.log").open("wb")
        server = subprocess.Popen([str(trainyard), "serve"], env=env, stdout=log, stderr=log)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                wait_ready(client, server, timeout=300)
                body = {"name": "smoke", "base_model": str(model), "backend": "cpu"}
                client.post("/v1/models", json=body).raise_for_status()
                sample(client, args.n, args.max_tokens)  # loads the model: not counted
                completion, sample_s = sample(client, args.n, args.max_tokens)
                tokens = sum(len(c["logprobs"]["content"]) for c in completion["choices"])
                groups = groups_of(completion)
                walls = [train_step(client, groups)[0] for _ in range(args.steps + 1)][1:]
                after, _ = sample(client, args.n, args.max_tokens)
                model_json = client.get("/v1/models/smoke").json()
        finally:
            server.terminate()
            server.wait(timeout=60)
        bare = bare_steps(model, groups, args.steps)
        wall = statistics.median(walls)
        report = {
            "shape": shape,
            **bare,
            "params_m": round(_params(model) / 1e6, 1),
            "sample_tokens_per_s": round(tokens / sample_s, 1),
            "step_wall_s": round(wall, 4),
            "bare_step_s": round(bare["bare_step_s"], 4),
            "overhead": round(wall / bare["bare_step_s"] - 1, 4),
            "steps": args.steps,
            "current_step": model_json["current_step"],
            "sampled_after": after["model"],
        }
        print(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _params(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in model.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                size = 1
                for dim in f.get_slice(key).get_shape():
                    size *= dim
                total += size
    return total


if __name__ == "__main__":
    main()
