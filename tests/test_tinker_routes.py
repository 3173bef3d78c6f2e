"""The Tinker routes' refusals over HTTP, without the SDK: each is problem+json naming the bad
field, and stores nothing. Also the key: the SDK's `X-API-Key`, on `/tinker/` paths only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import LiveServer

V1 = "/tinker/api/v1"
KEY = "tml-routes-key"
AUTH = {"X-API-Key": KEY}


@pytest.fixture
async def live(serve: Callable[..., LiveServer]) -> Any:
    async with serve(api_keys=KEY, demo_model=False) as server:
        yield server


async def test_the_sdks_key_header_opens_the_tinker_paths_only(live: LiveServer) -> None:
    client = live.client
    refused = await client.post(f"{V1}/client/config", json={})
    assert refused.status_code == 401
    assert "`X-API-Key: tml-<key>`" in refused.json()["detail"]  # what the SDK sends
    config = await client.post(f"{V1}/client/config", json={"sdk_version": "0.38.0"}, headers=AUTH)
    assert config.status_code == 200 and config.json()["use_pyqwest_transport"] is False
    assert (await client.get("/v1/models", headers=AUTH)).status_code == 401
    dynamic = await client.post(f"{V1}/client/dynamic_config", json={}, headers=AUTH)
    assert dynamic.json()["sample_cancel_enabled"] is False
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert (await client.get(f"{V1}/get_server_capabilities", headers=bearer)).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "field"),
    [
        ("session_heartbeat", {"session_id": "nope"}, {}, 404, "session_id"),
        ("create_model", b"{", {}, 400, "body"),
        ("create_model", [], {}, 400, "body"),
        ("create_model", b'{"session_id": NaN}', {}, 400, "body"),  # the strict parser's
        ("optim_step", b'{"model_id": "\\ud800"}', {}, 400, "body"),
        ("create_model", {"session_id": "nope"}, {}, 404, "session_id"),
        ("get_info", {"model_id": "nope"}, {}, 404, "model_id"),
        ("optim_step", {"model_id": "nope"}, {}, 404, "model_id"),
        ("forward_backward", b"\x0a\x01x", {}, 415, "content-type"),
        ("forward_backward", b"\x0a\x05x", {"content-type": "application/x-protobuf"}, 400, "body"),
        (
            "forward_backward",
            b"\x0a\x01x",
            {"content-type": "application/x-protobuf"},
            404,
            "model_id",
        ),
        ("asample", {"sampling_session_id": "nope"}, {}, 404, "sampling_session_id"),
        ("create_sampling_session", {"session_id": "s"}, {}, 400, "base_model"),
        ("retrieve_future", {"request_id": "nope"}, {}, 410, "request_id"),
    ],
)
async def test_a_bad_request_is_a_problem_naming_its_field(
    live: LiveServer, path: str, body: Any, headers: dict[str, str], status: int, field: str
) -> None:
    sent = {"content": body} if isinstance(body, bytes) else {"json": body}
    answer = await live.client.post(f"{V1}/{path}", headers={**AUTH, **headers}, **sent)
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["detail"].startswith(f"{field}:"), answer.json()


async def test_a_refused_run_stores_nothing(live: LiveServer) -> None:
    client = live.client
    session = (await client.post(f"{V1}/create_session", json={}, headers=AUTH)).json()
    base = {"session_id": session["session_id"], "model_seq_id": 0}
    for body, field in [
        ({**base, "base_model": "demo", "lora_config": {"rank": 0}}, "lora_config.rank"),
        ({**base, "base_model": "/etc", "lora_config": {"rank": 2}}, "base_model"),
    ]:
        answer = await client.post(f"{V1}/create_model", json=body, headers=AUTH)
        assert answer.status_code == 400 and answer.json()["detail"].startswith(f"{field}:")
    models = await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert models.json()["data"] == []
    heartbeat = {"session_id": session["session_id"]}
    beat = await client.post(f"{V1}/session_heartbeat", json=heartbeat, headers=AUTH)
    assert beat.json() == {"type": "session_heartbeat"}


async def test_training_runs_of_the_registry(live: LiveServer) -> None:
    client = live.client
    page = await client.get(f"{V1}/training_runs", headers=AUTH)
    assert page.json() == {
        "training_runs": [],
        "cursor": {"offset": 0, "limit": 20, "total_count": 0},
    }
    for path, status, field in [
        ("training_runs?limit=0", 400, "limit"),
        ("training_runs/nope", 404, "training_run_id"),
        ("training_runs/s1:train:0/checkpoints", 404, "training_run_id"),
    ]:
        answer = await client.get(f"{V1}/{path}", headers=AUTH)
        assert answer.status_code == status and answer.json()["detail"].startswith(f"{field}:")
