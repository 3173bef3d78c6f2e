"""The cpu backend's training step on the tiny model.

measured: `CpuBackend.train` on one group of 32 sampled 8-token completions (tokenizing,
advantages, the gradient step, the checkpoint write). Baseline: a bare forward + backward
pass of the same policy over the same sequences, in the same run.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import art
from openai.types.chat.chat_completion import Choice

from app.backends.cpu import CpuBackend, CpuConfig
from app.backends.tiny_model import make_tiny_model
from bench.common import report

GOAL = 1.25
PROMPT = [{"role": "user", "content": "what is the weather today ?"}]


async def run(repeat: int = 5) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        base = make_tiny_model(Path(tmp) / "tiny")
        backend = CpuBackend(Path(tmp) / "cpu", model_roots=[Path(tmp)])
        model = art.TrainableModel(
            name="bench", project="bench", base_model=str(base), config=CpuConfig()
        )
        await backend.register(model)
        _, policy = backend.served["bench"]
        prompt = policy.encode_prompt(PROMPT)
        samples = policy.sample(
            prompt,
            n=32,
            max_tokens=8,
            temperature=1.0,
            top_p=1.0,
            top_logprobs=0,
            stop_ids=set(),
            seed=0,
        )
        trajectories = []
        for i, s in enumerate(samples):
            choice = Choice.model_validate(
                {
                    "index": 0,
                    "finish_reason": s.finish_reason,
                    "message": {
                        "role": "assistant",
                        "content": policy.tokenizer.decode(s.token_ids),
                    },
                    "logprobs": {
                        "content": [
                            {
                                "token": f"token_id:{t}",
                                "logprob": lp,
                                "bytes": None,
                                "top_logprobs": [],
                            }
                            for t, lp in zip(s.token_ids, s.logprobs, strict=True)
                        ]
                    },
                }
            )
            trajectories.append(
                art.Trajectory(messages_and_choices=[*PROMPT, choice], reward=float(i % 2))
            )
        group = art.TrajectoryGroup(trajectories)
        turns = policy.sequences([group], scale_rewards=True, allow_without_logprobs=False)[0]

        def forward_backward() -> None:
            policy.model.zero_grad()
            for turn in turns:
                policy._completion_logprobs(turn).sum().backward()

        baseline, measured = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            forward_backward()
            baseline.append(time.perf_counter() - start)
            start = time.perf_counter()
            await backend.train(model, [group], learning_rate=1e-4)
            measured.append(time.perf_counter() - start)
        await backend.close()
    b, m = statistics.median(baseline), statistics.median(measured)
    report(
        "cpu backend: one training step, tiny model, 32 completions of 8 tokens",
        [
            ("baseline: bare forward + backward", f"{b * 1000:.0f} ms (median of {repeat})"),
            ("CpuBackend.train (step + checkpoint)", f"{m * 1000:.0f} ms (median of {repeat})"),
            ("ratio train / forward+backward", f"{m / b:.2f}x (goal <= {GOAL}x)"),
        ],
    )
    return {"cpu_step_ms": m * 1000}


if __name__ == "__main__":
    asyncio.run(run())
