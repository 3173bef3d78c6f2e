"""Reads: how many `GET /v1/training-jobs/{id}` an API process answers per second, against
`GET /healthz` on the same process in the same minutes.

measured: requests per second of `GET /v1/training-jobs/{id}` (a queued job with a
collection, the shape an agent service polls), CONNECTIONS keep-alive connections each
sending its next request when the last answer is in, for SECONDS.
baseline: the same load on `GET /healthz`, which reaches the app but no database. Rounds
alternate the two, so the machine's drift falls on both; the medians are compared.
Measured twice: with a key from TRAINYARD_API_KEYS, then with a project's `write` key from
the database (found by its hash in the edge's cache, `app.tenants.keys.KeyBook`).

The load comes from raw asyncio sockets with each request's bytes made once: an HTTP
client library would spend more of the two cores than the server does on `/healthz`, and
the ratio would then measure the client.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time

import httpx

from bench.common import dumps, nat_collection, report, server

GOAL = 0.5
CONNECTIONS = 16
SECONDS = 3.0
ROUNDS = 3
KEY = "bench-key"


async def _connection(host: str, port: int, request: bytes, until: float) -> int:
    """Send `request` again and again on one connection until `until`; answers read."""
    reader, writer = await asyncio.open_connection(host, port)
    answered = 0
    try:
        while time.monotonic() < until:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b" ", 2)[1]
            if status != b"200":
                raise RuntimeError(f"answered {status.decode()}: {head[:200]!r}")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            answered += 1
    finally:
        writer.close()
    return answered


async def _rate(host: str, port: int, path: str, seconds: float = SECONDS, key: str = KEY) -> float:
    request = (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n\r\n"
    ).encode()
    start = time.monotonic()
    counts = await asyncio.gather(
        *(_connection(host, port, request, start + seconds) for _ in range(CONNECTIONS))
    )
    return sum(counts) / (time.monotonic() - start)


async def _measure(url: str, job_path: str, key: str) -> tuple[list[float], list[float]]:
    host, port = url.removeprefix("http://").split(":")
    await _rate(host, int(port), "/healthz", 0.5, key)  # warm both paths up, uncounted
    await _rate(host, int(port), job_path, 0.5, key)
    health, job = [], []
    for _ in range(ROUNDS):
        health.append(await _rate(host, int(port), "/healthz", key=key))
        job.append(await _rate(host, int(port), job_path, key=key))
    return health, job


def run() -> dict[str, float]:
    env = {"TRAINYARD_API_KEYS": KEY}
    with tempfile.TemporaryDirectory() as data:
        env["TRAINYARD_DATA_DIR"] = data
        with server(env) as (url, _process):
            headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
            with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
                # The job is the project's (its key sees only that project's jobs): made
                # with the project's key, read with it and with the admin key.
                project = client.post("/v1/projects", json={"name": "bench"}).json()["id"]
                made = client.post(
                    f"/v1/projects/{project}/keys", json={"name": "bench", "scopes": ["write"]}
                )
                assert made.status_code == 201, made.text[:500]
                secret = made.json()["secret"]
                client.headers["authorization"] = f"Bearer {secret}"
                model = {"name": "bench", "base_model": "b", "backend": "dry-run"}
                assert client.post("/v1/models", json=model).status_code == 201
                body = dumps({"model": "bench", "collection": nat_collection(trajectories=16)})
                created = client.post("/v1/training-jobs", content=body)
                assert created.status_code == 202, created.text[:500]
                job_path = f"/v1/training-jobs/{created.json()['id']}"
            health, job = asyncio.run(_measure(url, job_path, KEY))
            db_health, db_job = asyncio.run(_measure(url, job_path, secret))
    ratio = statistics.median(job) / statistics.median(health)
    db_ratio = statistics.median(db_job) / statistics.median(db_health)
    report(
        f"reads: GET a training job vs GET /healthz, API process, {CONNECTIONS} connections",
        [
            ("baseline: /healthz", " ".join(f"{r:.0f}" for r in health) + " req/s"),
            ("GET /v1/training-jobs/{id}", " ".join(f"{r:.0f}" for r in job) + " req/s"),
            ("ratio job / healthz (medians)", f"{ratio:.2f} (goal >= {GOAL})"),
            ("baseline: /healthz (database key)", " ".join(f"{r:.0f}" for r in db_health)),
            ("GET job, a project key from the database", " ".join(f"{r:.0f}" for r in db_job)),
            ("ratio job / healthz, database key", f"{db_ratio:.2f} (goal >= {GOAL})"),
        ],
    )
    return {"reads_ratio": ratio, "reads_ratio_db_key": db_ratio}


if __name__ == "__main__":
    run()
