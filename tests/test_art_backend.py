"""`TrainyardBackend` (clients/python, `trainyard_client.art_backend`): a real ART program
(openpipe-art as installed: 0.5.18 on Python 3.11) trains through a live server whose
worker runs the cpu backend. The README's "ART programs" section runs as written, in a
fresh interpreter; the rest drives the backend as ART does, through `art.TrainableModel`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice

pytestmark = [
    pytest.mark.any_database,
    pytest.mark.torch,
]  # the cpu backend trains behind the server

art = pytest.importorskip("art")

from tests.conftest import LiveServer  # noqa: E402
from tests.test_readme import README, fenced_blocks  # noqa: E402
from trainyard_client import AsyncTrainyard, AuthenticationError, ValidationError  # noqa: E402
from trainyard_client.art_backend import JobFailedError, TrainyardBackend  # noqa: E402

SECTION = "## ART programs"
ADDRESS = "http://localhost:8000"
KEY = "art-users-key"  # the servers here have API keys: every call must send it


def program() -> tuple[str, int]:
    text = README.read_text()
    start = text.index(f"\n{SECTION}\n")
    end = text.index("\n## ", start + 1)
    (block,) = [b for b in fenced_blocks(text[start:end]) if b.language == "python"]
    return "\n".join(block.lines), text[:start].count("\n") + 1 + block.line


# openpipe-art 0.5.23 needs Python 3.12: `make .venv-art` builds that interpreter's venv
# (ART without torch, and trainyard-client) beside the Python 3.11 one that runs the tests.
ART_0523 = Path(__file__).parent.parent / ".venv-art" / "bin" / "python"
INTERPRETERS = {"openpipe-art 0.5.18": Path(sys.executable), "openpipe-art 0.5.23": ART_0523}


def _run(code: str, cwd: Path, python: Path, **variables: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "OPENAI_"))}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # ART imports litellm: no fetch offline
    env.update(variables)
    return subprocess.run(
        [str(python), "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


# Where the key comes from: both versions take it from the environment; how the backend
# gets it does not depend on ART's version, so the argument and no key at all (a server
# without keys, as `make run` starts it) run on one version each.
KEY_CASES = [
    ("openpipe-art 0.5.18", "environment"),
    ("openpipe-art 0.5.18", "argument"),
    ("openpipe-art 0.5.23", "environment"),
    ("openpipe-art 0.5.23", "none"),
]


@pytest.mark.parametrize(("art_version", "key_from"), KEY_CASES)
async def test_the_readme_program_trains_a_step_and_samples_it(
    serve: Callable[..., LiveServer], tmp_path: Path, art_version: str, key_from: str
) -> None:
    """The README's program, on a server with API keys: the key given only in
    `TRAINYARD_API_KEY`, or only as `api_key=`, reaches every call, ART's OpenAI client
    (`model.openai_client()`, which samples through the gateway) included; and as written,
    with no key, on a server without keys."""
    python = INTERPRETERS[art_version]
    if not python.exists():
        if os.environ.get("CI"):
            raise AssertionError(f"{python} is missing: CI builds it (make .venv-art)")
        pytest.skip(f"{python} is missing: make .venv-art builds it")
    version = subprocess.run(
        [
            str(python),
            "-c",
            "from importlib.metadata import version; print(version('openpipe-art'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert art_version == f"openpipe-art {version}"
    code, line = program()
    code = code.replace(ADDRESS, "{url}")
    if art_version.endswith("0.5.23"):  # as the README says: 0.5.23 also takes run_name
        code = code.replace('project="demo",', 'project="demo", run_name="art-agent-1",')
    assert code.count("{url}") == 1
    assert ("run_name" in code) == art_version.endswith("0.5.23")
    variables = {"TRAINYARD_API_KEY": KEY} if key_from == "environment" else {}
    if key_from == "argument":
        made = 'TrainyardBackend("{url}", trainer="cpu")'
        assert code.count(made) == 1
        code = code.replace(made, f'TrainyardBackend("{{url}}", api_key="{KEY}", trainer="cpu")')
    keys = {} if key_from == "none" else {"api_keys": KEY}
    async with serve(worker_enabled=True, demo_model=True, **keys) as live:
        if keys:
            live.client.headers["Authorization"] = f"Bearer {KEY}"
        program_code = code.replace("{url}", live.url)
        ran = await asyncio.to_thread(_run, program_code, tmp_path, python, **variables)
        assert ran.returncode == 0, f"README.md:{line}\n{ran.stdout}\n{ran.stderr}"
        model = (await live.client.get("/v1/models/art-agent")).json()
        jobs = (await live.client.get("/v1/training-jobs?model=art-agent")).json()["data"]
    printed = ran.stdout.splitlines()
    assert printed[0].startswith("step 1 loss "), printed
    float(printed[0].split()[-1])  # the step's loss, a number
    assert printed[1] == "sampled True"
    assert model["current_step"] == 1 and model["backend"] == "cpu"
    (job,) = jobs
    assert job["status"] == "succeeded"
    assert job["summary"]["num_groups"] == 2 and job["summary"]["num_trajectories"] == 8
    assert job["hyperparameters"]["learning_rate"] == 0.01


async def _sample(model: Any, prompt: str) -> Any:
    messages = [{"role": "user", "content": prompt}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, logprobs=True, max_tokens=6
    )
    choice = completion.choices[0]
    return completion, art.Trajectory(
        messages_and_choices=[*messages, choice], reward=len(set(choice.message.content or ""))
    )


async def _groups(model: Any) -> list[Any]:
    groups = []
    for prompt in ("a", "b"):
        sampled = await asyncio.gather(*(_sample(model, prompt) for _ in range(4)))
        groups.append(art.TrajectoryGroup([trajectory for _, trajectory in sampled]))
    return groups


async def _base_model(url: str) -> str:
    async with AsyncTrainyard(url, api_key=KEY) as client:
        return (await client.models.get("demo")).base_model


async def _registered(live: LiveServer, name: str, **options: Any) -> tuple[Any, Any]:
    """A backend on the live server, and a model of `name` registered with it (a copy of
    the demo's tiny model, created on the cpu backend)."""
    backend = TrainyardBackend(live.url, KEY, trainer="cpu", **options)
    model = art.TrainableModel(name=name, project="p", base_model=await _base_model(live.url))
    await model.register(backend)
    return backend, model


async def test_train_returns_arts_result_and_the_gateway_serves_the_new_step(
    serve: Callable[..., LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRAINYARD_API_KEY", raising=False)  # the key is the argument
    async with serve(worker_enabled=True, demo_model=True, api_keys=KEY) as live:
        live.client.headers["Authorization"] = f"Bearer {KEY}"
        seen: list[str] = []
        backend = TrainyardBackend(
            live.url,
            api_key=KEY,
            trainer="cpu",
            metadata={"experiment": "art"},
            on_progress=lambda p: seen.append(p.event.type),
        )
        model = art.TrainableModel(
            name="art-b", project="p", base_model=await _base_model(live.url)
        )
        await model.register(backend)
        assert model.inference_base_url == f"{live.url}/openai/v1"
        assert model.inference_api_key == KEY  # ART's OpenAI client sends the user's key
        assert await model.get_step() == 0
        before, _ = await _sample(model, "a")
        result = await backend.train(model, await _groups(model), learning_rate=0.01)
        assert isinstance(result, art.TrainResult)
        assert result.step == 1 == await model.get_step()
        assert all(isinstance(v, float) for v in result.metrics.values())
        assert "loss/train" in result.metrics
        assert seen[0] == "job_queued" and seen[-1] == "training_ended"
        after, _ = await _sample(model, "a")
        assert (before.model, after.model) == ("art-b@0", "art-b@1")
        # ART names a past step `name@N`; the gateway serves it.
        old = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(step=0),
            messages=[{"role": "user", "content": "a"}],
            max_tokens=2,
        )
        assert old.model == "art-b@0"
        jobs = (await live.client.get("/v1/training-jobs?model=art-b")).json()["data"]
        assert [j["metadata"] for j in jobs] == [{"experiment": "art"}]

        # Registering again finds the model (through a client given to the backend, whose
        # key ART's OpenAI client takes); another base model by that name is refused.
        async with AsyncTrainyard(live.url, api_key=KEY) as client:
            await model.register(TrainyardBackend(client=client))
            assert model.inference_api_key == KEY
            again = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=[{"role": "user", "content": "a"}]
            )
            assert again.model == "art-b@1"
        other = art.TrainableModel(name="art-b", project="p", base_model="elsewhere")
        with pytest.raises(ValueError, match="has base model"):
            await other.register(TrainyardBackend(live.url, KEY))
        # A model the server lacks, and no trainer to create it on: said, not guessed.
        missing = art.TrainableModel(name="art-c", project="p", base_model="x")
        with pytest.raises(ValueError, match="pass trainer="):
            await missing.register(TrainyardBackend(live.url, KEY))
        # Without a key the server refuses at the first call, as it does the OpenAI client.
        with pytest.raises(AuthenticationError):
            await model.register(TrainyardBackend(live.url))
        await backend.close()


async def test_bad_hyperparameters_are_refused_before_anything_is_submitted(
    serve: Callable[..., LiveServer],
) -> None:
    async with serve(worker_enabled=True, demo_model=True, api_keys=KEY) as live:
        live.client.headers["Authorization"] = f"Bearer {KEY}"
        backend, model = await _registered(live, "art-h")
        groups = await _groups(model)
        with pytest.raises(ValidationError) as refused:
            await backend.train(model, groups, learning_rate=0.01, no_such_knob=3)
        assert any("no_such_knob" in path for path in refused.value.paths), refused.value.paths
        # ART's `verbose` says how to print, not how to train: it is not sent.
        result = await backend.train(model, groups, learning_rate=0.01, verbose=True)
        assert result.step == 1
        (job,) = (await live.client.get("/v1/training-jobs?model=art-h")).json()["data"]
        assert "verbose" not in job["hyperparameters"]
        await backend.close()


async def test_a_cancelled_job_raises_with_the_job(serve: Callable[..., LiveServer]) -> None:
    # No worker: the job stays queued until it is cancelled from elsewhere.
    async with serve(demo_model=True) as live:
        backend, model = await _registered(live, "art-x")
        groups = [
            art.TrajectoryGroup(
                [
                    art.Trajectory(messages_and_choices=[*_prompt(), _choice("a", -0.5)], reward=1),
                    art.Trajectory(messages_and_choices=[*_prompt(), _choice("b", -0.7)], reward=0),
                ]
            )
        ]
        training = asyncio.create_task(backend.train(model, groups, learning_rate=0.01))

        async def queued() -> str | None:
            data = (await live.client.get("/v1/training-jobs?model=art-x")).json()["data"]
            return data[0]["id"] if data else None

        job_id = None
        for _ in range(200):
            if job_id := await queued():
                break
            await asyncio.sleep(0.05)
        assert job_id is not None
        assert (await live.client.post(f"/v1/training-jobs/{job_id}/cancel")).status_code == 200
        with pytest.raises(JobFailedError) as failed:
            await asyncio.wait_for(training, 30)
        assert failed.value.job.id == job_id and failed.value.job.status == "cancelled"
        await backend.close()


def _prompt() -> list[dict[str, str]]:
    return [{"role": "user", "content": "a"}]


def _choice(text: str, logprob: float) -> Any:
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": text},
            "logprobs": {
                "content": [{"token": "token_id:7", "logprob": logprob, "top_logprobs": []}]
            },
        }
    )


async def test_checkpoints_are_deleted_through_the_registry_and_a_lease_holds_a_step(
    serve: Callable[..., LiveServer],
) -> None:
    async with serve(worker_enabled=True, demo_model=True, api_keys=KEY) as live:
        live.client.headers["Authorization"] = f"Bearer {KEY}"
        backend, model = await _registered(live, "art-d")
        for _ in range(3):
            await backend.train(model, await _groups(model), learning_rate=0.01)

        async def steps() -> list[int]:
            page = (await live.client.get("/v1/models/art-d/checkpoints?limit=100")).json()
            return sorted(c["step"] for c in page["data"])

        assert await steps() == [0, 1, 2, 3]
        async with backend.exact_adapter_lease(model, 1):
            aliases = (await live.client.get("/v1/models/art-d/aliases")).json()["data"]
            leased = [a for a in aliases if a["alias"].startswith("lease-")]
            assert [a["step"] for a in leased] == [1]
            # ART keeps the latest and the best; the leased step stays too.
            await backend._delete_checkpoint_files(model, [3])
            assert await steps() == [1, 3]
        aliases = (await live.client.get("/v1/models/art-d/aliases")).json()["data"]
        assert not [a for a in aliases if a["alias"].startswith("lease-")]
        await backend._delete_checkpoint_files(model, [3])
        assert await steps() == [3]
        await backend.close()


def test_an_art_local_model_can_publish_to_an_external_vllm() -> None:
    """openpipe-art 0.5.23's `vllm_runtime` (a vLLM someone else runs, such as a serving
    pool) goes through an art-local model's config into ART's `_internal_config`."""
    if not ART_0523.exists():
        pytest.skip("`make .venv-art` builds openpipe-art 0.5.23's environment")
    code = textwrap.dedent(
        """
        from app.backends import SPECS, validate_config
        from app.backends.base import ModelSpec

        runtime = {
            "mode": "external",
            "server_url": "http://pool-a:8000",
            "local_checkpoint_root": "/data/art",
            "server_checkpoint_root": "/mnt/art",
        }
        config = validate_config("art-local", {"vllm_runtime": runtime})
        model = SPECS["art-local"].trainable_model(ModelSpec("m", "p", "b", {}), config)
        assert model._internal_config["vllm_runtime"] == runtime, model._internal_config
        print("passed through")
        """
    )
    root = Path(__file__).parent.parent
    done = _run(code, root, ART_0523, PYTHONPATH=f"{root}:{root / 'clients/python/src'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("passed through")


async def test_an_art_programs_train_sft_runs_as_a_trainyard_sft_job(
    serve: Callable[..., LiveServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`model.train_sft`, ART's supervised entry point, unchanged: one SFT job whose
    gradient steps ART reads as its backend's metrics; the model's step advances."""
    monkeypatch.chdir(tmp_path)  # ART logs the step's metrics under ./.art
    async with serve(worker_enabled=True, demo_model=True, api_keys=KEY) as live:
        live.client.headers["Authorization"] = f"Bearer {KEY}"
        backend, model = await _registered(live, "art-sft", metadata={"phase": "sft"})
        chats = [
            art.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": f"what is the weather {word}"},
                    {"role": "assistant", "content": "sunny"},
                ],
            )
            for word in ("today", "one", "two", "three", "four")
        ]
        config = art.TrainSFTConfig(learning_rate=0.02, batch_size=2)
        await model.train_sft(chats, config)
        assert await model.get_step() == 1
        # What ART's loop reads from the backend: each gradient step's metrics, live.
        seen = [m async for m in backend._train_sft(model, chats[:2], config, {})]
        assert len(seen) == 1 and seen[0]["loss/train"] > 0
        jobs = (await live.client.get("/v1/training-jobs?model=art-sft")).json()["data"]
        with pytest.raises(ValueError, match="one learning_rate per job"):
            per_batch = art.TrainSFTConfig(learning_rate=[0.01, 0.02])
            await model.train_sft(chats, per_batch)
        await backend.close()
    assert [j["method"] for j in jobs] == ["sft", "sft"]
    first = jobs[-1]
    assert first["status"] == "succeeded" and first["result"]["final_step"] == 1
    assert first["summary"]["num_examples"] == 5
    assert first["hyperparameters"] == {"learning_rate": 0.02, "batch_size": 2}
    assert first["metadata"] == {"phase": "sft"}
    assert first["progress"]["total"] == 3  # five chats, two a gradient step
    assert jobs[0]["result"]["final_step"] == 2


SFT_PROGRAM = """
import asyncio, art
from trainyard_client.art_backend import TrainyardBackend

async def main():
    backend = TrainyardBackend("{url}", trainer="cpu")
    model = art.TrainableModel(name="sft-0523", project="p", run_name="sft-0523",
                               base_model="{base}")
    await model.register(backend)
    chats = [art.Trajectory(messages_and_choices=[
        {{"role": "user", "content": "what is the weather " + w}},
        {{"role": "assistant", "content": "sunny"}}]) for w in ("one", "two", "three")]
    await model.train_sft(chats, art.TrainSFTConfig(learning_rate=0.02, assistant_turns="last"))
    print("step", await model.get_step())
    await backend.close()

asyncio.run(main())
"""


async def test_train_sft_on_openpipe_art_0523(
    serve: Callable[..., LiveServer], tmp_path: Path
) -> None:
    """The same entry point on openpipe-art 0.5.23 (Python 3.12), which adds
    `assistant_turns` to `TrainSFTConfig` and logs each gradient step's metrics."""
    python = INTERPRETERS["openpipe-art 0.5.23"]
    if not python.exists():
        if os.environ.get("CI"):
            raise AssertionError(f"{python} is missing: CI builds it (make .venv-art)")
        pytest.skip(f"{python} is missing: make .venv-art builds it")
    async with serve(worker_enabled=True, demo_model=True) as live:
        code = SFT_PROGRAM.format(url=live.url, base=await _base_model(live.url))
        ran = await asyncio.to_thread(_run, code, tmp_path, python)
        assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr}"
        (job,) = (await live.client.get("/v1/training-jobs?model=sft-0523")).json()["data"]
    assert ran.stdout.splitlines()[-1] == "step 1"
    assert job["method"] == "sft" and job["status"] == "succeeded"
    assert job["hyperparameters"] == {"learning_rate": 0.02, "assistant_turns": "last"}
