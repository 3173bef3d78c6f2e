"""Compare the working tree with another revision, in interleaved pairs, in one run.

    python -m bench.compare --against REV [--pairs 3] [--part throughput|dispatch|both]

REV is checked out into a temporary, detached `git worktree`. Each pair runs the old
tree's benchmark and the new tree's (the working tree's, uncommitted changes included),
alternating which goes first from pair to pair so that the machine's drift cancels. Each
run is a subprocess with cwd and PYTHONPATH set to its tree, so `import app`, and the
`trainyard worker` processes the throughput benchmark starts, load that tree's code (the
venv's editable install maps `app` to /work/main only as a fallback after PYTHONPATH);
before measuring, the tool checks which `app` the venv's `trainyard` script imports.

Both trees are measured by the same driver (`bench/compare_driver.py`, passed as
`python -c`), which calls each tree's own `bench.queue.throughput` / `bench.queue.dispatch`
and prints the figures as JSON. For every figure the tool prints each pair's old and new
value and their ratio new/old, and the median of the pairs' ratios; the headline figures
(throughput jobs/s, the workers' CPU per job, dispatch p50 on SQLite and on Postgres) are
checked against --tolerance (10 %: throughput ratio >= 0.90, the others <= 1.10).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import TRAINYARD
from bench.compare_driver import MARKER

NEW_ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("compare_driver.py")
POSTGRES = os.environ.get(
    "TRAINYARD_BENCH_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
PARTS = ("throughput", "dispatch")
# What each tree measures with: a difference here is reported, since it is not the code
# under test.
BENCH_FILES = ("bench/queue.py", "bench/common.py")


@dataclass(frozen=True)
class Tree:
    label: str  # "old" or "new"
    root: Path
    description: str


@dataclass(frozen=True)
class Figure:
    part: str  # which run measures it: "throughput" or "dispatch"
    section: str  # key of the driver's JSON: "throughput", "sqlite", "postgres"
    key: str  # key inside that section
    title: str
    scale: float  # multiplies the raw value for display
    digits: int
    higher_is_better: bool
    headline: bool  # checked against the tolerance

    def value(self, result: dict[str, Any]) -> float | None:
        raw = result.get(self.section, {}).get(self.key)
        return None if raw is None else float(raw) * self.scale

    def show(self, value: float | None) -> str:
        return "-" if value is None else f"{value:.{self.digits}f}"


T, S, P = "throughput", "sqlite", "postgres"
MS = 1000  # dispatch figures come in seconds
FIGURES = (
    # part, section, key, title, scale, digits, higher_is_better, headline
    Figure(T, T, "jobs_per_s", "throughput, jobs/s", 1, 0, True, True),
    Figure(T, T, "commit_rate", "  baseline: empty commits/s", 1, 0, True, False),
    # CPU time, not wall time: the steadiest figure when others load the machine.
    Figure(T, T, "worker_cpu_ms", "CPU per job, workers, ms", 1, 2, False, True),
    # Every local postgres process, other sessions' included.
    Figure(T, T, "postgres_cpu_ms", "  CPU per job, Postgres, ms", 1, 2, False, False),
    Figure("dispatch", S, "p50", "dispatch p50, SQLite, ms", MS, 1, False, True),
    Figure("dispatch", S, "p95", "  p95, SQLite, ms", MS, 1, False, False),
    Figure("dispatch", S, "accept", "  baseline: POST p50, SQLite, ms", MS, 1, False, False),
    Figure("dispatch", P, "p50", "dispatch p50, Postgres, ms", MS, 1, False, True),
    Figure("dispatch", P, "p95", "  p95, Postgres, ms", MS, 1, False, False),
    Figure("dispatch", P, "accept", "  baseline: POST p50, Postgres, ms", MS, 1, False, False),
)


class CompareError(RuntimeError):
    pass


def git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(NEW_ROOT), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise CompareError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def resolve(rev: str) -> str:
    try:
        return git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except CompareError:
        raise CompareError(f"{rev!r} is not a commit in {NEW_ROOT}") from None


@contextmanager
def old_worktree(sha: str) -> Iterator[Path]:
    """A detached worktree of `sha` in a temporary directory, removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="trainyard-compare-"))
    path = tmp / "old"
    try:
        git("worktree", "add", "--detach", "--quiet", str(path), sha)
        yield path
    finally:
        if path.exists():
            subprocess.run(
                ["git", "-C", str(NEW_ROOT), "worktree", "remove", "--force", str(path)],
                capture_output=True,
                check=False,
            )
        subprocess.run(["git", "-C", str(NEW_ROOT), "worktree", "prune"], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def tree_env(tree: Tree, postgres: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(tree.root),
        "TRAINYARD_BENCH_POSTGRES_URL": postgres,
    }


def worker_app(tree: Tree, postgres: str) -> Path:
    """The `app` package that the venv's `trainyard` script imports in this tree's env.

    Runs the very script the throughput benchmark starts its workers with, verbosely, and
    reads where `app/__init__` was loaded from.
    """
    done = subprocess.run(
        [TRAINYARD, "--help"],
        cwd=tree.root,
        env={**tree_env(tree, postgres), "PYTHONVERBOSE": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(
        r"code object from '?(/[^\s']*?)/app/(?:__pycache__/)?__init__\.", done.stderr
    )
    if done.returncode != 0 or found is None:
        raise CompareError(f"{TRAINYARD} --help in {tree.root} failed:\n{done.stderr[-2000:]}")
    return Path(found.group(1)).resolve() / "app"


def measure(
    tree: Tree, part: str, args: argparse.Namespace, driver: str
) -> tuple[dict[str, Any], float]:
    """One run of the driver in `tree`: its figures, and the run's wall time."""
    command = [
        sys.executable,
        "-c",
        driver,
        part,
        str(args.jobs),
        str(args.models),
        str(args.dispatch_jobs),
    ]
    start = time.monotonic()
    # Its own process group: a timeout or ^C ends the driver and its workers together.
    process = subprocess.Popen(
        command,
        cwd=tree.root,
        env=tree_env(tree, args.postgres_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=args.timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        raise
    elapsed = time.monotonic() - start
    lines = [line for line in stdout.splitlines() if line.startswith(MARKER)]
    if process.returncode != 0 or not lines:
        raise CompareError(
            f"the {tree.label} tree's {part} run failed (exit {process.returncode}) in "
            f"{tree.root}:\n{stdout[-2000:]}{stderr[-4000:]}"
        )
    result: dict[str, Any] = json.loads(lines[-1][len(MARKER) :])
    expected = (tree.root / "app").resolve()
    if Path(result["app"]) != expected:
        raise CompareError(f"the {tree.label} run imported {result['app']}, not {expected}")
    return result, elapsed


def ratio(old: float | None, new: float | None) -> float | None:
    return None if old is None or new is None or old == 0 else new / old


def within(figure: Figure, median: float, tolerance: float) -> bool:
    if figure.higher_is_better:
        return median >= 1 - tolerance
    return median <= 1 + tolerance


def pair_line(
    figures: list[Figure], old: dict[str, Any], new: dict[str, Any]
) -> Iterator[tuple[str, str]]:
    for figure in figures:
        if not figure.headline:
            continue
        o, n = figure.value(old), figure.value(new)
        r = ratio(o, n)
        shown = "-" if r is None else f"{r:.3f}"
        yield figure.title, f"old {figure.show(o)}  new {figure.show(n)}  new/old {shown}"


def summary(
    pairs: list[dict[str, dict[str, Any]]], parts: list[str], tolerance: float
) -> tuple[list[str], list[str]]:
    """The summary table's lines, and the headline figures outside the tolerance."""
    header = ["figure", *(f"pair {i + 1}: old -> new (new/old)" for i in range(len(pairs)))]
    header.append("median new/old")
    rows = [header]
    failed: list[str] = []
    for figure in FIGURES:
        if figure.part not in parts:
            continue
        cells = [figure.title + ("" if not figure.headline else " *")]
        ratios = []
        for pair in pairs:
            old = figure.value(pair["old"].get(figure.part, {}))
            new = figure.value(pair["new"].get(figure.part, {}))
            r = ratio(old, new)
            if r is not None:
                ratios.append(r)
            shown = "-" if r is None else f"{r:.3f}"
            cells.append(f"{figure.show(old)} -> {figure.show(new)} ({shown})")
        if ratios:
            median = statistics.median(ratios)
            verdict = ""
            if figure.headline:
                ok = within(figure, median, tolerance)
                bound = f"{'>=' if figure.higher_is_better else '<='} "
                bound += f"{1 - tolerance if figure.higher_is_better else 1 + tolerance:.2f}"
                verdict = f"  {'ok' if ok else 'WORSE'} ({bound})"
                if not ok:
                    failed.append(figure.title)
            cells.append(f"{median:.3f}{verdict}")
        else:
            cells.append("-")
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return [line.rstrip() for line in lines], failed


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.compare",
        description="Queue throughput and dispatch latency of the working tree against "
        "another revision, in interleaved pairs (old and new alternating which runs first).",
    )
    parser.add_argument("--against", required=True, metavar="REV", help="the old revision")
    parser.add_argument("--pairs", type=int, default=3, help="old/new pairs (default 3)")
    parser.add_argument("--part", choices=("throughput", "dispatch", "both"), default="both")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1500,
        help="throughput: jobs per run (default 1500; `python -m bench.queue` runs 3000)",
    )
    parser.add_argument("--models", type=int, default=60, help="throughput: models (default 60)")
    parser.add_argument(
        "--dispatch-jobs",
        type=int,
        default=60,
        help="dispatch: jobs per database, two per model (default 60, as bench.queue)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.10,
        help="how much worse a headline figure's median ratio may be (default 0.10)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a headline figure is outside it"
    )
    parser.add_argument(
        "--postgres-url",
        default=POSTGRES,
        help="Postgres for both parts; its public schema is dropped and recreated "
        "(default: $TRAINYARD_BENCH_POSTGRES_URL, else bench.queue's default)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds one run may take (default 900)"
    )
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    return args


def describe_new() -> str:
    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain")
    return f"working tree {NEW_ROOT} (HEAD {head}{', with uncommitted changes' if dirty else ''})"


def run(args: argparse.Namespace) -> int:
    parts = list(PARTS) if args.part == "both" else [args.part]
    sha = resolve(args.against)
    driver = DRIVER.read_text()
    new = Tree("new", NEW_ROOT, describe_new())
    print("Trainyard: new against old, interleaved pairs (ratios are new/old)")
    print(f"  old: {args.against} = {sha[:12]}, in a temporary worktree")
    print(f"  new: {new.description}")
    print(f"  postgres: {args.postgres_url}")
    if "throughput" in parts:
        print(f"  throughput: {args.jobs} jobs over {args.models} models, 2 workers, Postgres")
    if "dispatch" in parts:
        print(f"  dispatch: {args.dispatch_jobs // 2} models x 2 jobs, SQLite and Postgres")
    differs = subprocess.run(
        ["git", "-C", str(NEW_ROOT), "diff", "--quiet", sha, "--", *BENCH_FILES], check=False
    )
    if differs.returncode != 0:
        print(
            f"  note: {' or '.join(BENCH_FILES)} differ from {args.against}'s; "
            "each tree measures with its own copy"
        )
    with old_worktree(sha) as old_root:
        old = Tree("old", old_root, f"{args.against} ({sha[:12]})")
        for tree in (old, new):
            subprocess.run(
                [sys.executable, "-m", "compileall", "-q", "app", "bench"],
                cwd=tree.root,
                check=False,
                stdout=subprocess.DEVNULL,
            )
            loaded = worker_app(tree, args.postgres_url)
            if loaded != (tree.root / "app").resolve():
                raise CompareError(
                    f"with PYTHONPATH={tree.root}, {TRAINYARD} imports {loaded}: "
                    "its workers would not run the tree under test"
                )
            print(f"  {tree.label} tree's `trainyard` imports {loaded}")
        pairs: list[dict[str, dict[str, Any]]] = []
        for i in range(args.pairs):
            order = (old, new) if i % 2 == 0 else (new, old)
            pair: dict[str, dict[str, Any]] = {"old": {}, "new": {}}
            for part in parts:
                took: dict[str, str] = {}
                for tree in order:
                    load = os.getloadavg()[0]
                    pair[tree.label][part], seconds = measure(tree, part, args, driver)
                    took[tree.label] = f"{seconds:.0f} s, load {load:.1f}"
                figures = [f for f in FIGURES if f.part == part]
                print(
                    f"\npair {i + 1}/{args.pairs}, {part}, {order[0].label} first "
                    f"(old {took['old']}; new {took['new']})"
                )
                for title, text in pair_line(figures, pair["old"][part], pair["new"][part]):
                    print(f"  {title.ljust(28)}  {text}")
            pairs.append(pair)
    lines, failed = summary(pairs, parts, args.tolerance)
    print(f"\n## new/old over {len(pairs)} pair(s) (* = checked, tolerance {args.tolerance:.0%})")
    for line in lines:
        print(f"  {line}")
    if failed:
        print(f"\nverdict: new is more than {args.tolerance:.0%} worse on: {', '.join(failed)}")
    else:
        print(f"\nverdict: new is within {args.tolerance:.0%} of old on every checked figure")
    return 1 if failed and args.strict else 0


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    try:
        code = run(args)
    except CompareError as error:
        print(f"bench.compare: {error}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
