"""Uploads: does a 30 MB dataset upload hold the event loop?

measured: `/healthz` latency on `trainyard serve` (its own process, SQLite, no worker),
asked every 20 ms on connections of its own while a 30 MB JSON Lines dataset is POSTed
to `/v1/datasets` in two shapes of many small messages (a few bytes each, the most
objects per byte): 3,800 lines of 200 messages, and 37 lines of 20,000 (each line about
800 KB); p50, p99 and max, from when each probe was due (a late probe counts its wait).
baseline: the same probe on the same process, idle, for 3 s just before.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time

import httpx

from bench.common import report, server

INTERVAL = 0.02
TARGET_BYTES = 30_000_000
GOAL_P99 = 0.1  # seconds: /healthz p99 during the upload


def dataset_lines(target: int = TARGET_BYTES, turns: int = 200) -> bytes:
    """JSON Lines of about `target` bytes, each example `turns` tiny messages long."""
    lines: list[bytes] = []
    size = 0
    while size < target:
        i = len(lines)
        messages = [
            {"role": "user" if t % 2 == 0 else "assistant", "content": f"m{t}"}
            for t in range(turns)
        ]
        line = json.dumps({"id": f"ex-{i}", "messages": messages, "expected": "4"}).encode()
        lines.append(line)
        size += len(line) + 1
    return b"\n".join(lines) + b"\n"


class Probe:
    """Asks `/healthz` every INTERVAL seconds, each on a connection of the pool."""

    def __init__(self, url: str) -> None:
        self.client = httpx.AsyncClient(base_url=url, timeout=60)
        self.latencies: list[float] = []
        self.failures = 0

    async def _one(self, due: float) -> None:
        try:
            response = await self.client.get("/healthz")
            if response.status_code != 200:
                self.failures += 1
        except httpx.HTTPError:
            self.failures += 1
        self.latencies.append(asyncio.get_running_loop().time() - due)

    async def during(self, work: asyncio.Future[object] | float) -> list[float]:
        """Probe until `work` is done (or for `work` seconds); the latencies."""
        loop = asyncio.get_running_loop()
        self.latencies = []
        tasks: list[asyncio.Task[None]] = []
        due = loop.time()
        end = loop.time() + work if isinstance(work, float) else None
        while (not work.done()) if end is None else loop.time() < end:  # type: ignore[union-attr]
            while due <= loop.time():
                tasks.append(asyncio.create_task(self._one(due)))
                due += INTERVAL
            await asyncio.sleep(max(0.0, due - loop.time()))
        await asyncio.gather(*tasks)
        return self.latencies


def _figures(latencies: list[float]) -> tuple[float, float, float]:
    p99 = statistics.quantiles(latencies, n=100, method="inclusive")[98]
    return statistics.median(latencies), p99, max(latencies)


def _row(latencies: list[float]) -> str:
    p50, p99, top = _figures(latencies)
    return (
        f"n={len(latencies)} p50={p50 * 1000:.0f} ms p99={p99 * 1000:.0f} ms "
        f"max={top * 1000:.0f} ms"
    )


SHAPES = (200, 20_000)  # messages per line: 3,800 lines of 200; 37 lines of 20,000


async def _measure(url: str, body: bytes, name: str) -> tuple[list[float], list[float], float, int]:
    probe = Probe(url)
    async with probe.client, httpx.AsyncClient(base_url=url, timeout=300) as uploader:
        for _ in range(5):  # open connections before measuring
            await probe.client.get("/healthz")
        idle = list(await probe.during(3.0))
        started = time.monotonic()
        upload = asyncio.ensure_future(
            uploader.post(
                f"/v1/datasets?name={name}",
                content=body,
                headers={"content-type": "application/jsonl"},
            )
        )
        during = list(await probe.during(upload))
        took = time.monotonic() - started
        response = upload.result()
        assert response.status_code == 201, response.text[:500]
    return idle, during, took, probe.failures


def run() -> dict[str, float]:
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as data, server({"TRAINYARD_DATA_DIR": data}) as (url, _):
        for turns in SHAPES:
            body = dataset_lines(turns=turns)
            idle, during, took, failures = asyncio.run(_measure(url, body, f"bench-{turns}"))
            lines = body.count(b"\n")
            _, idle_p99, _ = _figures(idle)
            _, busy_p99, _ = _figures(during)
            report(
                f"uploads: /healthz while a {len(body) / 1e6:.0f} MB dataset "
                f"({lines} lines of {turns} messages) is uploaded",
                [
                    ("baseline: idle, 3 s before", _row(idle)),
                    (f"during the upload ({took:.1f} s to the 201)", _row(during)),
                    ("p99 during / idle", f"{busy_p99 / idle_p99:.1f}x"),
                    (
                        "p99 during the upload",
                        f"{busy_p99 * 1000:.0f} ms (goal <= {GOAL_P99 * 1000:g} ms)",
                    ),
                    ("failed probes", str(failures)),
                ],
            )
            figures[f"upload_{turns}_healthz_p99"] = busy_p99
            figures[f"upload_{turns}_healthz_ratio"] = busy_p99 / idle_p99
    return figures


if __name__ == "__main__":
    run()
