"""Tinker's operations through the SDK against the same operations in-process.

measured: through the Tinker SDK (tinker 0.38.0, `.venv-tinker`) against `trainyard serve`
(the `demo` tiny model, SQLite, keys on): a training step, `forward_backward` of 32 datums
of 13 tokens (`importance_sampling`) and `optim_step`, both sent before either is awaited
(as the cookbook does); and `sample` of 32 completions of 8 tokens. Median of REPEAT after
one uncounted round each.
Baseline: the same operations on a policy of the same model, LoRA rank and seed in this
process, in a worker thread as the server runs them (`app.tinker.trainer`: forward_backward
+ optim_step; `Policy.sample`: bare generation), same run, same data.
Goals (issue 30): step through the SDK / in-process <= 1.3; sample / bare generation <= 1.2.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import report, server

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
KEY = "tml-bench-key"
REPEAT = int(os.environ.get("BENCH_TINKER_REPEAT", "10"))
# Which parts to measure: `step`, `sample` or both (a sample alone samples weights equal to
# the run's own: no step has moved them).
PARTS = [p for p in os.environ.get("BENCH_TINKER_PARTS", "step,sample").split(",") if p]
STEP_GOAL, SAMPLE_GOAL = 1.3, 1.2
RANK, SEED, LR = 8, 0, 1e-3
PROMPT = [47, 45, 43, 53, 9]

SDK = """
import json, statistics, sys, time
import numpy as np
import tinker
from tinker import types

spec = json.load(open(sys.argv[1]))
service = tinker.ServiceClient()
training = service.create_lora_training_client(
    base_model="demo", rank=spec["rank"], seed=spec["seed"]).result()
data = [types.Datum(model_input=types.ModelInput.from_ints(d["tokens"]), loss_fn_inputs={
    "target_tokens": np.array(d["targets"], dtype=np.int64),
    "logprobs": np.array(d["logprobs"], dtype=np.float32),
    "advantages": np.array(d["advantages"], dtype=np.float32)}) for d in spec["data"]]
adam = types.AdamParams(learning_rate=spec["lr"])
sampler = training.save_weights_and_get_sampling_client().result()
params = types.SamplingParams(max_tokens=8, temperature=1.0)
prompt = types.ModelInput.from_ints(spec["prompt"])

def step():
    backward = training.forward_backward(data, "importance_sampling")
    optim = training.optim_step(adam)
    backward.result(), optim.result()

def sample():
    sampler.sample(prompt, num_samples=32, sampling_params=params).result()

out = {}
for name, fn in (("step", step), ("sample", sample)):
    if name not in spec["parts"]:
        continue
    fn()
    times = []
    for _ in range(spec["repeat"]):
        start = time.perf_counter(); fn(); times.append(time.perf_counter() - start)
    out[name] = statistics.median(times)
print(json.dumps(out))
"""


def _data() -> list[dict[str, Any]]:
    rng = random.Random(0)
    data = []
    for _ in range(32):
        tokens = PROMPT + [rng.randrange(3, 90) for _ in range(8)]
        n = len(PROMPT) - 1
        data.append(
            {
                "tokens": tokens[:-1],
                "targets": tokens[1:],
                "logprobs": [0.0] * n + [-4.5] * 8,
                "advantages": [0.0] * n + [rng.choice([-1.0, 1.0])] * 8,
            }
        )
    return data


def _in_process(base: Path, data: list[dict[str, Any]]) -> dict[str, float]:
    from app.tinker import spec, trainer
    from app.tinker.spec import DEFAULT_ADAM
    from app.tinker.wire import Datum, Tensor

    policy = trainer.load_policy(str(base), spec.Lora(rank=RANK, seed=SEED), "cpu")
    datums = [
        Datum(d["tokens"], {k: Tensor(_array(k, d[v]), [len(d[v])]) for k, v in KEYS.items()})
        for d in data
    ]
    adam = {**DEFAULT_ADAM, "learning_rate": LR}

    def step() -> None:
        with policy.lock:
            trainer.forward_backward(policy, datums, "importance_sampling", {}, backward=True)
            trainer.optim_step(policy, adam)

    def sample() -> None:
        with policy.lock:
            policy.sample(
                PROMPT, n=32, max_tokens=8, temperature=1.0, top_p=1.0, top_logprobs=0,
                stop_ids=set(), seed=None,
            )  # fmt: skip

    parts = (("step", step), ("sample", sample))
    return {name: _median(fn) for name, fn in parts if name in PARTS}


KEYS = {"target_tokens": "targets", "logprobs": "logprobs", "advantages": "advantages"}


def _array(key: str, values: list[float]) -> Any:
    import numpy as np

    return np.array(values, dtype=np.int64 if key == "target_tokens" else np.float32)


def _median(fn: Any) -> float:
    fn()
    times = []
    for _ in range(REPEAT):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run() -> dict[str, float]:
    if not PYTHON.exists():
        report("tinker", [("skipped", f"no {PYTHON}: make .venv-tinker/.installed")])
        return {}
    data = _data()
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.json"
        body = {"rank": RANK, "seed": SEED, "lr": LR, "prompt": PROMPT, "repeat": REPEAT}
        body["parts"] = PARTS
        spec_file.write_text(json.dumps({**body, "data": data}))
        env = {
            "TRAINYARD_DATA_DIR": tmp,
            "TRAINYARD_API_KEYS": KEY,
            "TRAINYARD_DEMO_MODEL": "true",
        }
        with server(env, worker=True) as (url, _):
            sdk_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            sdk_env |= {"TINKER_BASE_URL": f"{url}/tinker", "TINKER_API_KEY": KEY}
            ran = subprocess.run(
                [str(PYTHON), "-c", SDK, str(spec_file)],
                env=sdk_env,
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
        sdk = json.loads(ran.stdout.strip().splitlines()[-1])
        # In a worker thread, as the server runs each operation (`asyncio.to_thread`): torch's
        # intra-op threads contend differently on the main thread of a busy 2-core machine
        # (there the same step measured 10x slower than in a thread).
        with ThreadPoolExecutor(1) as pool:
            bare = pool.submit(_in_process, Path(tmp) / "tiny-model", data).result()
    ratios = {name: sdk[name] / bare[name] for name in PARTS}
    lines = []
    for name, label, goal in (
        ("step", "step (fwd_bwd 32x13 + optim)", STEP_GOAL),
        ("sample", "sample (32 x 8 tokens)", SAMPLE_GOAL),
    ):
        if name in ratios:
            took = f"{sdk[name] * 1e3:.1f} ms through the SDK, {bare[name] * 1e3:.1f} ms in-process"
            lines += [(label, took), (f"{name} ratio", f"{ratios[name]:.2f} (goal <= {goal})")]
    report("tinker: the SDK over HTTP against the same operations in-process", lines)
    return {f"{name}_ratio": ratio for name, ratio in ratios.items()}


if __name__ == "__main__":
    run()
