"""One OpenAI-compatible gateway in front of every served model: a real OpenAI client, the
real cpu backend on a tiny model, real HTTP, API keys on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import select, update

from app.backends.tiny_model import make_tiny_model
from app.db import create_engine, write_connection
from app.models import ModelRow
from tests.backends import wait_final
from tests.conftest import LiveServer
from tests.processes import free_port

pytestmark = pytest.mark.torch
KEY = "gateway-test-key"
PROMPT = [{"role": "user", "content": "say yes"}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gateway-models") / "tiny")


def _client(url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/openai/v1", api_key=key, max_retries=0)


async def _sample(client: openai.AsyncOpenAI, model: str, **extra):
    return await client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=1, logprobs=True, **extra
    )


async def _train_once(live, answers) -> dict:
    """One step on the sampled answers: reward 1 for the first, 0 for the others."""
    groups = [
        {
            "trajectories": [
                {
                    "messages_and_choices": [*PROMPT, choice.model_dump(mode="json")],
                    "reward": 1.0 if i == 0 else 0.0,
                }
                for i, choice in enumerate(answers.choices)
            ]
        }
    ]
    response = await live.client.post(
        "/v1/training-jobs",
        json={"model": "toy", "groups": groups, "hyperparameters": {"learning_rate": 0.05}},
    )
    assert response.status_code == 202, response.text
    return await wait_final(live.client, response.json()["id"])


async def _register(live, tiny_model: Path) -> None:
    response = await live.client.post(
        "/v1/models", json={"name": "toy", "base_model": str(tiny_model), "backend": "cpu"}
    )
    assert response.status_code in (200, 201), response.text


async def test_one_gateway_serves_the_latest_and_past_steps_behind_the_keys(
    serve, tiny_model
) -> None:
    roots = [tiny_model.parent]
    async with serve(worker_enabled=True, api_keys=[KEY], model_roots=roots) as live:
        live.client.headers["authorization"] = f"Bearer {KEY}"
        await _register(live, tiny_model)
        client = _client(live.url)
        first = await _sample(client, "toy", n=4, temperature=1.0, seed=7)
        assert first.model == "toy@0"
        assert first.choices[0].logprobs.content[0].token.startswith("token_id:")
        job = await _train_once(live, first)
        assert job["status"] == "succeeded" and job["result"]["trained"] is True

        greedy = {"temperature": 0.0, "top_logprobs": 3}
        old = await _sample(client, "toy@0", **greedy)
        latest = await _sample(client, "toy@latest", **greedy)
        bare = await _sample(client, "toy", **greedy)
        assert (old.model, latest.model, bare.model) == ("toy@0", "toy@1", "toy@1")
        # The past step is served from its own adapter: the same prompt scores differently.
        assert old.choices[0].logprobs.content[0].top_logprobs != (
            latest.choices[0].logprobs.content[0].top_logprobs
        )
        assert latest.choices[0].logprobs == bare.choices[0].logprobs
        again = await _sample(client, "toy", **greedy)  # the latest is back after toy@0
        assert again.choices[0].logprobs == bare.choices[0].logprobs

        listed = {m.id for m in (await client.models.list()).data}
        assert {"toy", "toy@latest", "toy@1"} <= listed
        model = (await live.client.get("/v1/models/toy")).json()
        assert model["openai_base_url"] == f"{live.url}/openai/v1"
        assert model["openai_model_names"] == ["toy", "toy@latest", "toy@1"]

        with pytest.raises(openai.AuthenticationError):
            await _sample(_client(live.url, key="wrong"), "toy")
        with pytest.raises(openai.NotFoundError) as missing:
            await _sample(client, "toy@5")
        assert "is at step 1" in str(missing.value)
        with pytest.raises(openai.NotFoundError):
            await _sample(client, "nope")
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.chat.completions.create(model="toy", messages=PROMPT, max_tokens=2048)
        assert "max_tokens" in str(too_long.value) and "1024" in str(too_long.value)
        with pytest.raises(openai.BadRequestError) as streamed:
            await client.chat.completions.create(model="toy", messages=PROMPT, stream=True)
        assert "stream" in str(streamed.value)
        bad = await live.client.post("/openai/v1/chat/completions", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


async def test_a_fixed_base_url_and_model_name_survive_a_restart(serve, tiny_model) -> None:
    """What a NAT config holds: one base URL and `model_name: toy`, across epochs and a
    restart of the service between them."""
    port = free_port()
    async with serve(port=port, worker_enabled=True, model_roots=[tiny_model.parent]) as live:
        await _register(live, tiny_model)
        client = _client(live.url)
        answers = await _sample(client, "toy", n=4, temperature=1.0)
        assert (await _train_once(live, answers))["status"] == "succeeded"
        served_at = (await live.client.get("/v1/models/toy")).json()["inference_base_url"]
        database_url = live.app.state.settings.database_url
    assert served_at
    # The stopped process took its endpoint with it: no reader is sent to a dead port.
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            row = (await conn.execute(select(ModelRow).where(ModelRow.name == "toy"))).one()
    finally:
        await engine.dispose()
    assert row.inference_base_url is None and row.current_step == 1
    async with serve(port=port, worker_enabled=True, model_roots=[tiny_model.parent]) as live:
        client = _client(live.url)
        after = await _sample(client, "toy", n=4, temperature=1.0)
        assert after.model == "toy@1" and after.choices[0].logprobs is not None
        assert (await _train_once(live, after))["result"]["final_step"] == 2
        assert (await _sample(client, "toy")).model == "toy@2"


async def test_readyz_waits_for_every_served_model_to_answer(serve, tiny_model) -> None:
    async with serve(worker_enabled=True, model_roots=[tiny_model.parent]) as live:
        await _register(live, tiny_model)

        async def checks() -> dict:
            return (await live.client.get("/readyz")).json()["checks"]

        for _ in range(200):  # the worker serves a new model within a loop iteration
            if (await checks())["models"]["ok"]:
                break
            await asyncio.sleep(0.05)
        assert (await checks())["models"] == {
            "ok": True,
            "detail": "1 model(s) served and answering; 0 request(s) queued, the oldest for 0.0s",
        }
        # The model's endpoint goes away: the process is not ready, and says which check.
        await live.app.state.backends.get("cpu").backend.close()
        response = await live.client.get("/readyz")
        assert response.status_code == 503
        assert response.json()["checks"]["models"]["ok"] is False


async def test_an_api_replica_relays_a_streamed_answer_from_the_recorded_endpoint(
    serve, make_settings
) -> None:
    """An API-only process routes through the endpoint the serving worker recorded on the
    model's row, and relays a streaming backend's chunks (vLLM's shape) as they come."""
    upstream = FastAPI()
    seen: list[dict] = []

    @upstream.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        seen.append(await request.json())

        async def chunks():
            for word in ("yes", "no"):
                delta = {"choices": [{"index": 0, "delta": {"content": word}}]}
                yield f"data: {json.dumps(delta)}\n\n".encode()
            # What `stream_options: {"include_usage": true}` adds: the stream's usage.
            usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
            yield f"data: {json.dumps(usage)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async with LiveServer(upstream) as vllm, serve() as live:  # no worker: an API replica
        base = str(make_settings().data_dir / "remote")  # inside the model roots
        created = await live.client.post(
            "/v1/models", json={"name": "remote", "base_model": base, "backend": "cpu"}
        )
        assert created.status_code == 201, created.text
        engine = create_engine(make_settings().database_url)
        async with write_connection(engine) as conn:
            await conn.execute(
                update(ModelRow)
                .where(ModelRow.name == "remote")
                .values(current_step=3, inference_base_url=f"{vllm.url}/v1")
            )
        await engine.dispose()
        client = _client(live.url)
        stream = await client.chat.completions.create(
            model="remote@2", messages=PROMPT, stream=True
        )
        words = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
        gateway = await _metered(live.client, {}, calls=1)
    assert words == ["yes", "no"]
    # Counted once the stream ended, from its last chunks.
    assert (gateway["prompt_tokens"], gateway["completion_tokens"]) == (5, 2)
    assert seen[0]["model"] == "remote@2" and seen[0]["stream"] is True


async def _metered(client, headers: dict, *, calls: int, group_by: str = "kind") -> dict:
    """The gateway's row of `GET /v1/usage` once `calls` answers are in it (their rows are
    written in batches after the answers)."""
    for _ in range(400):
        used = (
            await client.get("/v1/usage", params={"group_by": group_by}, headers=headers)
        ).json()
        if used["total"]["gateway_calls"] >= calls:
            break
        await asyncio.sleep(0.05)
    rows = [r for r in used["data"] if r["gateway_calls"]]
    assert len(rows) == 1 and rows[0]["gateway_calls"] == calls, used
    return dict(rows[0])


async def test_gateway_calls_count_for_the_calling_key_and_its_project(serve, tiny_model) -> None:
    from tests.test_projects import bearer, key, project

    async with serve(
        worker_enabled=True, api_keys=["root"], key_cache_seconds=0, model_roots=[tiny_model.parent]
    ) as live:
        live.client.headers["authorization"] = "Bearer root"
        mine, other = await project(live.client, "mine"), await project(live.client, "other")
        sampler = await key(live.client, mine, "write", "read", "sample")
        headers = bearer(sampler["secret"])
        response = await live.client.post(
            "/v1/models",
            json={"name": "toy", "base_model": str(tiny_model), "backend": "cpu"},
            headers=headers,
        )
        assert response.status_code == 201, response.text
        client = _client(live.url, sampler["secret"])
        answers = [await _sample(client, "toy", n=2, temperature=1.0) for _ in range(3)]
        row = await _metered(live.client, headers, calls=3, group_by="key")
        theirs = await live.client.get(
            "/v1/usage", params={"project_id": other}, headers={"Authorization": "Bearer root"}
        )
    assert row["group"] == sampler["id"]
    assert row["prompt_tokens"] == sum(a.usage.prompt_tokens for a in answers)
    assert row["completion_tokens"] == sum(a.usage.completion_tokens for a in answers)
    assert theirs.json()["total"]["gateway_calls"] == 0
