"""The cpu reference backend through the service: real sampling with logprobs from its
endpoint, trajectories posted back, real policy-gradient steps on a tiny local model."""

from __future__ import annotations

import functools
import logging
import math
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from app.backends.tiny_model import make_tiny_model
from app.db import create_engine
from app.main import create_app
from app.models import ModelRow
from tests.backends import wait_final
from tests.conftest import LiveServer
from tests.processes import start_worker, stop, until

pytestmark = pytest.mark.torch
PROMPT = [{"role": "user", "content": "say yes"}]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def serve(serve: Callable[..., LiveServer], tiny_model: Path) -> Callable[..., LiveServer]:
    """The service, allowed to load the tiny model (TRAINYARD_MODEL_ROOTS)."""
    return functools.partial(serve, model_roots=[tiny_model.parent])


async def register(client: httpx.AsyncClient, base: Path, name: str = "toy") -> dict:
    body = {"name": name, "project": "tests", "base_model": str(base), "backend": "cpu"}
    assert (await client.post("/v1/models", json=body)).status_code == 201

    async def served() -> dict:
        return (await client.get(f"/v1/models/{name}")).json()

    for _ in range(200):  # the worker registers it with the backend in the background
        model = await served()
        if model["inference_base_url"]:
            return model
        import asyncio

        await asyncio.sleep(0.05)
    raise AssertionError("the model was never served")


async def sample(model: dict, n: int, key: str | None = None, **params) -> list[dict]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(
        base_url=model["inference_base_url"], headers=headers, timeout=30
    ) as client:
        response = await client.post(
            "/chat/completions",
            json={
                "model": model["inference_model_name"],
                "messages": PROMPT,
                "n": n,
                "logprobs": True,
                "top_logprobs": 2,
                **params,
            },
        )
    assert response.status_code == 200, response.text
    return response.json()["choices"]


def groups_of(choices: list[dict], target: str = "yes") -> tuple[list[dict], float]:
    rewards = [1.0 if c["message"]["content"].strip() == target else 0.0 for c in choices]
    group = {
        "trajectories": [
            {"messages_and_choices": [*PROMPT, choice], "reward": reward}
            for choice, reward in zip(choices, rewards, strict=True)
        ]
    }
    return [group], sum(rewards) / len(rewards)


async def test_sample_train_and_serve_the_new_step(serve, tiny_model) -> None:
    async with serve(worker_enabled=True) as live:
        model = await register(live.client, tiny_model)
        assert model["inference_model_name"] == "toy@0"
        choices = await sample(model, n=8, max_tokens=3, seed=1)
        first = choices[0]["logprobs"]["content"][0]
        assert first["token"].startswith("token_id:")
        assert math.isfinite(first["logprob"]) and first["logprob"] <= 0
        assert len(first["top_logprobs"]) == 2
        assert first["top_logprobs"][0]["logprob"] >= first["top_logprobs"][1]["logprob"]

        probe = {"temperature": 0, "max_tokens": 1}
        before = (await sample(model, n=1, **probe))[0]["logprobs"]["content"][0]
        groups = [
            {
                "trajectories": [
                    {"messages_and_choices": [*PROMPT, c], "reward": float(i % 2)}
                    for i, c in enumerate(choices)
                ]
            }
        ]
        job = await live.client.post(
            "/v1/training-jobs",
            json={"model": "toy", "groups": groups, "hyperparameters": {"learning_rate": 0.05}},
        )
        assert job.status_code == 202, job.text
        done = await wait_final(live.client, job.json()["id"])
        model = (await live.client.get("/v1/models/toy")).json()
        after = (await sample(model, n=1, **probe))[0]["logprobs"]["content"][0]
        past = await sample_status(model, "toy@0")  # its checkpoint is kept: served
        missing = await sample_status(model, "toy@7")

    assert done["status"] == "succeeded", done["error"]
    assert done["result"]["final_step"] == 1
    assert done["progress"] == {"step": 1, "total": 1, "percent": 100.0}
    assert Path(done["result"]["checkpoint_path"], "adapter_model.safetensors").exists()
    assert model["current_step"] == 1 and model["inference_model_name"] == "toy@1"
    assert after["logprob"] != pytest.approx(before["logprob"], abs=1e-6)
    assert (past, missing) == (200, 404)


async def test_its_models_take_the_torch_threads_the_settings_give(serve, tiny_model) -> None:
    """TRAINYARD_CPU_THREADS reaches the worker's torch: a thread started after the model
    is loaded (as the backend's sampling and training threads are) takes that many."""
    import threading

    import torch

    def in_a_new_thread() -> int:
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        return seen[0]

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert in_a_new_thread() == 3
        async with serve(worker_enabled=True, cpu_threads=2) as live:
            await register(live.client, tiny_model)
            assert in_a_new_thread() == 2
    finally:
        torch.set_num_threads(before)


async def test_a_token_outside_the_vocabulary_fails_the_job_saying_so(serve, tiny_model) -> None:
    """Answers whose logprobs name a token the model does not have (sampled from another
    model, or made up) fail the job with a reason, not torch's IndexError."""
    async with serve(worker_enabled=True) as live:
        model = await register(live.client, tiny_model)
        choices = await sample(model, n=2, max_tokens=2, seed=1)
        choices[0]["logprobs"]["content"][0]["token"] = "token_id:99999999999"
        group = {
            "trajectories": [
                {"messages_and_choices": [*PROMPT, c], "reward": float(i)}
                for i, c in enumerate(choices)
            ]
        }
        job = await live.client.post("/v1/training-jobs", json={"model": "toy", "groups": [group]})
        assert job.status_code == 202, job.text
        done = await wait_final(live.client, job.json()["id"])
    assert done["status"] == "failed", done
    assert done["error"]["type"] == "ValueError" and not done["error"]["transient"], done["error"]
    assert "token_id:99999999999" in done["error"]["message"]
    assert "outside the model's vocabulary" in done["error"]["message"]


async def sample_status(model: dict, name: str) -> int:
    async with httpx.AsyncClient(base_url=model["inference_base_url"]) as client:
        response = await client.post("/chat/completions", json={"model": name, "messages": PROMPT})
    return response.status_code


async def test_rollouts_and_steps_learn_the_rewarded_answer(serve, tiny_model) -> None:
    """The toy task: the reward is 1 when the one-token answer is "yes"."""
    async with serve(worker_enabled=True) as live:
        model = await register(live.client, tiny_model, name="learner")
        means = []
        for _ in range(25):
            choices = await sample(model, n=32, max_tokens=1, temperature=1.0)
            groups, mean = groups_of(choices)
            means.append(mean)
            if mean > 0.8:
                break
            job = await live.client.post(
                "/v1/training-jobs",
                json={
                    "model": "learner",
                    "groups": groups,
                    "hyperparameters": {"learning_rate": 0.02},
                },
            )
            assert job.status_code == 202, job.text
            assert (await wait_final(live.client, job.json()["id"]))["status"] == "succeeded"
            model = (await live.client.get("/v1/models/learner")).json()
        fresh = await sample(model, n=64, max_tokens=1, temperature=1.0)
    assert means[0] < 0.3, means
    _, final = groups_of(fresh)
    assert final > 0.8, [*means, final]


async def test_progress_and_a_step_with_nothing_to_learn(serve, tiny_model) -> None:
    async with serve(worker_enabled=True) as live:
        model = await register(live.client, tiny_model)
        choices = await sample(model, n=6, max_tokens=2)
        varied = [
            {
                "trajectories": [
                    {"messages_and_choices": [*PROMPT, c], "reward": r}
                    for c, r in zip(choices[i : i + 2], (0.0, 1.0), strict=True)
                ]
            }
            for i in (0, 2, 4)
        ]
        flat = [
            {
                "trajectories": [
                    {"messages_and_choices": [*PROMPT, c], "reward": 0.5} for c in choices
                ]
            }
        ]
        one = await live.client.post("/v1/training-jobs", json={"model": "toy", "groups": varied})
        two = await live.client.post("/v1/training-jobs", json={"model": "toy", "groups": flat})
        trained = await wait_final(live.client, one.json()["id"])
        skipped = await wait_final(live.client, two.json()["id"])
        events = (await live.client.get(f"/v1/training-jobs/{one.json()['id']}/events")).json()
    steps = [
        (e["data"]["step"], e["data"]["total"])
        for e in events["data"]
        if e["type"] == "gradient_step"
    ]
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert trained["result"]["metrics"]["data/step_num_groups_trainable"] == 3
    assert skipped["status"] == "succeeded"
    assert skipped["summary"]["untrainable_groups"] == [0]
    assert skipped["result"]["final_step"] == 2  # advanced, like ART, though nothing trained
    assert skipped["result"]["metrics"]["data/step_num_gradient_steps"] == 0


async def test_cpu_hyperparameters_and_config_are_checked(serve, tiny_model) -> None:
    async with serve() as live:
        body = {
            "name": "toy",
            "base_model": str(tiny_model),
            "backend": "cpu",
            "config": {"lora_rank": 0},
        }
        bad_config = await live.client.post("/v1/models", json=body)
        body["config"] = {}
        await live.client.post("/v1/models", json=body)
        bad = await live.client.post(
            "/v1/training-jobs",
            json={
                "model": "toy",
                "groups": [{"trajectories": []}],
                "hyperparameters": {"loss_fn": "cispo"},
            },
        )
    assert bad_config.status_code == 422
    assert bad_config.json()["errors"][0]["path"] == "config.lora_rank"
    assert bad.status_code == 422
    assert "hyperparameters.loss_fn" in [e["path"] for e in bad.json()["errors"]]


async def test_the_demo_model_is_ready_at_start(serve) -> None:
    async with serve(worker_enabled=True, demo_model=True) as live:
        for _ in range(200):
            demo = (await live.client.get("/v1/models/demo")).json()
            if demo.get("inference_base_url"):
                break
            import asyncio

            await asyncio.sleep(0.05)
        choices = await sample(demo, n=1, max_tokens=2)
    assert demo["backend"] == "cpu" and demo["inference_model_name"] == "demo@0"
    assert choices[0]["logprobs"]["content"]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("level", ["info", "debug"])
async def test_the_api_keeps_its_access_log_once_a_cpu_model_is_served(
    make_settings, tiny_model, level
) -> None:
    # As `trainyard serve` logs: uvicorn's access lines at info. The cpu backend's own
    # server starts in the same process once a model is served, and must leave them be.
    settings = make_settings(worker_enabled=True, model_roots=[tiny_model.parent])
    access = logging.getLogger("uvicorn.access")
    lines = _Lines()
    async with LiveServer(create_app(settings), log_level=level) as live:
        access.addHandler(lines)
        try:
            await live.client.get("/healthz?before")
            model = await register(live.client, tiny_model)
            # The cpu backend's server answers too, at its own endpoint (which the API does
            # not hand out: the model JSON names the gateway).
            inside, key = await _served_at(settings.database_url, model["name"])
            assert inside != model["inference_base_url"]
            await sample({**model, "inference_base_url": inside}, n=1, key=key, max_tokens=1)
            await live.client.get("/healthz?after")
            await live.client.post("/v1/nothing?after")
        finally:
            access.removeHandler(lines)
    assert any("/healthz?before" in line for line in lines.lines)
    assert any("GET /healthz?after" in line and "200" in line for line in lines.lines)
    assert any("POST /v1/nothing?after" in line and "404" in line for line in lines.lines)
    # The model endpoint's requests are not mixed into the API's access log.
    assert not any("/chat/completions" in line for line in lines.lines)
    assert access.isEnabledFor(logging.INFO)


async def test_a_gateway_without_a_worker_forwards_with_the_key_the_worker_recorded(
    make_settings, tiny_model
) -> None:
    """An API process without a worker forwards to the endpoint a `trainyard worker`
    process serves the model at, with the model's key that worker recorded beside it; the
    endpoint answers nobody without that key."""
    settings = make_settings(model_roots=[tiny_model.parent])
    env = {"TRAINYARD_MODEL_ROOTS": str(tiny_model.parent), "TRAINYARD_WORKER_BACKENDS": "cpu"}
    worker = start_worker(settings, **env)
    try:
        async with LiveServer(create_app(settings)) as live:
            body = {"name": "toy", "project": "tests", "base_model": str(tiny_model)}
            assert (await live.client.post("/v1/models", json=body | {"backend": "cpu"})).is_success

            async def served() -> dict:  # once the worker process serves it
                model = (await live.client.get("/v1/models/toy")).json()
                return model if model["inference_base_url"] else {}

            model = await until(served, what="the worker process to serve the model")
            answer = await live.client.post(
                "/openai/v1/chat/completions",
                json={"model": "toy", "messages": PROMPT, "max_tokens": 1, "logprobs": True},
            )
            inside, key = await _served_at(settings.database_url, model["name"])
            async with httpx.AsyncClient(base_url=inside, timeout=30) as direct:
                bare = await direct.get("/models")
                wrong = await direct.get("/models", headers={"authorization": "Bearer tycpu_x"})
                mine = await direct.get("/models", headers={"authorization": f"Bearer {key}"})
    finally:
        stop(worker)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["logprobs"]["content"]
    assert (bare.status_code, wrong.status_code) == (401, 401)
    assert bare.json()["error"]["code"] == "invalid_api_key"
    assert [m["id"] for m in mine.json()["data"]] == ["toy@0"]


async def _served_at(database_url: str, name: str) -> tuple[str, str]:
    """Where the backend itself serves the model, and the key it takes for it, as the
    worker recorded them."""
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            row = (await conn.execute(select(ModelRow).where(ModelRow.name == name))).one()
    finally:
        await engine.dispose()
    assert row.inference_base_url and row.inference_api_key
    return str(row.inference_base_url), str(row.inference_api_key)


# Run in a fresh interpreter, as a worker is: huggingface_hub answers "is X installed?" on
# first use, and those first answers are the ones threads raced for.
_SAVE_AT_ONCE = textwrap.dedent(
    """
    import importlib.metadata, sys, threading
    from pathlib import Path
    from app.backends.cpu_policy import Policy
    import huggingface_hub.utils as hub

    base, out = Path(sys.argv[1]), Path(sys.argv[2])
    built = {}
    barrier = threading.Barrier(6)

    def build(seed):
        barrier.wait()
        built[seed] = Policy(str(base), rank=2, alpha=4, seed=seed)

    threads = [threading.Thread(target=build, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    policies = [built[seed] for seed in range(6)]
    for seed in (0, 5):  # built at once, each drew its own seed's first weights
        alone = Policy(str(base), rank=2, alpha=4, seed=seed).model.state_dict()
        for name, tensor in policies[seed].model.state_dict().items():
            assert (tensor == alone[name]).all(), (seed, name)
    errors = []

    def save(i, policy):
        barrier.wait()
        try:
            policy.save(out / f"model-{i}", 1)
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=save, args=pair) for pair in enumerate(policies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    saved = sorted(p.parent.name for p in out.glob("model-*/adapter_model.safetensors"))
    assert saved == [f"model-{i}" for i in range(6)], saved
    # what the loader and the export read, and no model card (peft's README.md)
    files = sorted(p.name for p in (out / "model-0").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"], files

    def unreachable(name):
        raise AssertionError(f"looked {name} up after import")

    importlib.metadata.version = unreachable  # every answer was settled at import
    assert hub.is_jinja_available() and hub.is_torch_available()
    print("saved", len(saved))
    """
)


def test_models_built_and_saved_at_the_same_moment_in_threads(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Models registered at once are built in threads at once, and two models training in
    one worker save their adapters at once. Each is built from its own seed, and every save
    succeeds and writes the adapter's two files. The first save of a process once failed
    in one thread ("ModelCard.from_template requires Jinja2", Jinja2 installed):
    huggingface_hub had cached "missing" before the version."""
    result = subprocess.run(
        [sys.executable, "-c", _SAVE_AT_ONCE, str(tiny_model), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "saved 6"
