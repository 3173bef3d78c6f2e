"""A key reaches every call made for the user, however it was given: the SDK's `api_key=`
or `TRAINYARD_API_KEY`, the command's `--api-key` or the variable, and an OpenAI client
built from what the client holds (`openai_base_url`, `api_key`). And the model JSON hands
out the gateway, behind the keys, never the backend's own endpoint (which takes any key).

Each against a live server started with `TRAINYARD_API_KEYS`, over loopback. ART's
backend and NAT's adapter: tests/test_art_backend.py, tests/test_nat_finetune.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from sqlalchemy import update

from app.db import create_engine, write_connection
from app.models import ModelRow
from tests.conftest import LiveServer
from tests.test_client_cli import EXIT_OK, EXIT_REFUSED, run_cli
from trainyard_client import AsyncTrainyard, AuthenticationError, Trainyard
from trainyard_client._retry import RetryPolicy

pytestmark = pytest.mark.any_database
KEY = "the-users-key"
NO_RETRY = RetryPolicy(max_retries=0)


def _dry_run(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "project": "keys",
        "base_model": "Qwen/Qwen2.5-0.5B-Instruct",
        "backend": "dry-run",
    }


async def test_the_sdk_sends_the_key_from_the_argument_or_the_environment(
    serve: Callable[..., LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serve(api_keys=KEY) as live:

        def sync_calls() -> dict[str, Any]:
            seen: dict[str, Any] = {}
            monkeypatch.delenv("TRAINYARD_API_KEY", raising=False)
            with Trainyard(live.url, api_key=KEY, retry=NO_RETRY) as client:
                seen["argument"] = client.models.create(**_dry_run("by-argument")).name
            with Trainyard(live.url, retry=NO_RETRY) as client:
                try:
                    client.models.list()
                except AuthenticationError as exc:
                    seen["none"] = exc.status
            monkeypatch.setenv("TRAINYARD_API_KEY", KEY)
            with Trainyard(live.url, retry=NO_RETRY) as client:
                seen["environment"] = [m.name for m in client.models.list().data]
                seen["api_key"] = client.api_key
            with Trainyard(live.url, api_key="", retry=NO_RETRY) as client:  # no key, said so
                seen["empty"] = client.api_key
            monkeypatch.setenv("TRAINYARD_API_KEY", "stale")
            with Trainyard(live.url, api_key=KEY, retry=NO_RETRY) as client:
                seen["argument_first"] = client.models.get("by-argument").name
            return seen

        seen = await asyncio.to_thread(sync_calls)
        monkeypatch.setenv("TRAINYARD_API_KEY", KEY)
        async with AsyncTrainyard(live.url, retry=NO_RETRY) as client:
            async_names = [m.name async for m in client.models.iterate()]
            async_key = client.api_key
    assert seen == {
        "argument": "by-argument",
        "none": 401,
        "environment": ["by-argument"],
        "api_key": KEY,
        "empty": None,
        "argument_first": "by-argument",
    }
    assert async_names == ["by-argument"] and async_key == KEY


async def test_an_openai_client_built_from_the_client_reaches_the_gateway(
    serve: Callable[..., LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`openai_base_url` and `api_key` are what an OpenAI client needs: past the keys, the
    gateway answers (a dry-run model is not served: 404 in OpenAI's envelope, not 401)."""
    monkeypatch.setenv("TRAINYARD_API_KEY", KEY)
    async with serve(api_keys=KEY) as live, AsyncTrainyard(live.url, retry=NO_RETRY) as client:
        await client.models.create(**_dry_run("unserved"))
        keyed = openai.AsyncOpenAI(
            base_url=client.openai_base_url, api_key=client.api_key, max_retries=0
        )
        keyless = openai.AsyncOpenAI(
            base_url=client.openai_base_url, api_key="not-a-key", max_retries=0
        )
        listed = await keyed.models.list()
        with pytest.raises(openai.NotFoundError) as unserved:
            await keyed.chat.completions.create(
                model="unserved", messages=[{"role": "user", "content": "hi"}]
            )
        with pytest.raises(openai.AuthenticationError):
            await keyless.models.list()
        # The SDK's own gateway calls send the key as well.
        served = await client.gateway.models()
    assert listed.data == [] and served["data"] == []
    assert unserved.value.code == "model_not_served"


async def test_the_command_sends_the_key_from_the_flag_or_the_environment(
    serve: Callable[..., LiveServer],
) -> None:
    async with serve(api_keys=KEY) as live:

        def commands() -> dict[str, Any]:
            return {
                "flag": run_cli("--api-key", KEY, "--json", "models", "list", url=live.url),
                "environment": run_cli(
                    "--json", "models", "list", url=live.url, TRAINYARD_API_KEY=KEY
                ),
                "flag_first": run_cli(
                    "--api-key", KEY, "--json", "backends", url=live.url, TRAINYARD_API_KEY="stale"
                ),
                "wrong": run_cli("--api-key", "wrong", "models", "list", url=live.url),
            }

        runs = await asyncio.to_thread(commands)
    for name in ("flag", "environment", "flag_first"):
        assert runs[name].code == EXIT_OK, (name, runs[name])
    assert json.loads(runs["flag"].out)["data"] == []
    assert "dry-run" in {b["name"] for b in json.loads(runs["flag_first"].out)}
    assert runs["wrong"].code == EXIT_REFUSED and "401 Unauthorized" in runs["wrong"].err


async def test_the_model_json_hands_out_the_gateway_not_the_backends_endpoint(
    serve: Callable[..., LiveServer], make_settings: Callable[..., Any]
) -> None:
    """The backend's own endpoint (here a stand-in that, like the cpu backend's server,
    answers any key or none) stays inside: the model JSON names the gateway, which asks
    for a key and forwards to it."""
    upstream = FastAPI()
    seen: list[dict[str, Any]] = []

    @upstream.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        seen.append(await request.json())
        message = {"role": "assistant", "content": "yes"}
        return {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": seen[-1]["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
        }

    auth = {"Authorization": f"Bearer {KEY}"}
    async with LiveServer(upstream) as backend, serve(api_keys=KEY) as live:
        base = str(make_settings().data_dir / "remote")  # inside the model roots
        created = await live.client.post(
            "/v1/models",
            json={"name": "remote", "base_model": base, "backend": "cpu"},
            headers=auth,
        )
        assert created.status_code == 201, created.text
        assert created.json()["inference_base_url"] is None  # no worker serves it yet
        engine = create_engine(make_settings().database_url)
        async with write_connection(engine) as conn:
            await conn.execute(
                update(ModelRow)
                .where(ModelRow.name == "remote")
                .values(current_step=2, inference_base_url=f"{backend.url}/v1")
            )
        await engine.dispose()
        got = await live.client.get("/v1/models/remote", headers=auth)
        listed = await live.client.get("/v1/models", headers=auth)
        model = got.json()
        gateway = f"{live.url}/openai/v1"
        body = {
            "model": model["inference_model_name"],
            "messages": [{"role": "user", "content": "hi"}],
        }
        async with httpx.AsyncClient(base_url=model["inference_base_url"]) as http:
            keyless = await http.post("/chat/completions", json=body)
            forwarded_keyless = len(seen)
            keyed = await http.post("/chat/completions", json=body, headers=auth)
    assert model["inference_base_url"] == gateway == model["openai_base_url"]
    assert model["inference_model_name"] == "remote@2"
    for text in (got.text, listed.text):
        assert backend.url.removeprefix("http://") not in text
    assert keyless.status_code == 401 and forwarded_keyless == 0
    assert keyed.status_code == 200, keyed.text
    assert seen[0]["model"] == "remote@2" and keyed.json()["model"] == "remote@2"


async def test_without_a_key_arts_openai_client_gets_a_stand_in_an_open_server_takes(
    serve: Callable[..., LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key anywhere: an OpenAI client refuses to be made without one, so ART's gets a
    stand-in, which a server without keys takes (and one with keys refuses)."""
    art = pytest.importorskip("art")
    from trainyard_client.art_backend import NO_KEY, TrainyardBackend

    monkeypatch.delenv("TRAINYARD_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    answers = {}
    for keys in ("", KEY):
        async with serve(api_keys=keys) if keys else serve() as live:
            backend = TrainyardBackend(live.url)
            names = {"name": "m", "project": "p", "base_model": "b"}
            if "run_name" in art.TrainableModel.model_fields:  # 0.5.23 asks for one
                names["run_name"] = "r"
            model = art.TrainableModel(**names)
            base_url, key = await backend._prepare_backend_for_training(model, None)
            assert (base_url, key) == (f"{live.url}/openai/v1", NO_KEY)
            client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
            try:
                answers[keys] = len((await client.models.list()).data)
            except openai.AuthenticationError as exc:
                answers[keys] = exc.status_code
            await backend.close()
    assert answers == {"": 0, KEY: 401}
