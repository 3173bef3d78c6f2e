"""The checkpoint registry on the real cpu backend: real steps on the tiny model, real HTTP,
SQLite and Postgres. List, delete (and its refusals), aliases (at the gateway too),
retention after each step and on demand, and an export that PEFT loads."""

from __future__ import annotations

import asyncio
import io
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from app.backends.base import ModelSpec
from app.backends.dry_run import DryRunBackend
from app.backends.tiny_model import make_tiny_model
from tests.backends import wait_final, wait_status

pytestmark = pytest.mark.torch
PROMPT = [{"role": "user", "content": "say yes"}]
PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("checkpoint-models") / "tiny")


def _gateway(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/openai/v1", api_key="none", max_retries=0)


async def _register(client: httpx.AsyncClient, base: Path, name: str = "toy") -> None:
    body = {"name": name, "project": "tests", "base_model": str(base), "backend": "cpu"}
    response = await client.post("/v1/models", json=body)
    assert response.status_code in (200, 201), response.text
    for _ in range(200):  # the worker registers it (writing step 0) in the background
        if (await client.get(f"/v1/models/{name}")).json()["inference_base_url"]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the model was never served")


async def _train(live: Any, name: str = "toy", **extra: Any) -> dict:
    """One real step: four sampled answers, the first rewarded."""
    answers = await _gateway(live.url).chat.completions.create(
        model=name, messages=PROMPT, n=4, max_tokens=1, logprobs=True, temperature=1.0
    )
    group = {
        "trajectories": [
            {
                "messages_and_choices": [*PROMPT, choice.model_dump(mode="json")],
                "reward": 1.0 if i == 0 else 0.0,
            }
            for i, choice in enumerate(answers.choices)
        ]
    }
    body = {"model": name, "groups": [group], "hyperparameters": {"learning_rate": 0.05}}
    response = await live.client.post("/v1/training-jobs", json={**body, **extra})
    assert response.status_code == 202, response.text
    job = await wait_final(live.client, response.json()["id"])
    assert job["status"] == "succeeded", job
    return job


def _problem(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    return response.json()


def _field_errors(problem: dict) -> list[tuple[str, str, str]]:
    return [(e["location"], e["path"], e["type"]) for e in problem["errors"]]


def _checkpoints_dir(data_dir: Path, name: str = "toy") -> Path:
    return data_dir / "cpu" / "tests" / "models" / name / "checkpoints"


def _on_disk(data_dir: Path, name: str = "toy") -> list[int]:
    return sorted(int(p.name) for p in _checkpoints_dir(data_dir, name).iterdir())


async def _eventually_on_disk(data_dir: Path, expected: list[int]) -> None:
    """Wait for the worker's retention, which runs right after the job's final write."""
    for _ in range(200):
        if _on_disk(data_dir) == expected:
            return
        await asyncio.sleep(0.05)
    assert _on_disk(data_dir) == expected


def _best(metric: dict[int, float], among: Any) -> int:
    """Lowest value; the newest of equals."""
    return min((s for s in metric if s in among), key=lambda s: (metric[s], -s))


async def test_list_alias_and_delete_checkpoints(serve, tiny_model, tmp_path) -> None:
    async with serve(worker_enabled=True, model_roots=[tiny_model.parent]) as live:
        client = live.client
        await _register(client, tiny_model)
        jobs = [await _train(live) for _ in range(3)]
        assert [j["result"]["final_step"] for j in jobs] == [1, 2, 3]

        page = await client.get("/v1/models/toy/checkpoints")
        assert page.status_code == 200, page.text
        listed = page.json()
        assert listed["has_more"] is False and listed["next_cursor"] is None
        assert [c["step"] for c in listed["data"]] == [3, 2, 1, 0]
        by_step = {c["step"]: c for c in listed["data"]}
        assert by_step[3]["aliases"] == ["latest"]
        assert by_step[0]["job_id"] is None and by_step[0]["metrics"] is None
        for job in jobs:
            checkpoint = by_step[job["result"]["final_step"]]
            assert checkpoint["job_id"] == job["id"]
            assert checkpoint["metrics"] == job["result"]["metrics"]
            assert checkpoint["validation_metrics"] is None
            # adapter + optimizer state, every file counted
            files = _checkpoints_dir(tmp_path / "data") / f"{checkpoint['step']:04d}"
            assert checkpoint["size_bytes"] == sum(f.stat().st_size for f in files.iterdir())

        first = (await client.get("/v1/models/toy/checkpoints", params={"limit": 2})).json()
        assert [c["step"] for c in first["data"]] == [3, 2]
        assert first["has_more"] is True and first["next_cursor"] == "2"
        rest = await client.get(
            "/v1/models/toy/checkpoints", params={"limit": 2, "after": first["next_cursor"]}
        )
        assert [c["step"] for c in rest.json()["data"]] == [1, 0]
        assert rest.json()["has_more"] is False
        one = await client.get("/v1/models/toy/checkpoints/2")
        assert one.json() == by_step[2]

        # Aliases: set, move, refuse reserved names and steps not on disk.
        created = await client.put("/v1/models/toy/aliases/prod", json={"step": 2})
        assert created.status_code == 201 and created.json()["step"] == 2
        moved = await client.put("/v1/models/toy/aliases/prod", json={"step": 1})
        assert moved.status_code == 200 and moved.json()["step"] == 1
        assert moved.json()["builtin"] is False
        missing = _problem(await client.put("/v1/models/toy/aliases/x", json={"step": 9}), 422)
        assert _field_errors(missing) == [("body", "step", "unknown_step")]
        reserved = _problem(
            await client.put("/v1/models/toy/aliases/latest", json={"step": 1}), 422
        )
        assert _field_errors(reserved) == [("path", "alias", "reserved_alias")]
        bad = _problem(await client.put("/v1/models/toy/aliases/9lives", json={"step": 1}), 422)
        assert [(e["location"], e["path"]) for e in bad["errors"]] == [("path", "alias")]
        aliases = (await client.get("/v1/models/toy/aliases")).json()
        assert [(a["alias"], a["step"], a["builtin"]) for a in aliases["data"]] == [
            ("latest", 3, True),
            ("prod", 1, False),
        ]
        listed = (await client.get("/v1/models/toy/checkpoints")).json()["data"]
        assert {c["step"]: c["aliases"] for c in listed} == {
            3: ["latest"],
            2: [],
            1: ["prod"],
            0: [],
        }

        # The gateway resolves an alias to the step, and the backend is asked for `toy@1`.
        gateway = _gateway(live.url)
        aliased = await gateway.chat.completions.create(
            model="toy@prod", messages=PROMPT, max_tokens=1, temperature=0, logprobs=True
        )
        direct = await gateway.chat.completions.create(
            model="toy@1", messages=PROMPT, max_tokens=1, temperature=0, logprobs=True
        )
        assert aliased.model == "toy@1"
        assert aliased.choices[0].logprobs == direct.choices[0].logprobs
        with pytest.raises(openai.NotFoundError) as unknown:
            await gateway.chat.completions.create(model="toy@nope", messages=PROMPT)
        assert "alias" in str(unknown.value)
        with pytest.raises(openai.NotFoundError):  # no retention policy: no `best`
            await gateway.chat.completions.create(model="toy@best", messages=PROMPT)

        # Delete: refused for the latest and for an aliased step, with the reasons' paths.
        latest = _problem(await client.delete("/v1/models/toy/checkpoints/3"), 409)
        assert latest["type"] == "urn:trainyard:problem:checkpoint-protected"
        assert _field_errors(latest) == [("path", "step", "latest_step")]
        aliased_step = _problem(await client.delete("/v1/models/toy/checkpoints/1"), 409)
        assert _field_errors(aliased_step) == [("path", "step", "aliased_step")]
        assert "`prod`" in aliased_step["detail"]
        assert _on_disk(tmp_path / "data") == [0, 1, 2, 3]

        assert (await client.delete("/v1/models/toy/checkpoints/2")).status_code == 204
        assert _on_disk(tmp_path / "data") == [0, 1, 3]
        gone = _problem(await client.get("/v1/models/toy/checkpoints/2"), 404)
        assert _field_errors(gone) == [("path", "step", "not_found")]
        assert gone["detail"] == "model 'toy' has no checkpoint of step 2"
        _problem(await client.delete("/v1/models/toy/checkpoints/2"), 404)
        with pytest.raises(openai.NotFoundError):  # the backend has no step 2 any more
            await gateway.chat.completions.create(model="toy@2", messages=PROMPT, max_tokens=1)

        assert (await client.delete("/v1/models/toy/aliases/prod")).status_code == 204
        no_alias = _problem(await client.delete("/v1/models/toy/aliases/prod"), 404)
        assert no_alias["detail"] == "model 'toy' has no alias 'prod'"
        assert _field_errors(no_alias) == [("path", "alias", "not_found")]
        _problem(await client.delete("/v1/models/toy/aliases/best"), 422)
        assert (await client.delete("/v1/models/toy/checkpoints/1")).status_code == 204
        assert _on_disk(tmp_path / "data") == [0, 3]

        # The next step trains on from the latest, whatever was deleted below it.
        assert (await _train(live))["result"]["final_step"] == 4
        assert (await client.delete("/v1/models/toy/checkpoints/3")).status_code == 204

        nope = _problem(await client.get("/v1/models/nope/checkpoints"), 404)
        assert _field_errors(nope) == [("path", "name", "not_found")]
        assert nope["detail"] == "no model 'nope'"
        _problem(await client.put("/v1/models/nope/aliases/a", json={"step": 0}), 404)
        _problem(await client.get("/v1/models/toy/checkpoints", params={"after": -1}), 422)


async def test_a_queued_job_keeps_the_step_it_was_sampled_from(serve, tiny_model) -> None:
    async with serve(worker_enabled=True, model_roots=[tiny_model.parent]) as live:
        await _register(live.client, tiny_model)
        await _train(live)
        await _train(live)
    # No worker now: a job stays queued.
    async with serve(worker_enabled=False, model_roots=[tiny_model.parent]) as live:
        body = {
            "model": "toy",
            "policy_step": 1,
            "groups": [
                {
                    "trajectories": [
                        {
                            "messages_and_choices": [*PROMPT, {"role": "assistant", "content": a}],
                            "reward": r,
                        }
                        for a, r in (("yes", 1.0), ("no", 0.0))
                    ]
                }
            ],
            "hyperparameters": {"allow_training_without_logprobs": True},
        }
        response = await live.client.post("/v1/training-jobs", json=body)
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        refused = _problem(await live.client.delete("/v1/models/toy/checkpoints/1"), 409)
        assert _field_errors(refused) == [("path", "step", "step_in_use")]
        assert job_id in refused["detail"]
        await live.client.post(f"/v1/training-jobs/{job_id}/cancel")
        await wait_status(live.client, job_id, "cancelled")
        assert (await live.client.delete("/v1/models/toy/checkpoints/1")).status_code == 204


async def test_retention_after_each_step_and_on_demand(serve, tiny_model, tmp_path) -> None:
    data = tmp_path / "data"
    async with serve(worker_enabled=True, model_roots=[tiny_model.parent]) as live:
        client = live.client
        await _register(client, tiny_model)
        default = (await client.get("/v1/models/toy/retention")).json()
        assert default["keep_last"] is None and default["created_at"] is None
        unruled = await client.post("/v1/models/toy/retention/apply")
        assert unruled.json() == {"kept": [0], "deleted": []}  # no policy: all kept
        invalid = _problem(await client.put("/v1/models/toy/retention", json={"keep_last": 0}), 422)
        assert [(e["location"], e["path"]) for e in invalid["errors"]] == [("body", "keep_last")]

        jobs = {0: None}
        for _ in range(2):
            job = await _train(live)
            jobs[job["result"]["final_step"]] = job
        assert _on_disk(data) == [0, 1, 2]
        assert (
            await client.put("/v1/models/toy/aliases/first", json={"step": 0})
        ).status_code == 201

        policy = {"keep_last": 1, "keep_best_by": "loss/grad_norm", "higher_is_better": False}
        put = await client.put("/v1/models/toy/retention", json=policy)
        assert put.status_code == 201, put.text
        norms = {s: j["result"]["metrics"]["loss/grad_norm"] for s, j in jobs.items() if j}
        best = _best(norms, norms)
        assert put.json()["best_step"] == best
        assert put.json()["keep_last"] == 1 and put.json()["model"] == "toy"
        assert (await client.put("/v1/models/toy/retention", json=policy)).status_code == 200

        # Nothing is deleted until a step succeeds or it is applied.
        assert _on_disk(data) == [0, 1, 2]
        run = (await client.post("/v1/models/toy/retention/apply")).json()
        kept = sorted({0, 2, best})  # the aliased step, the latest, the best
        assert run == {"kept": kept, "deleted": sorted({1} - set(kept))}
        assert _on_disk(data) == kept

        # The worker applies it after each step: latest, best, the aliased step stay.
        for _ in range(2):
            before = _on_disk(data)
            job = await _train(live)
            step = job["result"]["final_step"]
            norms[step] = job["result"]["metrics"]["loss/grad_norm"]
            best = _best(norms, [*before, step])
            await _eventually_on_disk(data, sorted({0, step, best}))
            listed = (await client.get("/v1/models/toy/checkpoints")).json()["data"]
            names = {c["step"]: c["aliases"] for c in listed}
            assert "best" in names[best] and "latest" in names[step] and "first" in names[0]
        assert (await client.get("/v1/models/toy/retention")).json()["best_step"] == best
        best_answer = await _gateway(live.url).chat.completions.create(
            model="toy@best", messages=PROMPT, max_tokens=1
        )
        assert best_answer.model == f"toy@{best}"
        if best != step:
            refused = _problem(await client.delete(f"/v1/models/toy/checkpoints/{best}"), 409)
            assert _field_errors(refused) == [("path", "step", "aliased_step")]

        assert (await client.delete("/v1/models/toy/retention")).status_code == 204
        assert (await client.delete("/v1/models/toy/retention")).status_code == 204
        assert (await client.get("/v1/models/toy/retention")).json()["keep_last"] is None
        _problem(await client.delete("/v1/models/nope/retention"), 404)
        before = _on_disk(data)
        await _train(live)
        assert _on_disk(data) == [*before, before[-1] + 1]  # no policy: all kept


async def test_export_loads_with_peft_like_the_served_step(serve, tiny_model, tmp_path) -> None:
    import torch
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    async with serve(worker_enabled=True, model_roots=[tiny_model.parent]) as live:
        await _register(live.client, tiny_model)
        await _train(live)
        response = await live.client.get("/v1/models/toy/checkpoints/1/export")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/octet-stream"
        assert 'filename="toy-step0001.tar.gz"' in response.headers["content-disposition"]
        as_zip = await live.client.get(
            "/v1/models/toy/checkpoints/1/export", params={"format": "zip"}
        )
        assert as_zip.status_code == 200
        assert 'filename="toy-step0001.zip"' in as_zip.headers["content-disposition"]
        as_peft = await live.client.get(
            "/v1/models/toy/checkpoints/1/export", params={"format": "peft"}
        )
        assert as_peft.status_code == 200
        assert 'filename="toy-step0001.tar.gz"' in as_peft.headers["content-disposition"]
        _problem(await live.client.get("/v1/models/toy/checkpoints/7/export"), 404)
        fmt = _problem(
            await live.client.get("/v1/models/toy/checkpoints/1/export", params={"format": "rar"}),
            422,
        )
        assert [(e["location"], e["path"]) for e in fmt["errors"]] == [("query", "format")]

    out = tmp_path / "export"
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as tar:
        names = sorted(tar.getnames())
        assert names == [
            "toy-step0001/adapter_config.json",
            "toy-step0001/adapter_model.safetensors",
        ]  # no optimizer state
        tar.extractall(out, filter="data")
    with zipfile.ZipFile(io.BytesIO(as_zip.content)) as archive:
        assert sorted(archive.namelist()) == names
    with tarfile.open(fileobj=io.BytesIO(as_peft.content), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == names

    checkpoint = _checkpoints_dir(tmp_path / "data") / "0001"
    assert (checkpoint / "optimizer.pt").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    probe = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        base_logits = base(input_ids=probe).logits
    loaded = PeftModel.from_pretrained(base, out / "toy-step0001")
    weights = get_peft_model_state_dict(loaded)
    saved = load_file(checkpoint / "adapter_model.safetensors")
    assert weights.keys() == saved.keys()
    for key, tensor in saved.items():
        assert torch.equal(weights[key], tensor), key
    with torch.no_grad():
        tuned_logits = loaded(input_ids=probe).logits
    assert not torch.allclose(base_logits, tuned_logits)  # the trained step, not the base


async def test_dry_run_has_no_adapter_and_serverless_no_local_checkpoints(serve, tmp_path) -> None:
    class Remote:
        """Like ART's ServerlessBackend: its checkpoints live elsewhere."""

        async def close(self) -> None:
            return None

    overrides = {"dry-run": DryRunBackend(tmp_path / "dry"), "art-serverless": Remote()}
    async with serve(backend_overrides=overrides) as live:
        client = live.client
        for name, backend in (("dry", "dry-run"), ("remote", "art-serverless")):
            body = {"name": name, "base_model": "m", "backend": backend}
            assert (await client.post("/v1/models", json=body)).status_code == 201
        listed = await client.get("/v1/models/dry/checkpoints")
        assert [c["step"] for c in listed.json()["data"]] == []  # registered on first use
        await live.app.state.backends.get("dry-run").model(ModelSpec("dry", "default", "m"))
        listed = (await client.get("/v1/models/dry/checkpoints")).json()["data"]
        assert [(c["step"], c["aliases"], c["size_bytes"]) for c in listed] == [(0, ["latest"], 0)]
        no_adapter = _problem(await client.get("/v1/models/dry/checkpoints/0/export"), 409)
        assert no_adapter["type"] == "urn:trainyard:problem:no-adapter"
        for method, path in [
            ("GET", "/v1/models/remote/checkpoints"),
            ("DELETE", "/v1/models/remote/checkpoints/0"),
            ("GET", "/v1/models/remote/aliases"),
            ("PUT", "/v1/models/remote/retention"),
        ]:
            body = {"keep_last": 1} if method == "PUT" else None
            problem = _problem(await client.request(method, path, json=body), 409)
            assert problem["type"] == "urn:trainyard:problem:no-local-checkpoints"


async def test_backend_deletion_never_takes_a_step_newer_than_every_kept_one(tmp_path) -> None:
    import art

    backend = DryRunBackend(tmp_path)
    model = art.TrainableModel(name="m", project="p", base_model="b")
    for step in range(5):
        (backend.checkpoints_dir(model) / f"{step:04d}").mkdir(parents=True)
    # Step 4 landed after the caller listed 0..3 and kept 1 and 3.
    await backend._delete_checkpoint_files(model, [1, 3])
    assert sorted(int(p.name) for p in backend.checkpoints_dir(model).iterdir()) == [1, 3, 4]


async def test_a_step_shows_on_disk_only_once_its_files_are_all_written(tmp_path) -> None:
    """Another worker reads the newest step to sample it, and a recovery reads it to decide
    whether a lost job's step landed: neither may see a step whose files are half written
    (a rollout asked `m@1` of a server that could not load it yet)."""
    import art

    backend = DryRunBackend(tmp_path)
    model = art.TrainableModel(name="m", project="p", base_model="b")
    await backend.register(model)
    with backend.writing(model, 1) as partial:
        (partial / "adapter_config.json").write_text("{}")
        assert backend.step_on_disk(model) == 0  # what every other reader sees meanwhile
        assert [p.name for p in backend.checkpoints_dir(model).iterdir() if p.name[0] != "."] == [
            "0000"
        ]
        (partial / "adapter_model.safetensors").write_bytes(b"weights")
    assert backend.step_on_disk(model) == 1
    assert sorted(p.name for p in (backend.checkpoints_dir(model) / "0001").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    # A write that fails leaves nothing behind; one that finds its step already in place
    # keeps that one when asked to.
    with pytest.raises(RuntimeError), backend.writing(model, 2) as partial:
        (partial / "adapter_config.json").write_text("{}")
        raise RuntimeError("killed mid-write")
    with backend.writing(model, 1, replace=False) as partial:
        (partial / "adapter_model.safetensors").write_bytes(b"other")
    assert sorted(p.name for p in backend.checkpoints_dir(model).iterdir()) == ["0000", "0001"]
    assert (backend.checkpoints_dir(model) / "0001" / "adapter_model.safetensors").read_bytes() == (
        b"weights"
    )
    # A dry-run step is written the same way.
    trained = await backend.train(model, [])
    assert (
        trained.step == 2 and (backend.checkpoints_dir(model) / "0002" / "manifest.json").exists()
    )
