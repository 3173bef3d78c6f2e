"""Serving under abuse, through the gateway of an API replica in front of a stand-in for a
remote endpoint (vLLM's shape), over real HTTP: abandoned requests are cancelled upstream,
admitted work is bounded per model (429 with Retry-After in OpenAI's envelope), saturation
shows on /readyz and /metrics, and every failure reaches the client as OpenAI's JSON."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import update

from app.db import create_engine, write_connection
from app.models import ModelRow
from tests.conftest import LiveServer
from tests.processes import until

PROMPT = [{"role": "user", "content": "say yes"}]
BOUND = 1000


class Upstream:
    """A remote endpoint: `slow` holds each request until its client goes away (and says
    so), `broken` answers a text/plain traceback, anything else a completion."""

    def __init__(self) -> None:
        self.app = FastAPI()
        self.cancelled = 0
        self.started = 0
        self.bodies: list[dict[str, Any]] = []

        @self.app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            if body["model"].startswith("slow@"):
                self.started += 1
                while not await request.is_disconnected():
                    await asyncio.sleep(0.05)
                self.cancelled += 1
                return Response(status_code=499)
            if body["model"].startswith("broken@"):
                return PlainTextResponse(
                    "Traceback (most recent call last):\n  ...\nOverflowError: too big",
                    status_code=500,
                )
            if body["model"].startswith("teapot@"):
                return PlainTextResponse("no", status_code=418)
            return JSONResponse(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "yes"},
                            "finish_reason": "stop",
                            "logprobs": None,
                        }
                    ],
                }
            )


@pytest.fixture
async def replica(serve, make_settings) -> AsyncIterator[tuple[LiveServer, Upstream]]:
    upstream = Upstream()
    async with LiveServer(upstream.app) as remote, serve(serving_max_tokens=BOUND) as live:
        base = str(make_settings().data_dir / "remote")  # inside the model roots
        for name in ("slow", "broken", "fast", "teapot"):
            created = await live.client.post(
                "/v1/models", json={"name": name, "base_model": base, "backend": "cpu"}
            )
            assert created.status_code == 201, created.text
        engine = create_engine(make_settings().database_url)
        async with write_connection(engine) as conn:
            await conn.execute(
                update(ModelRow).values(current_step=3, inference_base_url=f"{remote.url}/v1")
            )
        await engine.dispose()
        yield live, upstream


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": PROMPT, **extra}


async def _metric(live: LiveServer, line_start: str) -> float:
    text = (await live.client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {line_start} in {text[-2000:]}")


def _true(check: Any) -> Any:
    async def condition() -> bool:
        return bool(check())

    return condition


def _zero(live: LiveServer, metric: str) -> Any:
    async def condition() -> bool:
        return await _metric(live, metric) == 0

    return condition


def _in_flight(model: str) -> str:
    return f'trainyard_serving_tokens{{model="{model}",state="in_flight",where="gateway"}}'


async def test_an_abandoned_request_is_cancelled_upstream_and_frees_its_admission(
    replica,
) -> None:
    live, upstream = replica
    async with httpx.AsyncClient(base_url=live.url, timeout=0.5) as impatient:
        for _ in range(3):
            with pytest.raises(httpx.ReadTimeout):
                await impatient.post("/openai/v1/chat/completions", json=_chat("slow", n=2))
    # Every upstream request saw its client go: the gateway closed it.
    await until(_true(lambda: upstream.cancelled == 3), what="the upstream cancellations")
    await until(_zero(live, _in_flight("slow")), what="admission to drain")
    assert await _metric(live, 'trainyard_serving_started{model="slow",where="gateway"}') == 3
    assert await _metric(live, 'trainyard_serving_abandoned{model="slow",where="gateway"}') == 3
    answer = await live.client.post("/openai/v1/chat/completions", json=_chat("fast"))
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "yes"


async def test_work_past_the_bound_is_refused_with_retry_after_and_shows_as_saturation(
    replica,
) -> None:
    live, upstream = replica
    held = asyncio.ensure_future(
        live.client.post(
            "/openai/v1/chat/completions", json=_chat("slow", n=2, max_tokens=BOUND // 2)
        )
    )
    try:
        await until(_true(lambda: upstream.started == 1), what="the held request")
        assert await _metric(live, _in_flight("slow")) == BOUND
        refused = await live.client.post(
            "/openai/v1/chat/completions", json=_chat("slow", max_tokens=1)
        )
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "model_saturated" and error["type"] == "rate_limit_error"
        assert "1000" in error["message"]
        # Another model is admitted on its own bound.
        other = await live.client.post("/openai/v1/chat/completions", json=_chat("fast"))
        assert other.status_code == 200
        ready = await live.client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["models"]["detail"].startswith("saturated: slow (gateway)")
        assert await _metric(live, 'trainyard_serving_refused{model="slow",where="gateway"}') == 1
        assert await _metric(live, 'trainyard_serving_max_tokens{where="gateway"}') == BOUND
    finally:
        held.cancel()
    await until(_zero(live, _in_flight("slow")), what="admission to drain")
    ready = await live.client.get("/readyz")
    assert ready.json()["checks"]["models"]["ok"] is True


async def test_a_request_alone_is_admitted_whatever_its_size(replica) -> None:
    live, upstream = replica
    answer = await live.client.post(
        "/openai/v1/chat/completions", json=_chat("fast", n=4, max_tokens=BOUND)
    )
    assert answer.status_code == 200
    assert upstream.bodies[-1]["n"] == 4


async def test_upstream_failures_reach_the_client_in_openais_envelope(replica) -> None:
    live, _ = replica
    broken = await live.client.post("/openai/v1/chat/completions", json=_chat("broken"))
    assert broken.status_code == 502
    assert broken.headers["content-type"] == "application/json"
    error = broken.json()["error"]
    assert error["code"] == "upstream_error" and "OverflowError: too big" in error["message"]
    teapot = await live.client.post("/openai/v1/chat/completions", json=_chat("teapot"))
    assert teapot.status_code == 418 and teapot.json()["error"]["code"] == "upstream_error"


@pytest.mark.parametrize(
    ("change", "status", "says"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, 5]}]},
            400,
            "`messages[0].content[1]`",
        ),
        (
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                        ],
                    },
                ]
            },
            400,
            "`messages[1].content[1]` is a `image_url` part",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            400,
            "`messages[0].content[0]`",
        ),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "`messages[0].role`"),
        ({"messages": [{"role": "user"}]}, 400, "`messages[0].content`"),
        ({"messages": ["hi"]}, 400, "`messages[0]`"),
        ({"messages": []}, 400, "`messages`"),
        ({"seed": 2**63}, 400, "`seed`"),
        ({"seed": -(2**63) - 1}, 400, "`seed`"),
        ({"seed": 1.5}, 400, "`seed`"),
        ({"temperature": 2.5}, 400, "`temperature`"),
        ({"temperature": "hot"}, 400, "`temperature`"),
        ({"top_p": -0.1}, 400, "`top_p`"),
        ({"n": 0}, 400, "`n`"),
        ({"n": True}, 400, "`n`"),
        ({"max_tokens": 0}, 400, "`max_tokens`"),
        ({"max_completion_tokens": 2**64}, 400, "`max_completion_tokens`"),
        ({"top_logprobs": 21}, 400, "`top_logprobs`"),
        ({"presence_penalty": 3}, 400, "`presence_penalty`"),
        ({"stream": "yes"}, 400, "`stream`"),
        ({"logprobs": 1}, 400, "`logprobs`"),
        ({"stop": [1]}, 400, "`stop`"),
        ({"tools": [{"type": "function"}]}, 400, "`tools[0].function`"),
        ({"tools": [{"type": "function", "function": {}}]}, 400, "`tools[0].function.name`"),
        ({"tools": [{"type": "code"}]}, 400, "`tools[0].type`"),
        ({"tools": {"a": 1}}, 400, "`tools`"),
        (
            {"messages": [{"role": "assistant", "content": "x", "tool_calls": [None]}]},
            400,
            "`messages[0].tool_calls[0]`",
        ),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
            400,
            "`messages[0].tool_calls[0].function`",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            400,
            "`messages[0].tool_calls`",
        ),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 1}]}, 400, "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "name": {}}]}, 400, "`messages[0].name`"),
        ({"model": "fast@"}, 404, "after `@`"),
        ({"model": "fast@01"}, 404, "after `@`"),
        ({"model": "fast@\u0661"}, 404, "after `@`"),  # an Arabic-Indic digit
        ({"model": "fast@\u00b2"}, 404, "after `@`"),  # a superscript two
        ({"model": "fast@-1"}, 404, "after `@`"),
        ({"model": "fast@99999999999999999999"}, 404, "after `@`"),
    ],
)
async def test_each_bad_chat_request_is_refused_by_path_in_openais_envelope(
    replica, change: dict[str, Any], status: int, says: str
) -> None:
    live, upstream = replica
    sent = len(upstream.bodies)
    response = await live.client.post(
        "/openai/v1/chat/completions", json={**_chat("fast"), **change}
    )
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert says in response.json()["error"]["message"]
    assert len(upstream.bodies) == sent  # nothing went upstream


async def test_the_whole_chat_request_is_forwarded_with_text_parts_joined(replica) -> None:
    live, upstream = replica
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {
        "model": "fast@2",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "say "}, {"type": "text", "text": "yes"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "content": "ok", "tool_call_id": "1"},
        ],
        "seed": 2**63 - 1,
        "temperature": 0,
        "top_p": 1,
        "tools": tools,
    }
    answer = await live.client.post("/openai/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    sent = upstream.bodies[-1]
    assert sent["model"] == "fast@2" and sent["seed"] == 2**63 - 1
    assert [m["content"] for m in sent["messages"]] == ["be brief", "say yes", None, "ok"]
    assert sent["tools"] == tools


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
_FIELDS = [
    "model",
    "messages",
    "n",
    "seed",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "tools",
    "tool_choice",
    "stop",
    "logprobs",
    "top_logprobs",
]
_message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _json,
        "content": st.text(max_size=5)
        | st.lists(
            st.fixed_dictionaries(
                {}, optional={"type": st.sampled_from(["text", "image_url"]) | _json, "text": _json}
            )
            | _json,
            max_size=3,
        )
        | _json,
        "tool_calls": _json,
    },
)
_body = st.fixed_dictionaries(
    {"model": st.sampled_from(["fast", "fast@1", "fast@latest", "fast@best"]) | _json},
    optional={
        "messages": st.lists(_message, max_size=3) | _json,
        **{field: _json for field in _FIELDS[2:]},
    },
)


def test_no_chat_request_makes_the_gateway_fail(replica_thread) -> None:
    """Fuzzing the request schema: every answer is JSON, and none is a 500."""
    url, upstream_seen = replica_thread

    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(_body)
    @example({"model": "fast", "messages": PROMPT, "n": 2, "seed": -1})
    @example({"model": "fast@1", "messages": [{"role": "user", "content": []}]})
    def probe(body: dict[str, Any]) -> None:
        response = httpx.post(f"{url}/openai/v1/chat/completions", json=body, timeout=30)
        assert response.status_code < 500, (body, response.text)
        assert response.headers["content-type"] == "application/json", (body, response.text)
        if response.status_code >= 400:
            assert isinstance(response.json()["error"]["message"], str)

    probe()
    assert upstream_seen() > 0  # some requests were whole and went through


@pytest.fixture
def replica_thread(serve, make_settings) -> Any:
    """The replica on a loop of its own thread, for a synchronous property test."""
    import threading

    ready: dict[str, Any] = {}
    stop = threading.Event()

    async def main() -> None:
        upstream = Upstream()
        async with LiveServer(upstream.app) as remote, serve() as live:
            base = str(make_settings().data_dir / "remote")
            created = await live.client.post(
                "/v1/models", json={"name": "fast", "base_model": base, "backend": "cpu"}
            )
            assert created.status_code == 201, created.text
            engine = create_engine(make_settings().database_url)
            async with write_connection(engine) as conn:
                await conn.execute(
                    update(ModelRow).values(current_step=3, inference_base_url=f"{remote.url}/v1")
                )
            await engine.dispose()
            ready["url"], ready["seen"] = live.url, lambda: len(upstream.bodies)
            while not stop.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    for _ in range(600):
        if "url" in ready or not thread.is_alive():
            break
        stop.wait(0.05)
    assert "url" in ready, "the replica did not start"
    yield ready["url"], ready["seen"]
    stop.set()
    thread.join(timeout=30)
