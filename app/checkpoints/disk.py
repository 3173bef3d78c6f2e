"""What the registry reads and writes on disk: the `{step:04d}` directories of a model's
checkpoints, their sizes, and adapter archives. Synchronous: callers run it in a thread."""

from __future__ import annotations

import os
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""What PEFT's `PeftModel.from_pretrained(base, dir)` loads; an export holds only these."""
CHUNK = 1 << 20


def steps(directory: Path) -> dict[int, Path]:
    """The model's checkpoints by step (none when the directory does not exist)."""
    try:
        with os.scandir(directory) as entries:
            return {
                int(e.name): Path(e.path)
                for e in entries
                if e.name.isdigit() and e.is_dir(follow_symlinks=False)
            }
    except FileNotFoundError:
        return {}


@dataclass(frozen=True)
class Stat:
    size_bytes: int
    written_at: datetime


def stat(path: Path) -> Stat | None:
    """Bytes under `path`, and when its newest file was written (the directory's own time
    when it is empty). None: it was deleted meanwhile."""
    try:
        newest = path.stat().st_mtime
        size = 0
        for root, _dirs, files in os.walk(path):
            for name in files:
                info = os.stat(os.path.join(root, name), follow_symlinks=False)
                size += info.st_size
                newest = max(newest, info.st_mtime)
    except FileNotFoundError:
        return None
    return Stat(size, datetime.fromtimestamp(newest, UTC))


def open_adapter(path: Path) -> list[tuple[str, IO[bytes]]] | None:
    """The adapter's files, opened (an open file survives a delete of the checkpoint while
    it is archived); None when the checkpoint holds no adapter (dry-run)."""
    opened: list[tuple[str, IO[bytes]]] = []
    try:
        for name in ADAPTER_FILES:
            opened.append((name, (path / name).open("rb")))
    except FileNotFoundError:
        for _, handle in opened:
            handle.close()
        return None
    return opened


def archive(folder: str, files: list[tuple[str, IO[bytes]]], fmt: str) -> IO[bytes]:
    """Write `files` under `folder/` into a tar.gz or zip archive in a temporary file
    (closes them); returns it rewound."""
    out = tempfile.TemporaryFile()  # noqa: SIM115 (the caller streams and closes it)
    try:
        if fmt == "zip":
            with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
                for name, handle in files:
                    with zf.open(f"{folder}/{name}", "w", force_zip64=True) as member:
                        _copy(handle, member)
        else:
            with tarfile.open(fileobj=out, mode="w:gz") as tar:
                for name, handle in files:
                    info = tarfile.TarInfo(f"{folder}/{name}")
                    info.size = os.fstat(handle.fileno()).st_size
                    info.mtime = int(os.fstat(handle.fileno()).st_mtime)
                    info.mode = 0o644
                    tar.addfile(info, handle)
    except BaseException:
        out.close()
        raise
    finally:
        for _, handle in files:
            handle.close()
    out.seek(0)
    return out


def _copy(source: IO[bytes], target: IO[bytes]) -> None:
    while chunk := source.read(CHUNK):
        target.write(chunk)


def chunks(file: IO[bytes]) -> Iterator[bytes]:
    """Read `file` out in chunks, then close it."""
    try:
        while chunk := file.read(CHUNK):
            yield chunk
    finally:
        file.close()
