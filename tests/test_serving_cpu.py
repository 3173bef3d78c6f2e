"""Serving under abuse on the real cpu backend (a tiny model), over real HTTP: a request
whose client goes away stops generating (at the gateway and at the backend's endpoint, the
path rollouts and validations take), admission bounds the backend's work with a 429 that
the sampling client waits out, and the whole OpenAI chat request is read."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.backends.tiny_model import make_tiny_model
from app.rollouts.sampling import SamplingClient
from tests.conftest import LiveServer
from tests.processes import until
from tests.test_cpu_backend import _served_at

pytestmark = pytest.mark.torch
PROMPT = [{"role": "user", "content": "say yes"}]
BIG = {"n": 64, "max_tokens": 1024, "temperature": 1.0}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("serving-models") / "tiny")


async def _served(live: LiveServer, tiny_model: Path) -> tuple[str, dict[str, str]]:
    """Registers `toy` and returns its endpoint's base URL once it answers, and the header
    of the key that endpoint takes for it."""
    response = await live.client.post(
        "/v1/models", json={"name": "toy", "base_model": str(tiny_model), "backend": "cpu"}
    )
    assert response.status_code == 201, response.text
    first = await live.client.post(
        "/openai/v1/chat/completions",
        json={"model": "toy", "messages": PROMPT, "max_tokens": 1},
        timeout=120,
    )
    assert first.status_code == 200, first.text
    # The backend's own endpoint, as the worker recorded it (the API hands out the gateway).
    endpoint, key = await _served_at(live.app.state.settings.database_url, "toy")
    return endpoint, {"authorization": f"Bearer {key}"}


async def _metric(live: LiveServer, name: str, where: str, **labels: str) -> float:
    wanted = {"model": "toy", "where": where, **labels}
    total = 0.0
    for line in (await live.client.get("/metrics")).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in wanted.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _at(live: LiveServer, name: str, where: str, value: float, **labels: str) -> Any:
    async def condition() -> bool:
        return await _metric(live, name, where, **labels) == value

    return condition


async def _abandon(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    async with httpx.AsyncClient(timeout=0.5, headers=headers) as impatient:
        with pytest.raises(httpx.TimeoutException):
            await impatient.post(url, json=body)


async def test_abandoned_requests_stop_generating_and_free_the_model(serve, tiny_model) -> None:
    roots = [tiny_model.parent]
    async with serve(worker_enabled=True, model_roots=roots, serving_max_tokens=10**9) as live:
        endpoint, key = await _served(live, tiny_model)
        big = {"model": "toy", "messages": PROMPT, **BIG}
        # Through the gateway, and straight at the backend (as rollouts sample).
        await asyncio.gather(
            *(_abandon(f"{live.url}/openai/v1/chat/completions", big) for _ in range(3)),
            *(_abandon(f"{endpoint}/chat/completions", big, key) for _ in range(2)),
        )
        # Each one stopped unfinished (between tokens, or while it waited for the model).
        await until(_at(live, "trainyard_serving_abandoned", "cpu", 5), 120, "cancellations")
        await until(_at(live, "trainyard_serving_tokens", "cpu", 0), 120, "the cpu backend idle")
        await until(_at(live, "trainyard_serving_tokens", "gateway", 0), 120, "the gateway idle")
        assert await _metric(live, "trainyard_serving_abandoned", "gateway") == 3
        short = await live.client.post(
            "/openai/v1/chat/completions",
            json={"model": "toy", "messages": PROMPT, "max_tokens": 2},
            timeout=120,
        )
        assert short.status_code == 200
        assert short.json()["usage"]["completion_tokens"] <= 2


async def test_a_saturated_backend_answers_429_and_rollouts_wait_their_turn(
    serve, tiny_model
) -> None:
    roots = [tiny_model.parent]
    bound = BIG["n"] * BIG["max_tokens"]
    async with serve(worker_enabled=True, model_roots=roots, serving_max_tokens=bound) as live:
        endpoint, key = await _served(live, tiny_model)
        async with httpx.AsyncClient(timeout=600, headers=key) as patient:
            held = asyncio.ensure_future(
                patient.post(
                    f"{endpoint}/chat/completions",
                    json={"model": "toy", "messages": PROMPT, **BIG},
                )
            )
            try:
                await until(_at(live, "trainyard_serving_tokens", "cpu", bound), 60, "the hold")
                refused = await patient.post(
                    f"{endpoint}/chat/completions",
                    json={"model": "toy", "messages": PROMPT, "max_tokens": 1},
                )
                assert refused.status_code == 429, refused.text
                assert refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "model_saturated"
                ready = await live.client.get("/readyz")
                assert ready.status_code == 503
                assert "saturated: toy (cpu)" in ready.json()["checks"]["models"]["detail"]
                # A rollout's client waits its turn: no attempt is spent on a 429.
                secret = key["authorization"].removeprefix("Bearer ")
                async with SamplingClient(endpoint, secret, retries=0, backoff=0.01) as client:
                    waiting = asyncio.ensure_future(
                        client.chat({"model": "toy", "messages": PROMPT, "max_tokens": 1})
                    )
                    await until(
                        _at_least(live, "trainyard_serving_refused", "cpu", 3), 60, "refusals"
                    )
                    assert not waiting.done()
                    held.cancel()  # the held request's client goes away: it stops
                    answer = await asyncio.wait_for(waiting, 300)
                assert answer["choices"][0]["message"]["role"] == "assistant"
            finally:
                held.cancel()
        await until(_at(live, "trainyard_serving_tokens", "cpu", 0), 120, "the cpu backend idle")
        assert (await live.client.get("/readyz")).status_code == 200


def _at_least(live: LiveServer, name: str, where: str, value: float) -> Any:
    async def condition() -> bool:
        return await _metric(live, name, where) >= value

    return condition


async def test_the_cpu_backend_reads_the_whole_chat_request(serve, tiny_model) -> None:
    async with serve(worker_enabled=True, model_roots=[tiny_model.parent]) as live:
        endpoint, key = await _served(live, tiny_model)
        parts = [
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "say "}, {"type": "text", "text": "yes"}],
            },
        ]
        for url, headers in ((f"{live.url}/openai/v1", {}), (endpoint, key)):
            for seed in (2**63 - 1, -(2**63)):
                answer = await live.client.post(
                    f"{url}/chat/completions",
                    json={"model": "toy", "messages": parts, "max_tokens": 2, "seed": seed},
                    headers=headers,
                    timeout=120,
                )
                assert answer.status_code == 200, answer.text
            image = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
            refused = await live.client.post(
                f"{url}/chat/completions",
                json={"model": "toy", "messages": [{"role": "user", "content": ["hi", image]}]},
                headers=headers,
            )
            assert refused.status_code == 400
            assert "`messages[0].content[0]`" in refused.json()["error"]["message"]
            for bad in ({"seed": 2**63}, {"messages": [{"role": "robot", "content": "hi"}]}):
                body = {"model": "toy", "messages": PROMPT, **bad}
                refused = await live.client.post(
                    f"{url}/chat/completions", json=body, headers=headers
                )
                assert refused.status_code == 400, refused.text
                assert refused.headers["content-type"] == "application/json"
        for name in ("toy@01", "toy@\u0661"):
            missing = await live.client.post(
                f"{endpoint}/chat/completions",
                json={"model": name, "messages": PROMPT},
                headers=key,
            )
            assert missing.status_code == 404


async def test_a_cancelled_rollout_stops_its_sampling_at_the_backend(serve, tiny_model) -> None:
    async with serve(worker_enabled=True, model_roots=[tiny_model.parent]) as live:
        await _served(live, tiny_model)
        response = await live.client.post(
            "/v1/rollout-jobs",
            json={
                "model": "toy",
                "examples": [{"id": "a", "messages": PROMPT, "expected": "yes"}],
                "num_generations": 64,
                "sampling": {"max_tokens": 1024, "temperature": 1.0},
                "grader": {"type": "exact_match"},
            },
        )
        assert response.status_code == 202, response.text
        job = response.json()["id"]
        await until(_at_least(live, "trainyard_serving_tokens", "cpu", 1), 120, "its sampling")
        cancelled = await live.client.post(f"/v1/rollout-jobs/{job}/cancel")
        assert cancelled.status_code in (200, 202), cancelled.text
        # Its requests' connections closed: the backend stopped generating for them.
        await until(_at_least(live, "trainyard_serving_abandoned", "cpu", 1), 120, "the stop")
        await until(_at(live, "trainyard_serving_tokens", "cpu", 0), 120, "the cpu backend idle")
        status = (await live.client.get(f"/v1/rollout-jobs/{job}")).json()["status"]
        assert status in ("cancelling", "cancelled")
