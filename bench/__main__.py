"""`python -m bench` (or `make bench`): every benchmark, each with its baseline, in one run."""

from __future__ import annotations

import asyncio

from bench import cpu_step, fanout, ingest, queue


def main() -> None:
    print("Trainyard benchmarks (ratios are against baselines measured in this same run)")
    ingest.run()
    asyncio.run(queue.main())
    asyncio.run(cpu_step.run())
    asyncio.run(fanout.run())


if __name__ == "__main__":
    main()
