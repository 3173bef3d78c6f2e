"""The adapter over `art.Backend`, and what each backend accepts or refuses."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from app.backends import SPECS
from app.backends.base import BackendError, classify
from app.backends.hyperparameters import ArtLocalHyperparameters, ArtServerlessHyperparameters
from app.training.service import hyperparameters_of
from tests import factories as f
from tests.backends import wait_final


def art_train_keywords(module: str, cls: str) -> set[str]:
    """The keyword-only parameters of `cls.train` in the installed openpipe-art source."""
    spec = importlib.util.find_spec("art")
    assert spec is not None and spec.origin is not None
    tree = ast.parse((Path(spec.origin).parent / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.AsyncFunctionDef) and item.name == "train":
                    return {a.arg for a in item.args.kwonlyargs} - {"verbose"}
    raise AssertionError(f"{cls}.train not found in {module}")


# The hyperparameter models are the API's contract and mirror openpipe-art 0.5.18. Later
# releases' `train()` takes every keyword of 0.5.18's and more; the API does not offer
# these (a job must run on either release), so each release's additions are named here:
# a keyword that appears in ART or disappears from it still fails the comparison.
NOT_OFFERED = {
    "0.5.18": {"LocalBackend": set(), "ServerlessBackend": set()},
    "0.5.23": {
        "LocalBackend": {
            "kl_penalty_source",
            "optimizer_save_interval",
            "final_training_step",
            "grad_accumulation_sequences",
        },
        "ServerlessBackend": {
            *ArtLocalHyperparameters.model_fields.keys()
            - ArtServerlessHyperparameters.model_fields.keys(),
            "kl_penalty_source",
            "kl_penalty_step_lag",
            "optimizer_save_interval",
        },
    },
}


def not_offered(cls: str) -> set[str]:
    from importlib.metadata import version

    installed = version("openpipe-art")
    if installed not in NOT_OFFERED:
        raise AssertionError(f"openpipe-art {installed}: compare its train() keywords anew")
    return NOT_OFFERED[installed][cls]


def test_art_local_hyperparameters_match_localbackend_train() -> None:
    assert set(ArtLocalHyperparameters.model_fields) | not_offered(
        "LocalBackend"
    ) == art_train_keywords("local/backend.py", "LocalBackend")


def test_art_serverless_hyperparameters_match_serverlessbackend_train() -> None:
    assert set(ArtServerlessHyperparameters.model_fields) | not_offered(
        "ServerlessBackend"
    ) == art_train_keywords("serverless/backend.py", "ServerlessBackend")


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ConnectionRefusedError(111, "refused"), True),
        (TimeoutError(), True),
        (httpx.ConnectTimeout("slow"), True),
        (OSError("network unreachable"), True),
        (ValueError("bad token ids"), False),
        (KeyError("role"), False),
        (BackendError("x", transient=True), True),
    ],
)
def test_backend_errors_are_transient_or_permanent(error: BaseException, transient: bool) -> None:
    assert classify(error).transient is transient


@pytest.mark.parametrize(
    ("backend", "hyperparameters", "bad"),
    [
        ("cpu", {"learning_rate": 1e-3, "kl_penalty_coef": 0.1}, {"ppo": True}),
        ("art-local", {"loss_fn": "ppo", "kl_penalty_coef": 0.1}, {"ppo": True}),
        ("art-serverless", {"ppo": True, "learning_rate": 1e-5}, {"kl_penalty_coef": 0.1}),
        ("dry-run", {"loss_fn": "cispo"}, {"lr": 1}),
    ],
)
def test_each_backend_takes_its_own_hyperparameters(backend, hyperparameters, bad) -> None:
    model = SPECS[backend].hyperparameters
    model.model_validate(hyperparameters)
    with pytest.raises(ValueError, match=next(iter(bad))):
        model.model_validate(bad)


@pytest.mark.parametrize("backend", ["cpu", "art-local", "art-serverless", "dry-run"])
@pytest.mark.parametrize(
    ("given", "path"),
    [
        ({"learning_rate": "0.1"}, "hyperparameters.learning_rate"),
        ({"scale_rewards": "yes"}, "hyperparameters.scale_rewards"),
        ({"scale_rewards": 1}, "hyperparameters.scale_rewards"),
    ],
)
def test_an_ill_typed_hyperparameter_is_refused_not_coerced(backend, given, path) -> None:
    """A string is no number and 1 no boolean: each backend refuses them, naming the field,
    where the lax parse stored 0.1 and true."""
    accepted, errors = hyperparameters_of(backend, given)
    assert accepted == {} and [".".join(map(str, e["loc"])) for e in errors] == [path]
    assert hyperparameters_of(backend, {"learning_rate": 1})[0] == {"learning_rate": 1.0}


async def test_backends_are_listed_with_their_schemas(live) -> None:
    backends = {b["name"]: b for b in (await live.client.get("/v1/backends")).json()}
    assert set(backends) == {"dry-run", "cpu", "art-local", "art-serverless"}
    assert "learning_rate" in backends["cpu"]["hyperparameters"]["properties"]
    assert "ppo" in backends["art-serverless"]["hyperparameters"]["properties"]
    assert "lora_rank" in backends["cpu"]["config"]["properties"]


async def test_art_local_config_keys_are_arts_internal_config(live) -> None:
    body = {
        "name": "big",
        "base_model": "Qwen/Qwen2.5-7B-Instruct",
        "backend": "art-local",
        "config": {"init_args": {"max_seq_length": 8192}, "engine": {}},
    }
    response = await live.client.post("/v1/models", json=body)
    assert response.status_code == 422
    assert "engine" in response.json()["errors"][0]["message"]
    body["config"] = {"init_args": {"max_seq_length": 8192}}
    assert (await live.client.post("/v1/models", json=body)).status_code == 201


@pytest.mark.parametrize("backend", ["dry-run", "cpu", "art-serverless"])
async def test_a_config_key_a_backend_does_not_know_is_422_and_stores_nothing(
    live, backend
) -> None:
    body = {"name": "typo", "base_model": "b", "backend": backend, "config": {"zzz": 1}}
    response = await live.client.post("/v1/models", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["path"] == "config.zzz"
    assert (await live.client.get("/v1/models/typo")).status_code == 404


@pytest.mark.parametrize(
    ("backend", "message"),
    [("art-local", "CUDA GPU"), ("art-serverless", "WANDB_API_KEY")],
)
async def test_backends_that_cannot_run_here_fail_the_job_clearly(
    serve, monkeypatch, backend, message
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    # Told to run it (a worker not told runs only the backends it can load: the job would
    # wait, see test_pools.py), the worker fails the job clearly.
    async with serve(worker_enabled=True, worker_backends=[backend]) as live:
        await live.client.post(
            "/v1/models",
            json={"name": "m", "base_model": "Qwen/Qwen2.5-0.5B-Instruct", "backend": backend},
        )
        job = (await f.submit(live.client, model="m")).json()
        done = await wait_final(live.client, job["id"])
    assert done["status"] == "failed"
    assert done["attempts"] == 1  # permanent: not retried
    assert done["error"]["transient"] is False
    assert message in done["error"]["message"]


async def test_a_worker_not_told_its_backends_runs_those_it_can_load(serve, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    async with serve(worker_enabled=True) as live:
        assert live.app.state.worker.capabilities.backends == ("dry-run", "cpu")
        await live.client.post(
            "/v1/models", json={"name": "m", "base_model": "b", "backend": "art-serverless"}
        )
        job = (await f.submit(live.client, model="m")).json()
        assert (
            job["waiting_for"] == "no live worker in pool `default` runs backend `art-serverless`"
        )


@pytest.mark.torch
async def test_make_tiny_model_command_writes_a_loadable_chat_model(tmp_path) -> None:
    trainyard = str(Path(sys.executable).parent / "trainyard")
    process = await asyncio.create_subprocess_exec(
        trainyard, "make-tiny-model", str(tmp_path / "tiny")
    )
    assert await process.wait() == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tiny", local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", local_files_only=True)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "say yes"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|assistant|> ")
    assert model.config.vocab_size == len(tokenizer)
    assert subprocess.run([trainyard, "--help"], capture_output=True).returncode == 0
