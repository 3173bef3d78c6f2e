"""`python -m bench.merged_export`: the server's memory while it streams a merged export.

`trainyard serve` (API only, SQLite) in its own process; a random Llama-shaped model of
about 340 MB (`make_tiny_model`'s recipe, hidden 1024, 8 layers, float32) registered on
the cpu backend, and a step-1 checkpoint beside it: a rank-16 LoRA on every linear module
of every layer with random A and B. The export (`?format=merged`) is read by a client
that throws the bytes away as they come. Measured: the server's resident memory at its
peak during the export (VmHWM, reset just before through `/proc/PID/clear_refs`) less its
resident memory just before, divided by the export's size. One merged export of a small
model first, so that what every first merged export costs once (torch's import, the
allocator's first arenas) is not counted; that figure is printed apart.

Baseline (same run): the time to read the base model's files once from disk, against the
export's time (the merge's arithmetic and the HTTP stream on top of the same reads)."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import report, server

GOAL = 0.5  # RSS growth / export size
RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class _Model:
    name: str
    project: str = "bench"


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def _adapter(base: Path, checkpoints: Path, name: str) -> None:
    """A rank-16 LoRA over every linear module of `base`, random A and B, as step 1."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from app.backends.checkpoints import CheckpointDirs

    tensors: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(0)
    with safe_open(str(base / "model.safetensors"), framework="pt") as weights:
        for key in weights.keys():  # noqa: SIM118 (safe_open is no mapping)
            module = key.removesuffix(".weight")
            if not module.endswith(TARGETS):
                continue
            rows, cols = weights.get_slice(key).get_shape()
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, cols, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(rows, RANK, generator=generator)
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "target_modules": list(TARGETS),
        "base_model_name_or_path": str(base),
    }
    with CheckpointDirs(checkpoints).writing(_Model(name), 1) as partial:
        (partial / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, str(partial / "adapter_model.safetensors"))


def _growth(pid: int, export: Callable[[], tuple[int, float]]) -> tuple[int, tuple[int, float]]:
    """The server's peak RSS during `export` less its RSS before (KiB), and what it gave."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
    before = _rss_kib(pid, "VmRSS")
    result = export()
    return _rss_kib(pid, "VmHWM") - before, result


def _register(url: str, name: str, base: Path) -> None:
    body = {"name": name, "project": "bench", "base_model": str(base), "backend": "cpu"}
    response = httpx.post(f"{url}/v1/models", json=body, timeout=30)
    assert response.status_code == 201, response.text


def _export(url: str, name: str) -> tuple[int, float]:
    """Stream the merged export and drop it; its bytes and seconds."""
    start = time.perf_counter()
    size = 0
    path = f"{url}/v1/models/{name}/checkpoints/1/export"
    with httpx.stream("GET", path, params={"format": "merged"}, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for chunk in response.iter_raw():
            size += len(chunk)
        assert size == int(response.headers["content-length"])
    return size, time.perf_counter() - start


def _read(base: Path) -> float:
    start = time.perf_counter()
    for path in base.iterdir():
        with path.open("rb") as handle:
            while handle.read(1 << 20):
                pass
    return time.perf_counter() - start


def run() -> None:
    from app.backends.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        made = time.perf_counter()
        small = make_tiny_model(root / "models" / "small")
        big = make_tiny_model(root / "models" / "big", hidden_size=1024, layers=8, heads=8)
        data = root / "data"
        _adapter(small, data / "cpu", "small")
        _adapter(big, data / "cpu", "big")
        made = time.perf_counter() - made
        env = {"TRAINYARD_DATA_DIR": str(data), "TRAINYARD_MODEL_ROOTS": str(root / "models")}
        with server(env) as (url, process):
            _register(url, "small", small)
            _register(url, "big", big)
            first = _growth(process.pid, lambda: _export(url, "small"))[0]
            growth, (size, seconds) = _growth(process.pid, lambda: _export(url, "big"))
        read = _read(big)
    ratio = growth * 1024 / size
    report(
        "merged export (server RSS while it streams a merged model)",
        [
            (
                "export",
                f"{size / 2**20:.0f} MiB in {seconds:.1f} s ({size / 2**20 / seconds:.0f} MiB/s)",
            ),
            ("baseline: reading the base", f"{read:.2f} s; export / read {seconds / read:.1f}x"),
            ("RSS growth during it", f"{growth / 1024:.1f} MiB"),
            (
                "growth / export size",
                f"{ratio:.4f} (goal <= {GOAL}) {'ok' if ratio <= GOAL else 'MISSED'}",
            ),
            ("first merged export, once", f"{first / 1024:.0f} MiB (torch's import and more)"),
            ("models made in", f"{made:.1f} s"),
        ],
    )


if __name__ == "__main__":
    run()
