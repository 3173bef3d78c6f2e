"""What a request meets before any route, tried as an attacker would, over real sockets:
the API key checked before the body is read, one answer for a body too large, a deadline
for a slow body and slow headers, header limits, idle connections, no redirects built
from `Host`, HEAD on every GET route, and docs served without a CDN."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from app.errors import PROBLEM_JSON
from tests import factories as f
from tests.backends import wait_final
from tests.conftest import LiveServer

pytestmark = pytest.mark.any_database

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MB = 1024 * 1024


# ---------------------------------------------------------------------------------------------
# A raw HTTP/1.1 client: what an attacker sends is bytes, not what httpx would send
# ---------------------------------------------------------------------------------------------


class Raw:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, live: LiveServer) -> Raw:
        port = int(live.url.rsplit(":", 1)[1])
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
        async with asyncio.timeout(timeout):
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return status, headers, body

    async def closed(self, timeout: float) -> bool:
        """Whether the server closes the connection within `timeout` (reading what comes)."""
        try:
            async with asyncio.timeout(timeout):
                while await self.reader.read(65536):
                    pass
            return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.writer.close()


def request(
    method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body is not None and not any(h.lower() == "content-length" for h in headers or {}):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def training_body(size: int) -> bytes:
    """A valid-looking training job body of about `size` bytes: many small groups."""
    one = json.dumps(f.art_groups([[1.0, 0.0]])[0]).encode()
    return b'{"model": "agent", "groups": [' + b",".join([one] * (size // len(one))) + b"]}"


def problem(body: bytes) -> dict[str, Any]:
    return json.loads(body)


# ---------------------------------------------------------------------------------------------
# 1. The API key is checked before the body is read
# ---------------------------------------------------------------------------------------------

PROTECTED_WRITES = [
    "/v1/training-jobs",
    "/v1/rollout-jobs",
    "/v1/models",
    "/v1/training-jobs/job_x/cancel",
    "/v1/no-such-route",
]
NOT_A_KEY = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": f"Bearer {KEY[:-1]}"},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": KEY},
    {"Authorization": "Bearer "},
    {"X-Api-Key": KEY},
]


@pytest.mark.parametrize("path", PROTECTED_WRITES)
async def test_a_huge_body_without_a_key_is_refused_before_it_is_sent(serve, path) -> None:
    # 62 MB declared, 1 KB sent: the 401 comes back at once, though the body never does.
    async with serve(api_keys=KEY) as live:
        raw = await Raw.open(live)
        head = {"Content-Type": "application/json", "Content-Length": str(62 * MB)}
        await raw.send(request("POST", path, head) + b'{"model": "agent", ' + b" " * 1024)
        started = time.perf_counter()
        status, headers, body = await raw.response(timeout=15)
        took = time.perf_counter() - started
        raw.close()
    assert status == 401, body
    assert headers["www-authenticate"] == "Bearer"
    assert headers["content-type"] == "application/problem+json"
    assert problem(body)["instance"] == path
    # At once: waiting for the body would take the body deadline (60 s); typically a few ms,
    # and the bound leaves a loaded machine 10 s.
    assert took < 10


@pytest.mark.parametrize("credentials", NOT_A_KEY)
async def test_every_kind_of_missing_or_wrong_key_is_refused_before_the_body(
    serve, credentials
) -> None:
    async with serve(api_keys=f"other,{KEY}") as live:
        raw = await Raw.open(live)
        head = {**credentials, "Content-Type": "application/json", "Content-Length": str(MB)}
        await raw.send(request("POST", "/v1/models", head) + b"{")
        status, headers, _ = await raw.response(timeout=3)
        raw.close()
    assert status == 401
    assert headers["www-authenticate"] == "Bearer"


async def test_a_62_mb_body_without_a_key_costs_nothing_and_health_stays_fast(serve) -> None:
    body = training_body(62 * MB)
    async with serve(api_keys=KEY) as live:
        latencies: list[float] = []
        done = asyncio.Event()

        async def probe() -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=5) as client:
                while not done.is_set():
                    started = time.perf_counter()
                    assert (await client.get("/healthz")).status_code == 200
                    latencies.append(time.perf_counter() - started)
                    await asyncio.sleep(0.02)

        prober = asyncio.create_task(probe())
        started = time.perf_counter()
        response = await live.client.post(
            "/v1/training-jobs", content=body, headers={"content-type": "application/json"}
        )
        took = time.perf_counter() - started
        done.set()
        await prober
        # The connection was kept and the rest of the body discarded: it serves the next.
        again = await live.client.get("/v1/models", headers=AUTH)
    assert response.status_code == 401
    # Stall detectors only, 10x what a correct build takes on a loaded machine; how fast
    # /healthz answers meanwhile is measured by `python -m bench.stalls`.
    assert took < 20, took  # the body was parsed whole for ~4 s before (unloaded)
    assert latencies and max(latencies) < 10, max(latencies)
    assert again.status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        b'{"name": ',  # malformed JSON
        b"\xff\xfe\x00not utf-8",
        b"[" * 100_000,  # nesting past the parser's limit
        json.dumps({"name": "bad name!", "base_model": ""}).encode(),  # invalid fields
        json.dumps(f.model_body()).encode(),  # a valid body: still no key
    ],
)
async def test_any_body_without_a_key_is_401_never_422(serve, body) -> None:
    async with serve(api_keys=KEY) as live:
        response = await live.client.post(
            "/v1/models", content=body, headers={"content-type": "application/json"}
        )
        listed = await live.client.get("/v1/models", headers=AUTH)
    assert response.status_code == 401, response.text
    assert response.json()["detail"].startswith("Missing or invalid API key")
    assert listed.json()["data"] == []


async def test_a_chunked_body_without_a_key_is_401(serve) -> None:
    async def chunks():
        for _ in range(50):
            yield b" " * 1000
            await asyncio.sleep(0)

    async with serve(api_keys=KEY) as live:
        response = await live.client.post(
            "/v1/training-jobs", content=chunks(), headers={"content-type": "application/json"}
        )
    assert response.status_code == 401


async def test_a_body_after_a_401_is_never_read_as_the_next_request(serve) -> None:
    # The refused body is a request itself: it must be discarded, not served.
    smuggled = request("GET", "/v1/models", AUTH)
    async with serve(api_keys=KEY) as live:
        raw = await Raw.open(live)
        await raw.send(request("POST", "/v1/models", {"Content-Type": "text/plain"}, smuggled))
        first, _, _ = await raw.response()
        await raw.send(request("GET", "/healthz"))
        second, _, body = await raw.response()
        raw.close()
    assert first == 401
    assert second == 200 and json.loads(body) == {"status": "ok"}


async def test_a_valid_key_reaches_the_routes(serve) -> None:
    async with serve(api_keys=f"other, {KEY}") as live:
        created = await live.client.post("/v1/models", json=f.model_body(), headers=AUTH)
        lower = await live.client.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})
        spaced = await live.client.get("/v1/models", headers={"Authorization": f"Bearer  {KEY}"})
    assert created.status_code == 201, created.text
    assert lower.status_code == spaced.status_code == 200


OPEN = [
    "/healthz",
    "/readyz",
    "/openapi.json",
    "/docs",
    "/redoc",
    "/dashboard/",
    "/dashboard/app.js",
]


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models",
        "/v1/models/",
        "/v1/backends",
        "/v1/training-jobs/job_x/events/stream",
        "/healthz/",  # near an open path is not open
        "/HEALTHZ",
        "/healthz/../v1/models",
        "//v1/models",
        "/docs/../v1/models",
        "/dashboard/../v1/models",
        "/dashboard/nothing.js",
        "/v1/nothing-here",
        "/",
    ],
)
async def test_everything_but_health_metrics_and_docs_needs_the_key(serve, path) -> None:
    async with serve(api_keys=KEY) as live:
        raw = await Raw.open(live)
        await raw.send(request("GET", path))
        status, headers, _ = await raw.response()
        raw.close()
    assert status == 401, path
    assert "location" not in headers


async def test_every_operation_the_document_protects_needs_the_key(serve) -> None:
    """The key is checked by the edge alone: every operation the OpenAPI document marks
    with the bearer scheme answers 401 without it, and only health's are left unmarked."""
    async with serve(api_keys=KEY) as live:
        document = (await live.client.get("/openapi.json")).json()
        assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
        unmarked, answered = [], {}
        for template, operations in document["paths"].items():
            path = re.sub(r"\{[^}]+\}", "x", template)
            for method, operation in operations.items():
                if operation.get("security") != [{"HTTPBearer": []}]:
                    unmarked.append(template)
                    continue
                response = await live.client.request(method.upper(), path, content=b"{}")
                answered[f"{method.upper()} {template}"] = response.status_code
    assert sorted(unmarked) == ["/healthz", "/readyz"]
    assert len(answered) > 40
    assert set(answered.values()) == {401}, answered


@pytest.mark.parametrize("path", OPEN)
async def test_health_and_docs_stay_open(serve, path) -> None:
    async with serve(api_keys=KEY) as live:
        response = await live.client.get(path)
    assert response.status_code == 200, (path, response.text)


# ---------------------------------------------------------------------------------------------
# 2. No redirect built from the Host header
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models/"),
        ("GET", "/v1/training-jobs/"),
        ("POST", "/v1/training-jobs/"),
        ("GET", "/healthz/"),
        ("GET", "/v1/backends/"),
    ],
)
@pytest.mark.parametrize("keys", ["", KEY])
async def test_a_stray_slash_is_a_404_problem_not_a_redirect(serve, method, path, keys) -> None:
    async with serve(api_keys=keys) as live:
        raw = await Raw.open(live)
        head = {"Host": "evil.example", **AUTH}
        await raw.send(request(method, path, head, b"{}" if method == "POST" else None))
        status, headers, body = await raw.response()
        raw.close()
    assert status == 404, body
    assert "location" not in headers
    assert headers["content-type"] == "application/problem+json"
    assert b"evil.example" not in body


# ---------------------------------------------------------------------------------------------
# 3. A body too large is one problem type, however it is sent
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models", "/v1/training-jobs", "/v1/rollout-jobs"])
async def test_both_413s_are_the_same_problem(serve, path) -> None:
    async def chunks():
        for _ in range(20):
            yield b" " * 1000

    async with serve(max_body_bytes=4096) as live:
        declared = await live.client.post(path, content=b" " * 10_000)
        streamed = await live.client.post(path, content=chunks())
        raw = await Raw.open(live)  # declared: answered before a byte of it is sent
        await raw.send(request("POST", path, {"Content-Length": str(10 * MB)}))
        status, _, early = await raw.response(timeout=3)
        raw.close()
    assert declared.status_code == streamed.status_code == status == 413
    kinds = {
        (p["type"], p["title"], p["status"])
        for p in (declared.json(), streamed.json(), problem(early))
    }
    assert kinds == {("urn:trainyard:problem:body-too-large", "Content Too Large", 413)}
    assert declared.headers["content-type"] == streamed.headers["content-type"]
    assert declared.headers["content-type"] == "application/problem+json"


# ---------------------------------------------------------------------------------------------
# 4. HEAD works on every GET route, and Allow says so truthfully
# ---------------------------------------------------------------------------------------------


async def test_head_answers_as_get_without_a_body_on_every_get_route(serve) -> None:
    async with serve(worker_enabled=True) as live:
        await f.create_model(live.client)
        job = (await f.submit(live.client)).json()
        await wait_final(live.client, job["id"])
        ids = {"name": "agent", "id": job["id"]}
        document = (await live.client.get("/openapi.json")).json()
        paths = [p for p, item in document["paths"].items() if "get" in item]
        paths += ["/openapi.json", "/docs", "/redoc", "/dashboard/", "/dashboard/chart.js"]
        paths += ["/v1/models/missing", "/v1/nothing"]
        for template in paths:
            path = re.sub(r"\{(\w+)\}", lambda m: ids.get(m.group(1), "x"), template)
            get = await live.client.get(path)
            head = await live.client.head(path)
            assert head.content == b"", path
            if path == "/readyz":
                # Readiness is the moment's (a worker heartbeat late on a loaded machine is
                # a 503): a HEAD answers as a GET with its own status would.
                assert head.status_code in (200, 503), path
                shape = "application/json" if head.status_code == 200 else PROBLEM_JSON
                assert head.headers["content-type"] == shape, path
                continue
            assert head.status_code == get.status_code, path
            assert head.headers["content-type"] == get.headers["content-type"], path
            if "content-length" in get.headers and path != "/metrics":
                assert head.headers["content-length"] == get.headers["content-length"], path


async def test_head_on_a_live_event_stream_ends_at_once(serve) -> None:
    async with serve(worker_enabled=True) as live:
        await f.create_model(live.client, seconds_per_step=30)
        job = (await f.submit(live.client)).json()
        started = time.perf_counter()
        head = await live.client.head(f"/v1/training-jobs/{job['id']}/events/stream")
        took = time.perf_counter() - started
        await live.client.post(f"/v1/training-jobs/{job['id']}/cancel")
    assert head.status_code == 200
    assert head.headers["content-type"].startswith("text/event-stream")
    assert took < 10  # the stream itself would stay open for the 30 s step


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/v1/models", {"GET", "HEAD", "POST"}),
        ("/v1/training-jobs/job_x/cancel", {"POST"}),
        ("/v1/training-jobs/job_x", {"GET", "HEAD"}),
        ("/healthz", {"GET", "HEAD"}),
    ],
)
async def test_allow_lists_exactly_the_methods_that_work(live, path, allowed) -> None:
    refused = await live.client.request("DELETE", path)
    head = await live.client.head(path)
    assert refused.status_code == 405
    assert set(refused.headers["allow"].split(", ")) == allowed
    assert (head.status_code != 405) == ("HEAD" in allowed)
    if "HEAD" not in allowed:
        assert set(head.headers["allow"].split(", ")) == allowed


# ---------------------------------------------------------------------------------------------
# 6. The docs pages load nothing from elsewhere
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_docs_pages_load_their_assets_from_the_service(serve, page) -> None:
    async with serve(api_keys=KEY) as live:  # no key: the docs are open
        html = (await live.client.get(page)).text
        urls = re.findall(r"""(?:src|href)=["']([^"']+)""", html)
        assets = {url: await live.client.get(url) for url in urls}
    assert "//" not in "".join(urls) and "http" not in html.replace("http-equiv", "")
    assert any(url.endswith(".js") for url in urls)
    for url, response in assets.items():
        assert response.status_code == 200, url
        assert len(response.content) > 1000, url
    if page == "/docs":  # Swagger UI 5, which renders the OpenAPI 3.1 document
        bundle = next(r for u, r in assets.items() if u.endswith(".js")).text
        assert "isOAS31" in bundle


async def test_the_dashboard_is_served_strictly_and_loads_nothing_from_elsewhere(serve) -> None:
    async with serve(api_keys=KEY) as live:  # no key: the dashboard's files hold no data
        moved = await live.client.get("/dashboard")
        html = await live.client.get("/dashboard/")
        found = re.findall(r"""(?:src|href)=["']([^"'#]+)""", html.text)
        urls = [url for url in found if url != "data:,"]  # the empty icon: no request
        imported = ["base.js", "chart.js", "compare.js", "usage.js"]  # by app.js
        assets = {url: await live.client.get(f"/dashboard/{url}") for url in urls + imported}
        etag = assets["app.js"].headers["etag"]
        again = await live.client.get("/dashboard/app.js", headers={"If-None-Match": etag})
    # A relative Location: never one built from the Host header.
    assert moved.status_code == 308 and moved.headers["location"] == "dashboard/"
    assert sorted(urls) == ["app.js", "dashboard.css"]
    assert "<script>" not in html.text and "style=" not in html.text
    for response in (html, *assets.values()):
        assert response.status_code == 200
        assert "default-src 'self'" in response.headers["content-security-policy"]
        assert "script-src 'self';" in response.headers["content-security-policy"]
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["cache-control"] == "no-cache"
        assert "http" not in response.text.replace("http://www.w3.org/2000/svg", "")
    assert assets["app.js"].headers["content-type"].startswith("text/javascript")
    assert all("innerHTML" not in assets[name].text for name in ["app.js", *imported])
    assert again.status_code == 304 and again.content == b""


# ---------------------------------------------------------------------------------------------
# 7. Slow and idle connections: body deadline, header deadline, header limits, keep-alive
# ---------------------------------------------------------------------------------------------


async def _drip(raw: Raw, data: bytes, interval: float) -> None:
    try:
        for i in range(len(data)):
            await raw.send(data[i : i + 1])
            await asyncio.sleep(interval)
    except (ConnectionError, OSError):
        pass


@pytest.mark.parametrize(
    ("path", "keys", "headers"),
    [
        ("/v1/models", "", {"Content-Length": "200"}),
        ("/v1/training-jobs", KEY, {"Content-Length": "200", **AUTH}),
        ("/v1/models", "", {"Transfer-Encoding": "chunked"}),
        ("/v1/nothing", "", {"Content-Length": "200"}),
    ],
)
async def test_a_body_sent_a_byte_at_a_time_is_cut_off_with_408(serve, path, keys, headers) -> None:
    async with serve(api_keys=keys, body_timeout_seconds=1) as live:
        raw = await Raw.open(live)
        await raw.send(request("POST", path, {"Content-Type": "application/json", **headers}))
        payload = b"1\r\n{\r\n" * 100 if "Transfer-Encoding" in headers else b"{" * 200
        dripping = asyncio.create_task(_drip(raw, payload, 0.1))
        started = time.perf_counter()
        status, response_headers, body = await raw.response(timeout=15)
        took = time.perf_counter() - started
        closed = await raw.closed(10)
        dripping.cancel()
        raw.close()
        healthy = await live.client.get("/healthz")
    assert status == 408, body
    assert problem(body)["type"] == "urn:trainyard:problem:request-timeout"
    assert response_headers["content-type"] == "application/problem+json"
    assert 0.9 < took < 10  # the deadline is 1 s; the drip lasts 20 s or more
    assert closed
    assert healthy.status_code == 200


async def test_a_body_that_never_comes_is_cut_off_with_408(serve) -> None:
    async with serve(body_timeout_seconds=0.5) as live:
        raw = await Raw.open(live)
        await raw.send(request("POST", "/v1/models", {"Content-Length": "10"}))
        status, _, _ = await raw.response(timeout=15)
        raw.close()
    assert status == 408


async def test_a_slow_body_within_the_deadline_is_served(serve) -> None:
    body = json.dumps(f.model_body()).encode()
    # Sent in 4 pieces over ~0.6 s: well within the deadline.
    async with serve(body_timeout_seconds=5) as live:
        raw = await Raw.open(live)
        head = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        await raw.send(request("POST", "/v1/models", head))
        for i in range(0, len(body), len(body) // 4 + 1):
            await raw.send(body[i : i + len(body) // 4 + 1])
            await asyncio.sleep(0.15)
        status, _, answer = await raw.response()
        raw.close()
    assert status == 201, answer


@pytest.mark.parametrize(
    "partial",
    [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n",  # headers never end
        b"GET /heal",  # the request line never ends
        b"POST /v1/models HTTP/1.1\r\nContent-Length: 2\r\nX-Slow: ",
    ],
)
async def test_headers_that_never_end_get_408_and_the_connection_closed(serve, partial) -> None:
    async with serve(header_timeout_seconds=1) as live:
        raw = await Raw.open(live)
        await raw.send(partial)
        started = time.perf_counter()
        status, headers, body = await raw.response(timeout=15)
        took = time.perf_counter() - started
        closed = await raw.closed(10)
        raw.close()
    assert status == 408
    assert problem(body)["type"] == "urn:trainyard:problem:request-timeout"
    assert headers["connection"] == "close" and closed
    assert 0.8 < took < 10  # the deadline is 1 s; 10x for a loaded machine


async def test_headers_dripped_a_byte_at_a_time_are_cut_off(serve) -> None:
    async with serve(header_timeout_seconds=1) as live:
        raw = await Raw.open(live)
        dripping = asyncio.create_task(_drip(raw, b"GET /healthz HTTP/1.1\r\n" + b"X" * 200, 0.1))
        status, _, _ = await raw.response(timeout=15)
        dripping.cancel()
        raw.close()
    assert status == 408


async def test_a_connection_that_sends_nothing_is_closed(serve) -> None:
    async with serve(header_timeout_seconds=1) as live:
        raw = await Raw.open(live)
        started = time.perf_counter()
        closed = await raw.closed(15)
        took = time.perf_counter() - started
        raw.close()
    assert closed and 0.8 < took < 10  # the deadline is 1 s; 10x for a loaded machine


async def test_an_idle_keep_alive_connection_is_closed(serve) -> None:
    async with serve(keep_alive_seconds=1, header_timeout_seconds=30) as live:
        raw = await Raw.open(live)
        await raw.send(request("GET", "/healthz"))
        status, _, _ = await raw.response()
        started = time.perf_counter()
        closed = await raw.closed(15)
        took = time.perf_counter() - started
        raw.close()
    assert status == 200
    assert closed and took < 10  # keep-alive 1 s; 10x for a loaded machine


@pytest.mark.parametrize(
    "oversized",
    [
        request("GET", "/healthz", {"X-Big": "a" * 8000}),
        request("GET", "/healthz?" + "q=1&" * 2000),
        request("GET", "/healthz", {f"X-H{i}": "v" * 40 for i in range(200)}),
        b"GET /healthz HTTP/1.1\r\nX-Never-Ends: " + b"a" * 64_000,  # no end in sight
    ],
)
async def test_headers_over_the_limit_get_431(serve, oversized) -> None:
    async with serve(max_header_bytes=4096) as live:
        raw = await Raw.open(live)
        await raw.send(oversized)
        status, headers, body = await raw.response(timeout=4)
        raw.close()
        healthy = await live.client.get("/healthz", headers={"X-Fits": "a" * 3000})
    assert status == 431, body
    assert problem(body)["type"] == "urn:trainyard:problem:headers-too-large"
    assert headers["connection"] == "close"
    assert healthy.status_code == 200


async def test_a_refused_body_is_drained_for_a_bounded_time_only(serve) -> None:
    async with serve(api_keys=KEY, body_timeout_seconds=1) as live:
        raw = await Raw.open(live)
        await raw.send(request("POST", "/v1/models", {"Content-Length": str(MB)}) + b"{")
        status, _, _ = await raw.response()
        dripping = asyncio.create_task(_drip(raw, b" " * 200, 0.1))  # never finishes
        started = time.perf_counter()
        closed = await raw.closed(15)
        took = time.perf_counter() - started
        dripping.cancel()
        raw.close()
    assert status == 401
    # Drained for the 1 s body deadline, not the 20 s drip (nor the MB it declared).
    assert closed and took < 10


# ---------------------------------------------------------------------------------------------
# `trainyard serve` applies the same settings; a key list with no key refuses to start
# ---------------------------------------------------------------------------------------------


def _serve_process(make_settings: Callable[..., Any], port: int, **extra: str) -> Any:
    from tests.processes import start_api

    return start_api(make_settings(), port, TRAINYARD_WORKER_ENABLED="false", **extra)


@pytest.mark.slow
async def test_trainyard_serve_applies_the_connection_limits(make_settings) -> None:
    from tests.processes import free_port, stop, wait_ready

    port = free_port()
    process = _serve_process(
        make_settings,
        port,
        TRAINYARD_HEADER_TIMEOUT_SECONDS="1",
        TRAINYARD_MAX_HEADER_BYTES="4096",
        TRAINYARD_BODY_TIMEOUT_SECONDS="1",
        TRAINYARD_API_KEYS=KEY,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(url, [process], timeout=60)
        live = type("Live", (), {"url": url})()
        raw = await Raw.open(live)  # type: ignore[arg-type]
        await raw.send(b"GET /healthz HTTP/1.1\r\n")
        slow_headers, _, _ = await raw.response(timeout=4)
        raw.close()
        raw = await Raw.open(live)  # type: ignore[arg-type]
        await raw.send(request("GET", "/healthz", {"X-Big": "a" * 8000}))
        big_headers, _, _ = await raw.response(timeout=4)
        raw.close()
        raw = await Raw.open(live)  # type: ignore[arg-type]
        await raw.send(request("POST", "/v1/models", {**AUTH, "Content-Length": "50"}) + b"{")
        slow_body, _, _ = await raw.response(timeout=4)
        raw.close()
        async with httpx.AsyncClient(base_url=url) as client:
            no_key = await client.post("/v1/models", content=b"{")
    finally:
        stop(process)
    assert (slow_headers, big_headers, slow_body, no_key.status_code) == (408, 431, 408, 401)


@pytest.mark.slow
@pytest.mark.parametrize("keys", [",", " , ", ",,,", "\t"])
def test_trainyard_serve_refuses_a_key_list_without_a_key(make_settings, keys) -> None:
    import subprocess

    from tests.processes import TRAINYARD, environment

    env = environment(make_settings(), TRAINYARD_API_KEYS=keys, TRAINYARD_PORT="1")
    result = subprocess.run(
        [TRAINYARD, "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert "TRAINYARD_API_KEYS" in result.stderr
    assert "Traceback" not in result.stderr
