"""A serving pool apart from the trainers: two `trainyard serve-pool` processes (one base
model, adapters loaded by vLLM's runtime protocol) behind the gateway
(TRAINYARD_SERVING_POOLS), over real HTTP on loopback: steps the service's worker trained
served as `name@N` from the checkpoint storage (a directory, or an S3 server), loaded on a
miss, routed by affinity, a dead replica skipped, errors in OpenAI's envelope."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.backends.base import ModelSpec
from app.backends.serving_pools import rank
from app.backends.storage import Storage
from app.backends.tiny_model import make_tiny_model
from app.db import begin_write
from app.models import ModelRow
from app.settings import Settings
from tests import test_checkpoint_storage as storage_tests
from tests.backends import wait_final
from tests.processes import TRAINYARD, environment, free_port, stop, until
from tests.test_cpu_backend import register, sample

pytestmark = pytest.mark.torch
KEYS = storage_tests.KEYS
s3_endpoint = storage_tests.s3_endpoint  # the object store's fixtures
bucket = storage_tests.bucket
PROMPT = [{"role": "user", "content": "say yes"}]
GREEDY = {"messages": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": True}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("pool-models") / "tiny")


def write_step(data_dir: Path, step: int, seed: int, tiny: Path) -> Path:
    """A real adapter of the tiny model as the cpu backend lays out step `step` of
    `tests/toy` (its LoRA weights drawn from `seed`, so each step answers differently)."""
    import torch

    from app.backends.cpu_policy import Policy

    policy = Policy(str(tiny), rank=4 + step, alpha=16, seed=seed)  # ranks differ by step
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.5)
    path = data_dir / "cpu" / "tests" / "models" / "toy" / "checkpoints" / f"{step:04d}"
    path.mkdir(parents=True)
    policy.save(path, step)
    return path


def start_pools(
    data_dir: Path, tiny: Path, count: int, **env: str
) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    """`count` pool replicas of the tiny model (their URLs, processes)."""
    ports = [free_port() for _ in range(count)]
    processes = []
    for port in ports:
        environ = environment(
            Settings(data_dir=data_dir), TRAINYARD_MODEL_ROOTS=str(tiny.parent), **env
        )
        command = [TRAINYARD, "serve-pool", "--base-model", str(tiny), "--port", str(port)]
        processes.append(subprocess.Popen(command, env=environ))
    return [f"http://127.0.0.1:{port}/v1" for port in ports], processes


@pytest.fixture
def pools(tmp_path: Path, tiny_model: Path) -> Iterator[tuple[Path, list[str], list[Any]]]:
    """Two pool replicas of the tiny model over one data directory."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    replicas, processes = start_pools(data_dir, tiny_model, 2)
    try:
        yield data_dir, replicas, processes
    finally:
        for process in processes:
            stop(process)


async def _listening(urls: list[str], processes: list[Any]) -> None:
    async with httpx.AsyncClient(timeout=5) as client:

        async def up() -> bool:
            for process in processes:
                assert process.poll() is None, "a pool process exited"
            try:
                for url in urls:
                    await client.get(f"{url}/models")
            except httpx.TransportError:
                return False
            return True

        await until(up, 180, "the pool replicas")


async def _adapters(client: httpx.AsyncClient, url: str) -> set[str]:
    listed = (await client.get(f"{url}/models")).json()["data"]
    return {entry["id"] for entry in listed if entry["parent"] is not None}


def _first_logprobs(answer: httpx.Response) -> list[float]:
    assert answer.status_code == 200, answer.text
    return [t["logprob"] for t in answer.json()["choices"][0]["logprobs"]["content"]]


async def train_step(live: Any) -> int:
    """One real policy-gradient step of `toy` by the service's worker (the cpu backend),
    on answers sampled from the worker's own endpoint; the new step."""
    model = (await live.client.get("/v1/models/toy")).json()
    choices = await sample(model, n=8, max_tokens=3, seed=model["current_step"])
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
    assert done["status"] == "succeeded", done["error"]
    return int(done["result"]["final_step"])


async def test_the_gateway_serves_trained_steps_from_a_pool_of_replicas(
    serve, pools, tiny_model
) -> None:
    data_dir, replicas, processes = pools
    base = str(tiny_model)
    settings = {
        "data_dir": data_dir,
        "model_roots": [tiny_model.parent],
        "serving_pools": {base: replicas},
        "worker_enabled": True,  # it trains; the pool serves
    }
    await _listening(replicas, processes)
    async with serve(**settings) as live, httpx.AsyncClient(timeout=120) as direct:
        await register(live.client, tiny_model)
        assert [await train_step(live), await train_step(live)] == [1, 2]

        alias = await live.client.put("/v1/models/toy/aliases/stable", json={"step": 2})
        assert alias.status_code == 201, alias.text

        chat = "/openai/v1/chat/completions"
        answers = {}
        for name in ("toy@1", "toy@2", "toy", "toy@latest", "toy@stable"):
            answer = await live.client.post(chat, json={"model": name, **GREEDY}, timeout=120)
            assert answer.status_code == 200, answer.text
            answers[name] = answer
        served = {name: answer.json()["model"] for name, answer in answers.items()}
        assert served == {
            "toy@1": "toy@1",
            "toy@2": "toy@2",
            "toy": "toy@2",
            "toy@latest": "toy@2",
            "toy@stable": "toy@2",
        }
        # Each step's own adapter answered: the steps differ, `toy` is step 2.
        assert _first_logprobs(answers["toy@1"]) != _first_logprobs(answers["toy@2"])
        assert _first_logprobs(answers["toy"]) == _first_logprobs(answers["toy@2"])

        # Loaded on a miss by the protocol, each on its affinity replica only.
        held = {url: await _adapters(direct, url) for url in replicas}
        for name in ("toy@1", "toy@2"):
            home = rank(replicas, name)[0]
            assert name in held[home]
            assert all(name not in held[url] for url in replicas if url != home)
        # The pool answers the gateway's name as the gateway did.
        home = rank(replicas, "toy@2")[0]
        at_pool = await direct.post(f"{home}/chat/completions", json={"model": "toy@2", **GREEDY})
        assert _first_logprobs(at_pool) == _first_logprobs(answers["toy@2"])

        # A replica that lost an adapter (as a restarted one has) gets it loaded again.
        lost = await direct.post(f"{home}/unload_lora_adapter", json={"lora_name": "toy@2"})
        assert lost.status_code == 200
        reloaded = await live.client.post(chat, json={"model": "toy@2", **GREEDY}, timeout=120)
        assert _first_logprobs(reloaded) == _first_logprobs(answers["toy@2"])
        assert "toy@2" in await _adapters(direct, home)

        # The gateway's own errors, in OpenAI's envelope.
        for name in ("toy@3", "toy@", "toy@nonesuch"):
            refused = await live.client.post(chat, json={"model": name, **GREEDY})
            assert refused.status_code == 404, refused.text
            assert refused.json()["error"]["code"] == "model_not_found"

        # A dead replica is skipped: its names load on the next one in their ranking.
        dead = rank(replicas, "toy@1")[0]
        survivor = next(url for url in replicas if url != dead)
        processes[replicas.index(dead)].kill()
        processes[replicas.index(dead)].wait()
        again = await live.client.post(chat, json={"model": "toy@1", **GREEDY}, timeout=120)
        assert _first_logprobs(again) == _first_logprobs(answers["toy@1"])
        assert "toy@1" in await _adapters(direct, survivor)

        # A step deleted through the registry is not loaded again (404), and is unloaded
        # from the pool the next time the gateway loads a step of that model there.
        deleted = await live.client.delete("/v1/models/toy/checkpoints/1")
        assert deleted.status_code == 204, deleted.text
        assert await train_step(live) == 3
        live.app.state.gateway.pools.dead(dead)  # still dead: everything goes to the survivor
        latest = await live.client.post(chat, json={"model": "toy", **GREEDY}, timeout=120)
        assert latest.json()["model"] == "toy@3"
        held_now = await _adapters(direct, survivor)
        assert "toy@3" in held_now and "toy@1" not in held_now
        gone = await live.client.post(chat, json={"model": "toy@1", **GREEDY})
        assert gone.status_code == 404, gone.text
        assert gone.json()["error"]["code"] == "model_not_found"
        assert "No adapter found" in gone.json()["error"]["message"]

        # Every replica dead: 503 with Retry-After, in the envelope.
        processes[replicas.index(survivor)].kill()
        processes[replicas.index(survivor)].wait()
        down = await live.client.post(chat, json={"model": "toy@2", **GREEDY})
        assert down.status_code == 503, down.text
        assert down.json()["error"]["code"] == "model_unavailable"
        assert down.headers["retry-after"] == "1"


async def test_the_pool_speaks_vllms_adapter_protocol(pools, tiny_model) -> None:
    data_dir, replicas, processes = pools
    step = write_step(data_dir, 1, seed=1, tiny=tiny_model)
    url = replicas[0]
    await _listening(replicas, processes)
    async with httpx.AsyncClient(timeout=120) as client:
        load = f"{url}/load_lora_adapter"
        loaded = await client.post(load, json={"lora_name": "toy@1", "lora_path": str(step)})
        assert loaded.status_code == 200, loaded.text
        assert loaded.text == "Success: LoRA adapter 'toy@1' added successfully."
        listed = (await client.get(f"{url}/models")).json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [
            (str(tiny_model), None),
            ("toy@1", str(tiny_model)),
        ]
        base = await client.post(
            f"{url}/chat/completions", json={"model": str(tiny_model), **GREEDY}
        )
        adapted = await client.post(f"{url}/chat/completions", json={"model": "toy@1", **GREEDY})
        assert _first_logprobs(base) != _first_logprobs(adapted)

        async def refused(path: str, body: dict[str, Any], status: int, says: str) -> None:
            answer = await client.post(f"{url}{path}", json=body)
            assert answer.status_code == status, answer.text
            error = answer.json()["error"]
            assert error["code"] == status and says in error["message"], error

        again = {"lora_name": "toy@1", "lora_path": str(step)}
        await refused("/load_lora_adapter", again, 400, "has already been loaded")
        outside = {"lora_name": "x", "lora_path": str(tiny_model)}
        await refused("/load_lora_adapter", outside, 400, "not an absolute path under")
        missing = {"lora_name": "x", "lora_path": str(step.parent / "0009")}
        await refused("/load_lora_adapter", missing, 404, "No adapter found")
        await refused("/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path")
        await refused("/unload_lora_adapter", {"lora_name": "nope"}, 404, "cannot be found")
        await refused("/chat/completions", {"model": "nope", **GREEDY}, 404, "does not exist")
        bad = {"model": "toy@1", **GREEDY, "temperature": 9}
        await refused("/chat/completions", bad, 400, "temperature")

        unloaded = await client.post(f"{url}/unload_lora_adapter", json={"lora_name": "toy@1"})
        assert unloaded.status_code == 200
        await refused("/chat/completions", {"model": "toy@1", **GREEDY}, 404, "does not exist")

        # Two adapters of one rank share a policy, swapped per request; one whose files
        # were deleted meanwhile is dropped (404), not a failure.
        copy = step.with_name("0002")
        shutil.copytree(step, copy)
        for name, path in (("a", step), ("b", copy)):
            body = {"lora_name": name, "lora_path": str(path)}
            assert (await client.post(load, json=body)).status_code == 200
        for name in ("a", "b"):
            served = await client.post(f"{url}/chat/completions", json={"model": name, **GREEDY})
            assert _first_logprobs(served) == _first_logprobs(adapted)
        shutil.rmtree(step)
        await refused("/chat/completions", {"model": "a", **GREEDY}, 404, "adapter is gone")
        listed = (await client.get(f"{url}/models")).json()["data"]
        assert [m["id"] for m in listed] == [str(tiny_model), "b"]


async def test_a_pool_loads_steps_from_the_object_store(
    serve, tiny_model, tmp_path, s3_endpoint, bucket
) -> None:
    """No shared disk: the step is written to the object store (as a trainer writes it),
    the gateway names its `s3://` URL, the pool fetches it into its own cache."""
    from app.backends.checkpoints import CheckpointDirs
    from app.backends.storage import Shelf

    url = f"s3://{bucket}/fleet"
    s3 = {
        "checkpoint_url": url,
        "checkpoint_s3_endpoint": s3_endpoint,
        "checkpoint_s3_region": "us-east-1",
        **KEYS,
    }
    trainer = Storage(Settings(data_dir=tmp_path / "trainer", **s3))
    assert trainer.store is not None and trainer.cache is not None
    dirs = CheckpointDirs(
        tmp_path / "trainer" / "cpu", shelf=Shelf(trainer.store, "cpu", trainer.cache)
    )
    spec = ModelSpec("toy", "tests", str(tiny_model), {})
    with dirs.writing(spec, 1) as partial:
        shutil.copytree(
            write_step(tmp_path / "scratch", 1, 1, tiny_model), partial, dirs_exist_ok=True
        )
    env = {f"TRAINYARD_{key.upper()}": value for key, value in s3.items()}
    replicas, processes = start_pools(tmp_path / "pool", tiny_model, 1, **env)
    try:
        await _listening(replicas, processes)
        settings = {
            "data_dir": tmp_path / "api",
            "model_roots": [tiny_model.parent],
            "serving_pools": {str(tiny_model): replicas},
            **s3,
        }
        async with serve(**settings) as live, httpx.AsyncClient(timeout=120) as direct:
            body = {
                "name": "toy",
                "project": "tests",
                "base_model": str(tiny_model),
                "backend": "cpu",
            }
            assert (await live.client.post("/v1/models", json=body)).status_code == 201
            async with live.app.state.sessions() as session:
                await begin_write(session)
                row = await session.get(ModelRow, "toy")
                row.current_step = 1
                await session.commit()
            answer = await live.client.post(
                "/openai/v1/chat/completions", json={"model": "toy", **GREEDY}, timeout=120
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "toy@1"
            listed = (await direct.get(f"{replicas[0]}/models")).json()["data"]
            assert listed[1] == {
                **listed[1],
                "id": "toy@1",
                "root": f"{url}/cpu/tests/models/toy/checkpoints/0001",
            }
            assert (
                tmp_path
                / "pool"
                / "checkpoint-cache"
                / "cpu"
                / "tests"
                / "models"
                / "toy"
                / "checkpoints"
                / "0001"
                / "adapter_model.safetensors"
            ).is_file()
            # A pool on an object store reads nothing else.
            local = {"lora_name": "x", "lora_path": str(tmp_path / "scratch")}
            refused = await direct.post(f"{replicas[0]}/load_lora_adapter", json=local)
            assert refused.status_code == 400, refused.text
            assert "reads checkpoints from" in refused.json()["error"]["message"]
            elsewhere = {"lora_name": "x", "lora_path": f"s3://{bucket}/other/cpu/p/0001"}
            refused = await direct.post(f"{replicas[0]}/load_lora_adapter", json=elsewhere)
            assert refused.status_code == 400, refused.text
    finally:
        for process in processes:
            stop(process)


def test_bad_pool_settings_and_options_are_refused_naming_them(tmp_path, tiny_model) -> None:
    env = environment(Settings(data_dir=tmp_path), TRAINYARD_MODEL_ROOTS=str(tiny_model.parent))
    cases = [
        (["serve-pool", "--base-model", str(tmp_path / "nowhere")], {}, "--base-model"),
        (["serve-pool", "--base-model", "relative/dir"], {}, "--base-model"),
        (["migrate"], {"TRAINYARD_SERVING_POOLS": '{"m": ["ftp://x"]}'}, "SERVING_POOLS"),
        (["migrate"], {"TRAINYARD_SERVING_POOLS": '{"m": []}'}, "SERVING_POOLS"),
        (["migrate"], {"TRAINYARD_SERVING_POOLS": "[1]"}, "SERVING_POOLS"),
    ]
    for args, extra, named in cases:
        done = subprocess.run(
            [TRAINYARD, *args], env={**env, **extra}, capture_output=True, timeout=120
        )
        assert done.returncode == 2, (args, extra, done.stderr)
        assert named in done.stderr.decode(), done.stderr
        assert b"Traceback" not in done.stderr
