"""End to end on a CUDA host: ART's LocalBackend through Trainyard's adapter.

Registers a model (ART starts vLLM), samples completions with logprobs from its endpoint,
trains one step on them, samples from the new step, and prints each timing. Needs the gpu
extra (`pip install '.[gpu]'`, or the docker/Dockerfile.gpu image) and network access on
first start (ART provisions its vLLM runtime with uv). It was never run on the machines
this project is built on, which have no GPU.

    python scripts/art_local_smoke.py --base-model Qwen/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import os

# litellm (imported by ART) fetches a model-cost map from the internet at import time
# unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import argparse
import asyncio
import time

import art
from openai import AsyncOpenAI

from app.backends import Backends
from app.backends.base import ModelSpec
from app.settings import Settings


async def main(base_model: str, data_dir: str) -> None:
    adapter = Backends(Settings(data_dir=data_dir)).get("art-local")
    spec = ModelSpec("gpu-smoke", "trainyard", base_model, {"init_args": {"max_seq_length": 4096}})
    timings: dict[str, float] = {}

    start = time.perf_counter()
    inference = await adapter.inference(spec)  # register + vLLM up
    timings["register + serve"] = time.perf_counter() - start
    model = await adapter.model(spec)
    client = AsyncOpenAI(base_url=inference.base_url, api_key=model.inference_api_key or "x")
    prompt = [{"role": "user", "content": "Name a prime number between 10 and 20."}]

    start = time.perf_counter()
    completion = await client.chat.completions.create(
        model=inference.model_name,
        messages=prompt,
        n=8,
        max_tokens=16,
        logprobs=True,  # type: ignore[arg-type]
        temperature=1.0,
    )
    timings["sample 8 completions"] = time.perf_counter() - start
    group = art.TrajectoryGroup(
        [
            art.Trajectory(
                messages_and_choices=[*prompt, choice],  # type: ignore[list-item]
                reward=float(
                    any(p in (choice.message.content or "") for p in ("11", "13", "17", "19"))
                ),
            )
            for choice in completion.choices
        ]
    )

    start = time.perf_counter()
    outcome = await adapter.train(
        spec,
        [group],
        {"learning_rate": 1e-5},
        on_progress=lambda step, total, _: print(f"  step {step}/{total}"),
    )
    timings["train one step"] = time.perf_counter() - start

    after = await adapter.inference(spec)
    start = time.perf_counter()
    await client.chat.completions.create(model=after.model_name, messages=prompt, max_tokens=16)  # type: ignore[arg-type]
    timings["sample from the new step"] = time.perf_counter() - start

    print(f"step {inference.step} -> {outcome.step}; metrics: {outcome.metrics}")
    for name, seconds in timings.items():
        print(f"{name:>26}: {seconds:8.2f} s")
    await adapter.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--data-dir", default="var/gpu-smoke")
    args = parser.parse_args()
    asyncio.run(main(args.base_model, args.data_dir))
