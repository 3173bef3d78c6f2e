"""Ingest: accepting a 20 MB NAT collection over HTTP vs parsing it in-process.

baseline: parse + `TrainingJobCreate` validation + `check_collection` on the same bytes, in
this process, by the faster of pydantic's two paths (`model_validate_json`, or
`pydantic_core.from_json` then `model_validate`).
measured: POST /v1/training-jobs to `trainyard serve` in its own process (SQLite, no
worker) until the 202 arrives: HTTP, parse, validate, compress, commit.

memory: the server's peak resident memory (VmHWM) over the large POSTs, less its peak
after one small collection was accepted (what the first training job imports, openai's
types among them, is the process's, not the payload's), against the body's size.
"""

from __future__ import annotations

import tempfile
import tracemalloc

import httpx
import pydantic_core

from app.schemas.jobs import TrainingJobCreate
from app.trajectories import check_collection
from bench.common import dumps, median_seconds, nat_collection, peak_rss_mib, report, server

GOAL = 1.5
RSS_GOAL = 4.0


def run(repeat: int = 5) -> dict[str, float]:
    body = dumps({"model": "bench", "collection": nat_collection()})

    def parse_json() -> None:
        job = TrainingJobCreate.model_validate_json(body)
        assert job.collection is not None and not check_collection(job.collection)

    def parse_python() -> None:
        job = TrainingJobCreate.model_validate(pydantic_core.from_json(body))
        assert job.collection is not None and not check_collection(job.collection)

    parse_json()  # warm up imports and caches
    tracemalloc.start()
    parse_python()
    _, parse_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    baseline = min(median_seconds(parse_json, repeat), median_seconds(parse_python, repeat))

    with tempfile.TemporaryDirectory() as data, server({"TRAINYARD_DATA_DIR": data}) as (url, proc):
        client = httpx.Client(base_url=url, timeout=120)
        client.post("/v1/models", json={"name": "bench", "base_model": "b", "backend": "dry-run"})
        idle_rss = peak_rss_mib(proc.pid)

        def accept(content: bytes = body) -> None:
            response = client.post(
                "/v1/training-jobs", content=content, headers={"content-type": "application/json"}
            )
            assert response.status_code == 202, response.text[:500]

        accept(dumps({"model": "bench", "collection": nat_collection(trajectories=16)}))
        warm_rss = peak_rss_mib(proc.pid)

        accept()
        measured = median_seconds(accept, repeat)
        server_peak = peak_rss_mib(proc.pid)
        client.close()

    ratio = measured / baseline
    growth = (server_peak - warm_rss) / (len(body) / 2**20)
    report(
        "ingest: 20 MB NAT collection, 512 trajectories with token logprobs",
        [
            ("body size", f"{len(body) / 2**20:.1f} MiB"),
            (
                "baseline: parse + validate in-process",
                f"{baseline * 1000:.0f} ms (median of {repeat})",
            ),
            (
                "accept: POST until 202, server process",
                f"{measured * 1000:.0f} ms (median of {repeat})",
            ),
            ("ratio accept / baseline", f"{ratio:.2f}x (goal <= {GOAL}x)"),
            ("in-process parse peak allocation", f"{parse_peak / 2**20:.0f} MiB"),
            (
                "server peak RSS: idle, warm, after",
                f"{idle_rss:.0f}, {warm_rss:.0f}, {server_peak:.0f} MiB",
            ),
            (
                "RSS growth / body size",
                f"{growth:.1f}x (goal <= {RSS_GOAL:g}x)",
            ),
        ],
    )
    return {"ingest_ratio": ratio, "ingest_rss_growth": growth}


if __name__ == "__main__":
    run()
