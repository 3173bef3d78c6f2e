"""`python -m bench` (or `make bench`): every benchmark, each with its baseline, in one run."""

from __future__ import annotations

import asyncio

from bench import (
    abandoned,
    api_start,
    checkpoints,
    cpu_step,
    fanout,
    ingest,
    merged_export,
    pool,
    queue,
    reads,
    runs,
    scrape,
    stalls,
    tinker,
    uploads,
    webhooks_fair,
)


def main() -> None:
    print("Trainyard benchmarks (ratios are against baselines measured in this same run)")
    api_start.run()
    reads.run()
    ingest.run()
    uploads.run()
    stalls.run()
    asyncio.run(queue.main())
    asyncio.run(cpu_step.run())
    asyncio.run(fanout.run())
    asyncio.run(runs.run())
    checkpoints.run()
    merged_export.run()
    abandoned.run()
    pool.run()
    tinker.run()
    asyncio.run(webhooks_fair.run())
    scrape.run()


if __name__ == "__main__":
    main()
