"""Supervised fine-tuning and DPO as training jobs, through the service over real HTTP, on
the cpu backend's real torch steps on the tiny model: what each is given, what it reports
per gradient step, and what it changes in the model (measured on held-out prompts from the
checkpoints the jobs wrote, loaded into a fresh policy)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.backends.tiny_model import make_tiny_model
from tests.backends import wait_final
from tests.conftest import LiveServer

pytestmark = pytest.mark.torch

TRAIN = [
    f"what is the weather {w}"
    for w in ("today", "in the city", "one", "two", "three", "four", "five", "six")
]
HELD_OUT = ["what is the weather seven", "how is the weather", "weather today please"]


def chat(prompt: str, answer: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    }


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def serve(serve: Callable[..., LiveServer], tiny_model: Path) -> Callable[..., LiveServer]:
    return functools.partial(serve, model_roots=[tiny_model.parent])


@pytest.fixture(scope="module")
def step_zero(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A policy like the backend's (same adapter seed), built once, and its step 0 saved."""
    from app.backends.cpu_policy import Policy

    policy = Policy(str(tiny_model), rank=8, alpha=16, seed=0)
    saved = tmp_path_factory.mktemp("step-zero")
    policy.save(saved, 0)
    return policy, saved


@pytest.fixture
def policy(step_zero: tuple[Any, Path]) -> Any:
    """The policy at step 0 for each test (a test loads the steps its jobs wrote into it:
    the next one, the same test on the other dialect included, starts from step 0 again)."""
    policy, saved = step_zero
    policy.load(saved, 0)
    return policy


async def register(client: httpx.AsyncClient, base: Path, name: str, backend: str = "cpu") -> None:
    body = {"name": name, "project": "tests", "base_model": str(base), "backend": backend}
    assert (await client.post("/v1/models", json=body)).status_code == 201


async def submit(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/v1/training-jobs", json=body)
    assert response.status_code == 202, response.text
    return response.json()


async def gradient_steps(client: httpx.AsyncClient, job_id: str) -> list[dict[str, Any]]:
    events = (await client.get(f"/v1/training-jobs/{job_id}/events")).json()["data"]
    return [e["data"] for e in events if e["type"] == "gradient_step"]


def mean_logprob(policy: Any, answer: str) -> float:
    scores = [policy.answer_logprob([{"role": "user", "content": q}], answer) for q in HELD_OUT]
    return sum(scores) / len(scores)


def mean_margin(policy: Any, chosen: str, rejected: str) -> float:
    prompts = [{"role": "user", "content": q} for q in HELD_OUT]
    return sum(
        policy.answer_logprob([p], chosen) - policy.answer_logprob([p], rejected) for p in prompts
    ) / len(prompts)


def load(policy: Any, job: dict[str, Any]) -> None:
    policy.load(Path(job["result"]["checkpoint_path"]), job["result"]["final_step"])


async def test_sft_raises_the_target_answers_logprob_on_held_out_prompts(
    serve, tiny_model, policy
) -> None:
    before = mean_logprob(policy, "sunny")
    async with serve(worker_enabled=True) as live:
        await register(live.client, tiny_model, "sft")
        body = {
            "model": "sft",
            "method": "sft",
            "examples": [chat(q, "sunny") for q in TRAIN],
            "hyperparameters": {"learning_rate": 0.02, "batch_size": 4},
            "metadata": {"phase": "warm-up"},
        }
        job = await submit(live.client, body)
        assert job["method"] == "sft"
        assert job["summary"] == {
            "method": "sft",
            "num_examples": 8,
            "num_target_turns": 8,
            "dataset": None,
        }
        done = await wait_final(live.client, job["id"])
        steps = await gradient_steps(live.client, job["id"])
        model = (await live.client.get("/v1/models/sft")).json()
        refused = await live.client.get(f"/v1/training-jobs/{job['id']}/trajectories")
    assert done["status"] == "succeeded", done["error"]
    assert done["result"]["start_step"] == 0 and done["result"]["final_step"] == 1
    assert done["result"]["trained"] is True
    assert model["current_step"] == 1
    assert done["progress"] == {"step": 2, "total": 2, "percent": 100.0}
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["metrics"]["loss/train"] > 0 for s in steps)
    assert refused.status_code == 409
    load(policy, done)
    after = mean_logprob(policy, "sunny")
    assert after > before + 1.0, (before, after)


async def test_sft_reads_examples_from_a_dataset_split(serve, tiny_model) -> None:
    lines = [{"id": i, "split": "sft", **chat(q, "rainy")} for i, q in enumerate(TRAIN[:4])]
    lines.append({"id": "prompt-only", "messages": [{"role": "user", "content": "hi"}]})
    async with serve(worker_enabled=True) as live:
        await register(live.client, tiny_model, "ds")
        upload = await live.client.post(
            "/v1/datasets?name=sft-chats",
            content=b"\n".join(json.dumps(line).encode() for line in lines),
            headers={"Content-Type": "application/jsonl"},
        )
        assert upload.status_code == 201, upload.text
        dataset = upload.json()["id"]
        job = await submit(
            live.client,
            {"model": "ds", "method": "sft", "dataset": {"id": dataset, "split": "sft"}},
        )
        done = await wait_final(live.client, job["id"])
        # The train split holds a line with no assistant turn: refused, naming it.
        bad = await live.client.post(
            "/v1/training-jobs",
            json={"model": "ds", "method": "sft", "dataset": {"id": dataset}},
        )
        missing = await live.client.post(
            "/v1/training-jobs",
            json={"model": "ds", "method": "sft", "dataset": {"id": "ds_nope", "split": "x"}},
        )
        jobs = (await live.client.get("/v1/training-jobs?model=ds")).json()["data"]
    assert done["status"] == "succeeded", done["error"]
    assert done["summary"]["num_examples"] == 4 and done["summary"]["dataset"] == dataset
    assert bad.status_code == 422
    (error,) = bad.json()["errors"]
    assert error["path"] == "dataset" and "'prompt-only'" in error["message"]
    assert missing.status_code == 422
    assert [e["path"] for e in missing.json()["errors"]] == ["dataset.id"]
    assert [j["id"] for j in jobs] == [job["id"]]  # nothing else was stored


def nat_dpo_collection() -> dict[str, Any]:
    """What NAT's DPO trajectory builder emits: trajectories of `DPOItem`s."""
    return {
        "run_id": "nemo_dpo_1a2b3c4d",
        "trajectories": [
            [
                {
                    "episode": [
                        {
                            "prompt": [{"role": "user", "content": q}] if i % 2 else q,
                            "chosen_response": "yes",
                            "rejected_response": "no",
                        }
                    ],
                    "reward": 0.5,
                    "shaped_rewards": None,
                    "metadata": {"id": i},
                }
                for i, q in enumerate(TRAIN)
            ]
        ],
    }


async def test_dpo_raises_the_preference_margin_on_held_out_pairs(
    serve, tiny_model, policy
) -> None:
    from app.backends.cpu_policy import Policy

    fresh = Policy(str(tiny_model), rank=8, alpha=16, seed=0)
    before = mean_margin(fresh, "yes", "no")
    async with serve(worker_enabled=True) as live:
        await register(live.client, tiny_model, "dpo")
        pairs = [
            {"prompt": [{"role": "user", "content": q}], "chosen": "yes", "rejected": "no"}
            for q in TRAIN
        ]
        hyperparameters = {"learning_rate": 0.02, "beta": 0.1, "batch_size": 4}
        plain = await submit(
            live.client,
            {"model": "dpo", "method": "dpo", "pairs": pairs, "hyperparameters": hyperparameters},
        )
        first = await wait_final(live.client, plain["id"])
        nat = await submit(
            live.client,
            {
                "model": "dpo",
                "method": "dpo",
                "collection": nat_dpo_collection(),
                "hyperparameters": {**hyperparameters, "reference": "base"},
            },
        )
        second = await wait_final(live.client, nat["id"])
        steps = await gradient_steps(live.client, plain["id"]) + await gradient_steps(
            live.client, nat["id"]
        )
    assert first["status"] == "succeeded", first["error"]
    assert second["status"] == "succeeded", second["error"]
    assert plain["summary"] == {"method": "dpo", "num_pairs": 8}
    assert nat["summary"] == {"method": "dpo", "num_pairs": 8}
    assert second["result"]["final_step"] == 2
    assert len(steps) == 4
    for step in steps:
        assert {"loss/train", "dpo/reward_margin", "dpo/accuracy"} <= step["metrics"].keys()
    # The first step of a job against the step it starts from: no margin yet, loss log 2.
    assert abs(steps[0]["metrics"]["dpo/reward_margin"]) < 1e-6
    assert steps[1]["metrics"]["dpo/reward_margin"] > 0
    assert steps[1]["metrics"]["dpo/accuracy"] == 1.0
    assert second["result"]["metrics"]["dpo/reward_margin"] > 0  # against the base model
    load(fresh, second)
    after = mean_margin(fresh, "yes", "no")
    assert after > before + 1.0, (before, after)


async def test_bad_sft_and_dpo_bodies_name_each_field_and_store_nothing(serve, tiny_model) -> None:
    async with serve(worker_enabled=False) as live:
        await register(live.client, tiny_model, "cpu-model")
        await register(live.client, tiny_model, "dry", backend="dry-run")

        async def refused(body: dict[str, Any]) -> list[str]:
            response = await live.client.post("/v1/training-jobs", json=body)
            assert response.status_code == 422, response.text
            assert response.headers["content-type"] == "application/problem+json"
            return [e["path"] for e in response.json()["errors"]]

        assert await refused({"model": "cpu-model", "method": "ppo", "examples": []}) == ["method"]
        no_target = {"messages": [{"role": "user", "content": "hi"}]}
        assert await refused(
            {"model": "cpu-model", "method": "sft", "examples": [chat("a", "b"), no_target]}
        ) == ["examples[1]"]
        assert await refused(
            {
                "model": "cpu-model",
                "method": "sft",
                "examples": [chat("a", "b")],
                "hyperparameters": {"learning_rate": 0, "epsilon": 0.2},
            }
        ) == ["hyperparameters.learning_rate", "hyperparameters.epsilon"]
        pair = {"prompt": [{"role": "user", "content": "a"}], "chosen": "x", "rejected": "y"}
        paths = await refused(
            {
                "model": "cpu-model",
                "method": "dpo",
                "pairs": [pair, {**pair, "rejected": "x"}],
                "hyperparameters": {"beta": 0},
            }
        )
        assert paths == ["pairs[1]"]  # the body first; the keywords once it is valid
        # A message's bad role is refused at its own path, in an SFT example or a DPO prompt.
        robot = {"role": "robot", "content": "hi"}
        assert await refused(
            {
                "model": "cpu-model",
                "method": "sft",
                "examples": [chat("a", "b"), {"messages": [robot, *chat("a", "b")["messages"]]}],
            }
        ) == ["examples[1].messages[0].role"]
        assert await refused(
            {"model": "cpu-model", "method": "dpo", "pairs": [pair, {**pair, "prompt": [robot]}]}
        ) == ["pairs[1].prompt[0].role"]
        assert await refused(
            {
                "model": "cpu-model",
                "method": "dpo",
                "pairs": [pair],
                "hyperparameters": {"beta": -1},
            }
        ) == ["hyperparameters.beta"]
        many = [pair] * 10_001  # one job is one step: at most 10,000 pairs
        assert await refused({"model": "cpu-model", "method": "dpo", "pairs": many}) == ["pairs"]
        collection = nat_dpo_collection()
        collection["trajectories"][0][3]["episode"][0]["rejected_response"] = "yes"
        assert await refused({"model": "cpu-model", "method": "dpo", "collection": collection}) == [
            "collection.trajectories[0][3].episode[0].rejected_response"
        ]
        collection = nat_dpo_collection()
        collection["trajectories"][0][1]["episode"][0]["prompt"][0]["role"] = "robot"
        assert await refused({"model": "cpu-model", "method": "dpo", "collection": collection}) == [
            "collection.trajectories[0][1].episode[0].prompt[0].role"
        ]
        response = await live.client.post(
            "/v1/training-jobs", json={"model": "dry", "method": "dpo", "pairs": [pair]}
        )
        assert response.status_code == 422
        (error,) = response.json()["errors"]
        assert error["path"] == "method" and "no weights" in error["message"]
        jobs = (await live.client.get("/v1/training-jobs")).json()["data"]
        backends = {b["name"]: b for b in (await live.client.get("/v1/backends")).json()}
    assert jobs == []
    assert set(backends["cpu"]["methods"]) == {"sft", "dpo"}
    assert "beta" in backends["cpu"]["methods"]["dpo"]["properties"]
    assert set(backends["art-local"]["methods"]) == {"sft"}


def test_sft_trains_on_assistant_turns_only_all_or_the_last(policy) -> None:
    """Each assistant turn is a target after the context it answers; with
    `assistant_turns=last`, the last one only. Nothing else is a target."""
    import art

    chat_ = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "weather"},
            {"role": "assistant", "content": "sunny today"},
        ]
    )
    first, second = policy.sft_turns(chat_)
    eos = policy.eos_id
    assert first.completion_ids == [
        *policy.tokenizer("hello", add_special_tokens=False)["input_ids"],
        eos,
    ]
    assert second.completion_ids[-1] == eos and len(second.completion_ids) == 3
    # The second target's prompt is the whole chat before it, its first answer included.
    context = chat_.messages_and_choices[:4]
    assert second.prompt_ids == policy.encode_prompt(context)
    (last,) = policy.sft_turns(chat_, "last")
    assert last == second
