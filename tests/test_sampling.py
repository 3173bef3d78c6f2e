"""The sampling client against a fake OpenAI-compatible server on loopback: concurrency
bound, connection reuse, retries on transient failures, errors that are not retried."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)

from app.rollouts import sampling
from app.rollouts.sampling import SamplingClient, SamplingError
from tests.conftest import LiveServer

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}


def completion(model: str, content: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
                "logprobs": {
                    "content": [
                        {"token": "token_id:7", "logprob": -0.5, "bytes": None, "top_logprobs": []}
                    ]
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


class FakeOpenAI:
    """`/v1/chat/completions` that records what it sees and misbehaves on request."""

    def __init__(self) -> None:
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.ports: set[int] = set()
        self.headers: list[dict[str, str]] = []
        self.delay = 0.0
        self.fail_first = 0
        self.fail_status = 503
        self.retry_after: str | None = None
        self.reject = False
        self.garbage = False
        self.padding = 0
        self.stream = False
        self.redirect = False
        self.release = asyncio.Event()
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            self.requests += 1
            number = self.requests
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                assert request.client is not None
                self.ports.add(request.client.port)
                self.headers.append(dict(request.headers))
                body = await request.json()
                if self.delay:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.release.wait(), self.delay)
                if number <= self.fail_first:
                    headers = {"retry-after": self.retry_after} if self.retry_after else None
                    return JSONResponse(
                        {"error": {"message": "overloaded, try later", "type": "server_error"}},
                        status_code=self.fail_status,
                        headers=headers,
                    )
                if self.reject:
                    return JSONResponse(
                        {
                            "error": {
                                "message": "max_tokens is too large: 99999",
                                "type": "invalid_request_error",
                                "param": "max_tokens",
                                "code": None,
                            }
                        },
                        status_code=400,
                    )
                if self.garbage:
                    return PlainTextResponse("<html>proxy page</html>")
                if self.redirect:
                    return RedirectResponse("/v1/elsewhere", status_code=302)
                content = f"answer {number}" + " " * self.padding
                answer = json.dumps(completion(body["model"], content)).encode()
                if self.stream:  # chunked, no Content-Length: 64 KiB at a time
                    pieces = [answer[i : i + 65536] for i in range(0, len(answer), 65536)]
                    return StreamingResponse(iter(pieces), media_type="application/json")
                return Response(answer, media_type="application/json")
            finally:
                self.in_flight -= 1

        self.live = LiveServer(app)

    @property
    def base_url(self) -> str:
        return f"{self.live.url}/v1"


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    server = FakeOpenAI()
    async with server.live:
        yield server
        server.release.set()  # cut short what a client gave up on


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_returns_the_completion(fake: FakeOpenAI) -> None:
    async with SamplingClient(fake.base_url + "/", None) as client:
        result = await client.chat(BODY)
    assert result["object"] == "chat.completion"
    assert result["choices"][0]["message"]["content"] == "answer 1"
    assert result["choices"][0]["logprobs"]["content"][0]["token"] == "token_id:7"


async def test_at_most_concurrency_requests_in_flight_over_reused_connections(
    fake: FakeOpenAI,
) -> None:
    fake.delay = 0.05
    async with SamplingClient(fake.base_url, None, concurrency=4) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(client.chat(BODY) for _ in range(20)))
        elapsed = time.perf_counter() - start
    assert len(results) == 20
    assert fake.requests == 20
    assert fake.max_in_flight == 4
    assert len(fake.ports) <= 4  # keep-alive: no new connection per request
    assert elapsed >= 0.25  # five waves of 50 ms (how much longer is the machine's load)


async def test_many_in_flight_stay_bounded_each_on_a_reused_connection(
    fake: FakeOpenAI,
) -> None:
    fake.delay = 0.05
    async with SamplingClient(fake.base_url, None, concurrency=12) as client:
        results = await asyncio.gather(*(client.chat(BODY) for _ in range(48)))
        results += await asyncio.gather(*(client.chat(BODY) for _ in range(12)))
    assert len(results) == 60
    assert fake.max_in_flight == 12
    assert len(fake.ports) == 12  # every slot's connection, each one reused


async def test_sends_the_bearer_key_only_when_given(fake: FakeOpenAI) -> None:
    async with SamplingClient(fake.base_url, "sk-test") as client:
        await client.chat(BODY)
    async with SamplingClient(fake.base_url, None) as client:
        await client.chat(BODY)
    assert fake.headers[0]["authorization"] == "Bearer sk-test"
    assert fake.headers[0]["content-type"] == "application/json"
    assert "authorization" not in fake.headers[1]


@pytest.mark.parametrize("status", [503, 500, 429])
async def test_retries_transient_statuses_then_succeeds(fake: FakeOpenAI, status: int) -> None:
    fake.fail_first, fake.fail_status = 2, status
    async with SamplingClient(fake.base_url, None, retries=3, backoff=0.01) as client:
        result = await client.chat(BODY)
    assert result["choices"][0]["message"]["content"] == "answer 3"
    assert fake.requests == 3


async def test_waits_at_least_what_retry_after_asks(fake: FakeOpenAI) -> None:
    fake.fail_first, fake.fail_status, fake.retry_after = 1, 429, "0.3"
    async with SamplingClient(fake.base_url, None, backoff=0.01) as client:
        start = time.perf_counter()
        await client.chat(BODY)
        elapsed = time.perf_counter() - start
    assert fake.requests == 2
    assert 0.3 <= elapsed < 3.0  # 10x what it asked: a loaded machine adds, never waits less


async def test_a_saturated_endpoint_is_waited_out_without_spending_attempts(
    fake: FakeOpenAI,
) -> None:
    """429 (admission control): runs and rollouts wait their turn rather than fail."""
    fake.fail_first, fake.fail_status = 6, 429
    async with SamplingClient(fake.base_url, None, retries=1, backoff=0.01) as client:
        result = await client.chat(BODY)
    assert result["choices"][0]["message"]["content"] == "answer 7"
    assert fake.requests == 7


async def test_exhausted_retries_are_a_transient_error_with_the_last_message(
    fake: FakeOpenAI,
) -> None:
    fake.fail_first = 100
    async with SamplingClient(fake.base_url, None, retries=2, backoff=0.01) as client:
        with pytest.raises(SamplingError) as info:
            await client.chat(BODY)
    assert info.value.transient is True
    assert info.value.status == 503
    assert str(info.value) == (
        "chat completion failed after 3 attempts: HTTP 503: overloaded, try later"
    )
    assert fake.requests == 3


async def test_400_is_not_retried_and_carries_the_servers_message(fake: FakeOpenAI) -> None:
    fake.reject = True
    async with SamplingClient(fake.base_url, None, retries=3, backoff=0.01) as client:
        with pytest.raises(SamplingError) as info:
            await client.chat(BODY)
    assert info.value.transient is False
    assert info.value.status == 400
    assert info.value.message == "HTTP 400: max_tokens is too large: 99999"
    assert fake.requests == 1


async def test_404_without_an_openai_envelope_is_not_retried(fake: FakeOpenAI) -> None:
    async with SamplingClient(fake.live.url + "/v2", None, backoff=0.01) as client:
        with pytest.raises(SamplingError) as info:
            await client.chat(BODY)
    assert info.value.transient is False
    assert info.value.message == "HTTP 404: Not Found"  # FastAPI's {"detail": ...}


async def test_a_success_that_is_not_json_is_not_retried(fake: FakeOpenAI) -> None:
    fake.garbage = True
    async with SamplingClient(fake.base_url, None, backoff=0.01) as client:
        with pytest.raises(SamplingError, match="not a JSON object: <html>proxy page") as info:
            await client.chat(BODY)
    assert info.value.transient is False
    assert fake.requests == 1


@pytest.mark.parametrize("stream", [False, True], ids=["content-length", "chunked"])
async def test_a_large_answer_is_read_whole(fake: FakeOpenAI, stream: bool) -> None:
    """Megabytes arrive over many reads of the socket: every one is read."""
    fake.padding, fake.stream = 3 * 1024 * 1024, stream
    async with SamplingClient(fake.base_url, None, backoff=0.01) as client:
        result = await client.chat(BODY)
    content = result["choices"][0]["message"]["content"]
    assert content == "answer 1" + " " * fake.padding
    assert fake.requests == 1


@pytest.mark.parametrize("stream", [False, True], ids=["content-length", "chunked"])
async def test_an_answer_over_the_limit_is_refused_not_retried(
    fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """Refused from its Content-Length, or while it is read when it is sent chunked."""
    monkeypatch.setattr(sampling, "MAX_ANSWER_BYTES", 100_000)
    fake.padding, fake.stream = 200_000, stream
    async with SamplingClient(fake.base_url, None, retries=3, backoff=0.01) as client:
        with pytest.raises(SamplingError, match="with an answer over 100000 bytes") as info:
            await client.chat(BODY)
        fake.padding = 90_000  # under the limit once the rest of the JSON is added
        assert (await client.chat(BODY))["choices"][0]["message"]["content"].startswith("answer")
    assert info.value.transient is False
    assert info.value.status == 200
    assert fake.requests == 2


async def test_a_redirect_is_not_followed(fake: FakeOpenAI) -> None:
    fake.redirect = True
    async with SamplingClient(fake.base_url, None, retries=3, backoff=0.01) as client:
        with pytest.raises(SamplingError) as info:
            await client.chat(BODY)
    assert info.value.transient is False
    assert info.value.status == 302
    assert info.value.message.startswith("HTTP 302")
    assert fake.requests == 1


async def test_timeouts_are_retried_then_a_transient_error(fake: FakeOpenAI) -> None:
    fake.delay = 30.0  # released when the test ends
    async with SamplingClient(fake.base_url, None, timeout=0.1, retries=2, backoff=0.01) as c:
        start = time.perf_counter()
        with pytest.raises(SamplingError) as info:
            await c.chat(BODY)
        elapsed = time.perf_counter() - start
    assert info.value.transient is True
    assert info.value.message == "chat completion failed after 3 attempts: timed out after 0.1 s"
    assert fake.requests == 3
    assert 0.3 <= elapsed < 3.0  # three timeouts of 0.1 s, not one answer of 30 s


async def test_a_timeout_then_a_fast_answer_succeeds(fake: FakeOpenAI) -> None:
    fake.delay = 2.0
    async with SamplingClient(fake.base_url, None, timeout=0.1, backoff=0.01) as client:
        task = asyncio.create_task(client.chat(BODY))
        while fake.requests < 1:
            await asyncio.sleep(0.005)
        fake.delay = 0.0
        result = await asyncio.wait_for(task, 2)
    assert result["choices"][0]["message"]["content"] == "answer 2"


async def test_connection_refused_is_retried_then_a_transient_error() -> None:
    client = SamplingClient(f"http://127.0.0.1:{closed_port()}/v1", None, retries=1, backoff=0.01)
    async with client:
        with pytest.raises(SamplingError) as info:
            await client.chat(BODY)
    assert info.value.transient is True
    assert info.value.status is None
    assert "after 2 attempts: ConnectError" in info.value.message


async def test_the_proxy_the_environment_names_is_used_unless_no_proxy_holds_the_host(
    fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("http_proxy", "https_proxy", "no_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{closed_port()}")  # nobody there
    async with SamplingClient(fake.base_url, None, retries=0) as client:
        with pytest.raises(SamplingError, match="ConnectError"):
            await client.chat(BODY)
    assert fake.requests == 0  # it went to the proxy, not to the endpoint
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    async with SamplingClient(fake.base_url, None, retries=0) as client:
        assert (await client.chat(BODY))["choices"][0]["message"]["content"] == "answer 1"


async def test_a_body_that_is_not_json_fails_before_any_request() -> None:
    async with SamplingClient(f"http://127.0.0.1:{closed_port()}/v1", None) as client:
        with pytest.raises(SamplingError, match="not valid JSON") as info:
            await client.chat({"temperature": float("nan")})
    assert info.value.transient is False


@pytest.mark.parametrize(
    ("base_url", "options"),
    [
        ("ftp://127.0.0.1/v1", {}),
        ("/v1", {}),
        ("http://127.0.0.1/v1", {"concurrency": 0}),
        ("http://127.0.0.1/v1", {"timeout": 0}),
        ("http://127.0.0.1/v1", {"retries": -1}),
    ],
)
def test_rejects_bad_settings(base_url: str, options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SamplingClient(base_url, None, **options)
