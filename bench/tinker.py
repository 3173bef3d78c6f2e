"""Tinker's operations through the SDK against the same operations in-process.

measured: through the Tinker SDK (tinker 0.38.0, `.venv-tinker`) against `trainyard serve`
(the `demo` tiny model, SQLite, keys on): a training step, `forward_backward` of 32 datums
of 13 tokens (`importance_sampling`) and `optim_step`, both sent before either is awaited
(as the cookbook does); and `sample` of 32 completions, of 8 tokens and of 64.
Baseline: the same operations on a policy of the same model, LoRA rank and seed in this
process, in a worker thread as the server runs them (`app.tinker.trainer`: forward_backward
+ optim_step; `Policy.sample`: bare generation), same run, same data.
The two sides take turns, one operation each, REPEAT times after one uncounted turn each
(the SDK's program waits for its next operation on stdin), so a machine whose load drifts
slows both alike. Medians compared.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import report, server

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
KEY = "tml-bench-key"
REPEAT = int(os.environ.get("BENCH_TINKER_REPEAT", "10"))
# Which parts to measure: `step`, `sample` or both (a sample alone samples weights equal to
# the run's own: no step has moved them). A sample of 8 tokens shows what a call costs on
# top of its generation; one of 64, a generation of some length.
PARTS = [p for p in os.environ.get("BENCH_TINKER_PARTS", "step,sample").split(",") if p]
SAMPLE_TOKENS = (8, 64)
OPERATIONS = [
    *(["step"] if "step" in PARTS else []),
    *([f"sample:{t}" for t in SAMPLE_TOKENS] if "sample" in PARTS else []),
]
STEP_GOAL, SAMPLE_GOAL = 1.3, 1.2
PAUSE = 0.5  # seconds before each timed operation
RANK, SEED, LR = 8, 0, 1e-3
PROMPT = [47, 45, 43, 53, 9]

SDK = """
import json, sys, time
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
prompt = types.ModelInput.from_ints(spec["prompt"])

def step():
    backward = training.forward_backward(data, "importance_sampling")
    optim = training.optim_step(adam)
    backward.result(), optim.result()

def sample(tokens):
    params = types.SamplingParams(max_tokens=tokens, temperature=1.0)
    sampler.sample(prompt, num_samples=32, sampling_params=params).result()

print("ready", flush=True)
for line in sys.stdin:  # an operation's name; its seconds are printed back
    name, _, tokens = line.strip().partition(":")
    start = time.perf_counter()
    step() if name == "step" else sample(int(tokens))
    print(time.perf_counter() - start, flush=True)
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


def _in_process(base: Path, data: list[dict[str, Any]]) -> dict[str, Callable[[], None]]:
    """The operations on a policy in this process, by name (as `OPERATIONS` names them)."""
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

    def sample(tokens: int) -> Callable[[], None]:
        def generate() -> None:
            with policy.lock:
                policy.sample(
                    PROMPT, n=32, max_tokens=tokens, temperature=1.0, top_p=1.0,
                    top_logprobs=0, stop_ids=set(), seed=None,
                )  # fmt: skip

        return generate

    return {"step": step, **{f"sample:{t}": sample(t) for t in SAMPLE_TOKENS}}


KEYS = {"target_tokens": "targets", "logprobs": "logprobs", "advantages": "advantages"}


def _array(key: str, values: list[float]) -> Any:
    import numpy as np

    return np.array(values, dtype=np.int64 if key == "target_tokens" else np.float32)


class _Sdk:
    """The SDK's program, one operation at a time (`SDK`)."""

    def __init__(self, spec_file: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [str(PYTHON), "-c", SDK, str(spec_file)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the SDK's program ended (exit {self.process.wait()})")
        return line.strip()

    def time(self, operation: str) -> float:
        assert self.process.stdin is not None
        self.process.stdin.write(operation + "\n")
        self.process.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(60)


def _turns(sdk: _Sdk, bare: dict[str, Callable[[], None]]) -> dict[str, tuple[float, float]]:
    """Each operation REPEAT times on each side, taking turns after one uncounted turn
    each: the medians (through the SDK, in-process)."""
    with ThreadPoolExecutor(1) as pool:

        def in_process(operation: str) -> float:
            def timed() -> float:
                start = time.perf_counter()
                bare[operation]()
                return time.perf_counter() - start

            return pool.submit(timed).result()

        def pair(operation: str) -> tuple[float, float]:
            # A pause before each: torch's threads on one side spin a while after their work,
            # on the same two cores as the other side's next operation.
            time.sleep(PAUSE)
            through = sdk.time(operation)
            time.sleep(PAUSE)
            return through, in_process(operation)

        medians = {}
        for operation in OPERATIONS:
            pair(operation)
            pairs = [pair(operation) for _ in range(REPEAT)]
            medians[operation] = (
                statistics.median(p[0] for p in pairs),
                statistics.median(p[1] for p in pairs),
            )
    return medians


def run() -> dict[str, float]:
    if not PYTHON.exists():
        report("tinker", [("skipped", f"no {PYTHON}: make .venv-tinker/.installed")])
        return {}
    data = _data()
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.json"
        body = {"rank": RANK, "seed": SEED, "lr": LR, "prompt": PROMPT, "data": data}
        spec_file.write_text(json.dumps(body))
        env = {
            "TRAINYARD_DATA_DIR": tmp,
            "TRAINYARD_API_KEYS": KEY,
            "TRAINYARD_DEMO_MODEL": "true",
        }
        with server(env, worker=True) as (url, _):
            sdk_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            sdk_env |= {"TINKER_BASE_URL": f"{url}/tinker", "TINKER_API_KEY": KEY}
            sdk = _Sdk(spec_file, sdk_env)
            try:
                # In a worker thread, as the server runs each operation (`asyncio.to_thread`):
                # torch's intra-op threads contend differently on the main thread of a busy
                # 2-core machine (there the same step measured 10x slower than in a thread).
                medians = _turns(sdk, _in_process(Path(tmp) / "tiny-model", data))
            finally:
                sdk.close()
    lines, figures = [], {}
    for operation, (through, bare) in medians.items():
        tokens = operation.partition(":")[2]
        label = f"sample (32 x {tokens} tokens)" if tokens else "step (fwd_bwd 32x13 + optim)"
        goal = SAMPLE_GOAL if tokens else STEP_GOAL
        ratio = through / bare
        figures[f"sample_{tokens}_ratio" if tokens else "step_ratio"] = ratio
        took = f"{through * 1e3:.1f} ms through the SDK, {bare * 1e3:.1f} ms in-process"
        lines += [(label, took), ("  ratio", f"{ratio:.2f} (goal <= {goal})")]
    report(f"tinker: the SDK over HTTP and in-process, taking turns ({REPEAT} each)", lines)
    return figures


if __name__ == "__main__":
    run()
