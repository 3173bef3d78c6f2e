"""One measurement for `python -m bench.compare`, run inside the tree being measured.

`bench.compare` passes this file's source to `python -c` with cwd and PYTHONPATH set to
the tree under test (the working tree, or a temporary worktree of the old revision), so
both trees are measured by this same driver, calling their own `bench.queue`:

    throughput(data_dir, jobs=, models=)   -> {"jobs_per_s", "commit_rate", ...}
    dispatch(database_url, data_dir, jobs=) -> {"p50", "p95", "first_p50", "accept"}

Those two signatures and `bench.queue.POSTGRES` (read from TRAINYARD_BENCH_POSTGRES_URL)
are all it relies on; they are unchanged since the benchmark was written. The figures
come back as one JSON line on stdout, after MARKER.

    python -c "$(cat bench/compare_driver.py)" throughput|dispatch JOBS MODELS DISPATCH_JOBS
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

MARKER = "BENCH_COMPARE_RESULT "


async def measure(part: str, jobs: int, models: int, dispatch_jobs: int) -> dict[str, Any]:
    import bench.queue as queue

    postgres = os.environ.get("TRAINYARD_BENCH_POSTGRES_URL", queue.POSTGRES)
    queue.POSTGRES = postgres  # throughput() reads the module's copy
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="trainyard-compare-") as tmp:
        root = Path(tmp)
        if part == "throughput":
            result["throughput"] = await queue.throughput(root / "t", jobs=jobs, models=models)
        elif part == "dispatch":
            result["sqlite"] = await queue.dispatch(
                f"sqlite+aiosqlite:///{root / 'd.db'}", root / "s", jobs=dispatch_jobs
            )
            result["postgres"] = await queue.dispatch(postgres, root / "p", jobs=dispatch_jobs)
        else:
            raise SystemExit(f"unknown part {part!r}")
    return result


def main(argv: list[str]) -> None:
    part, jobs, models, dispatch_jobs = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    result = asyncio.run(measure(part, jobs, models, dispatch_jobs))
    import app
    import bench.queue

    # Where the code came from, for bench.compare to check against the tree it meant.
    result["app"] = str(Path(app.__file__ or "").resolve().parent)
    result["bench"] = str(Path(bench.queue.__file__ or "").resolve())
    sys.stdout.flush()
    print(MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
