"""An API-only process: how fast `trainyard serve` starts and how much memory it idles at.

measured: `trainyard serve` with `TRAINYARD_WORKER_ENABLED=false` on a free loopback port
against a fresh SQLite file (so the start includes migrating it), from spawning the
process until `/healthz` answers 200; the CPU time the process used by then; and its
resident memory (VmRSS) once it has idled for a while after answering one `/readyz`. Each
run is a new process and a new database; the figures are the median of the runs, with
their range. The process may cache bytecode (as an installed wheel has it compiled), so one
run before the measured ones is not counted.
Goals: start <= 1.5 s, idle RSS <= 150 MB (10^6 bytes).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import TRAINYARD, free_port, report

START_GOAL_S = 1.5
RSS_GOAL_MB = 150
_TICKS = os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """Resident memory of a process (VmRSS), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def start_once(idle_s: float = 2.0) -> tuple[float, float, float]:
    """(seconds until /healthz answers, CPU seconds by then, idle RSS in MB) of one API-only
    process on a fresh SQLite database."""
    with tempfile.TemporaryDirectory() as data:
        port = free_port()
        env = {
            **os.environ,
            "TRAINYARD_DATA_DIR": data,
            "TRAINYARD_DATABASE_URL": f"sqlite+aiosqlite:///{data}/trainyard.db",
            "TRAINYARD_WORKER_ENABLED": "false",
            "TRAINYARD_DEMO_MODEL": "false",
            "TRAINYARD_MIGRATE_ON_START": "true",
            "TRAINYARD_LOG_LEVEL": "warning",
        }
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        url = f"http://127.0.0.1:{port}"
        started = time.perf_counter()
        process = subprocess.Popen([TRAINYARD, "serve", "--port", str(port)], env=env)
        try:
            with httpx.Client(base_url=url, timeout=1) as client:
                while True:
                    try:
                        if client.get("/healthz").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if process.poll() is not None or time.perf_counter() > started + 60:
                        raise RuntimeError("the API process did not start")
                    time.sleep(0.005)
                start_s = time.perf_counter() - started
                cpu_s = cpu_seconds(process.pid)
                assert client.get("/readyz", timeout=10).status_code == 200
            time.sleep(idle_s)
            return start_s, cpu_s, rss_mb(process.pid)
        finally:
            process.terminate()
            process.wait(30)


def run(runs: int = 5) -> dict[str, float]:
    load = os.getloadavg()[0]
    start_once(idle_s=0)  # caches bytecode; not counted
    starts, cpus, rss = (
        sorted(column) for column in zip(*(start_once() for _ in range(runs)), strict=True)
    )
    start, cpu, memory = (statistics.median(c) for c in (starts, cpus, rss))
    report(
        "API-only process: `trainyard serve`, TRAINYARD_WORKER_ENABLED=false, fresh SQLite",
        [
            (
                "start: spawn until /healthz answers",
                f"{start:.2f} s (median of {runs}; {starts[0]:.2f}-{starts[-1]:.2f}) "
                f"(goal <= {START_GOAL_S} s)",
            ),
            ("  CPU time of the process by then", f"{cpu:.2f} s ({cpus[0]:.2f}-{cpus[-1]:.2f})"),
            (
                "idle RSS",
                f"{memory:.0f} MB (median of {runs}; {rss[0]:.0f}-{rss[-1]:.0f}) "
                f"(goal <= {RSS_GOAL_MB} MB)",
            ),
            ("load average at the start", f"{load:.2f}"),
        ],
    )
    return {"api_start_s": start, "api_start_cpu_s": cpu, "api_idle_rss_mb": memory}


if __name__ == "__main__":
    run()
