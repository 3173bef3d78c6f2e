"""`python -m bench` (or `make bench`): every benchmark, each with its baseline, in one run."""

from __future__ import annotations

import asyncio

from bench import ingest, queue


def main() -> None:
    print("Trainyard benchmarks (ratios are against baselines measured in this same run)")
    ingest.run()
    asyncio.run(queue.main())


if __name__ == "__main__":
    main()
