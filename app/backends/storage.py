"""Where checkpoints live: a local directory (the default) or an S3-compatible object store,
chosen by one URL (`TRAINYARD_CHECKPOINT_URL`).

In the object store a model's steps lie under the same relative layout as on disk,
`{prefix}/{backend}/{project}/models/{name}/checkpoints/{step:04d}/{file}`, and beside each
step directory a manifest, `{step:04d}.json`, written last (after every file) and deleted
first: a step exists for a reader exactly when its manifest does. Listing a model's steps
is one LIST of its `checkpoints/` prefix (delimited: the manifests only).

Each worker keeps what it writes or loads in a local cache directory, bounded in bytes
(`TRAINYARD_CHECKPOINT_CACHE_BYTES`): the least recently used steps are evicted first.

The object store is driven through obstore (Rust `object_store` bindings): one small wheel
without dependencies, a synchronous and an async API over the same client, S3 and
S3-compatible servers (MinIO, moto, R2) by endpoint. Synchronous: callers run it in a
thread, as they do the local disk work."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.settings import Settings, parse_checkpoint_url

if TYPE_CHECKING:
    from obstore.store import ClientConfig

MANIFEST_SUFFIX = ".json"


@dataclass(frozen=True)
class StepInfo:
    """A complete step in the object store: its files (relative path: bytes) and when its
    manifest was written."""

    files: dict[str, int]
    written_at: datetime

    @property
    def size_bytes(self) -> int:
        return sum(self.files.values())


class ObjectStore:
    """An S3-compatible bucket under a key prefix."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
    ) -> None:
        from obstore.store import S3Store

        options: dict[str, Any] = {}
        if endpoint is not None:
            options["endpoint"] = endpoint
        if region is not None:
            options["region"] = region
        if access_key_id is not None:
            options["access_key_id"] = access_key_id
        if secret_access_key is not None:
            options["secret_access_key"] = secret_access_key
        client: ClientConfig = {}
        if endpoint is not None and endpoint.startswith("http://"):
            client["allow_http"] = True
        self.bucket, self.prefix = bucket, prefix
        self.url = f"s3://{bucket}/{prefix}".rstrip("/")
        self._store = S3Store(bucket, prefix=prefix or None, client_options=client, **options)

    def steps(self, key: str) -> dict[int, datetime]:
        """The complete steps under `key` (a model's `checkpoints` prefix): those with a
        manifest, and when it was written."""
        import obstore

        listed = obstore.list_with_delimiter(self._store, f"{key}/")
        found: dict[int, datetime] = {}
        for meta in listed["objects"]:
            name = meta["path"].rsplit("/", 1)[-1]
            stem = name.removesuffix(MANIFEST_SUFFIX)
            if name.endswith(MANIFEST_SUFFIX) and stem.isdigit():
                found[int(stem)] = meta["last_modified"]
        return found

    def info(self, key: str, step: int) -> StepInfo | None:
        import obstore

        try:
            result = obstore.get(self._store, _manifest(key, step))
        except FileNotFoundError:
            return None
        document = json.loads(bytes(result.bytes()))
        return StepInfo(
            files={str(k): int(v) for k, v in document["files"].items()},
            written_at=datetime.fromisoformat(document["written_at"]),
        )

    def upload(self, key: str, step: int, directory: Path) -> None:
        """Put every file under `directory`, then the manifest (last: the step appears)."""
        import obstore

        files: dict[str, int] = {}
        for root, _dirs, names in os.walk(directory):
            for name in names:
                path = Path(root, name)
                relative = path.relative_to(directory).as_posix()
                obstore.put(self._store, f"{key}/{step:04d}/{relative}", path)
                files[relative] = path.stat().st_size
        manifest = {"step": step, "files": files, "written_at": datetime.now(UTC).isoformat()}
        obstore.put(self._store, _manifest(key, step), json.dumps(manifest).encode())

    def download(self, key: str, step: int, info: StepInfo, target: Path) -> None:
        """Write the step's files under `target` (which exists)."""
        import obstore

        for relative in info.files:
            path = target / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            result = obstore.get(self._store, f"{key}/{step:04d}/{relative}")
            with path.open("wb") as out:
                for chunk in result:
                    out.write(chunk)

    def delete(self, key: str, step: int) -> None:
        """The manifest first (the step is gone for every reader), then its files."""
        import obstore

        obstore.delete(self._store, _manifest(key, step))  # S3: no error when absent
        paths = [meta["path"] for meta in obstore.list(self._store, f"{key}/{step:04d}/").collect()]
        if paths:
            obstore.delete(self._store, paths)


def _manifest(key: str, step: int) -> str:
    return f"{key}/{step:04d}{MANIFEST_SUFFIX}"


class Cache:
    """Steps a worker wrote or loaded, under one root, at most `max_bytes` in all: when
    over, the least recently used step directories (their mtime, set on each use) go first;
    the one just used always stays."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = Path(root), max_bytes
        self._lock = threading.Lock()
        self._last = 0.0

    def _now(self) -> float:
        """A use time later than every earlier one of this process (the LRU order holds
        when two uses fall within the file system's timestamp resolution)."""
        with self._lock:
            self._last = max(time.time(), self._last + 0.001)
            return self._last

    def used(self, path: Path, *, added: bool = True) -> None:
        """`path` (a step directory under the root) was just written or fetched (`added`:
        the cache grew, evict what no longer fits), or read again."""
        now = self._now()
        try:
            os.utime(path, (now, now))
        except FileNotFoundError:
            return
        if added:
            self.evict(keep=path)

    def _steps(self) -> list[tuple[float, int, Path]]:
        found = []
        for root, dirs, _files in os.walk(self.root):
            if Path(root).name != "checkpoints":
                continue
            for name in list(dirs):
                if name.isdigit():
                    path = Path(root, name)
                    size = sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())
                    found.append((path.stat().st_mtime, size, path))
            dirs.clear()
        return found

    def size(self) -> int:
        with self._lock:
            return sum(size for _, size, _ in self._steps())

    def evict(self, keep: Path | None = None) -> list[Path]:
        with self._lock:
            try:
                steps = sorted(self._steps())
            except FileNotFoundError:  # a step deleted meanwhile: the next use counts again
                return []
            total = sum(size for _, size, _ in steps)
            evicted = []
            for _, size, path in steps:
                if total <= self.max_bytes:
                    break
                if keep is not None and path == keep:
                    continue
                shutil.rmtree(path, ignore_errors=True)
                total -= size
                evicted.append(path)
            return evicted


class Shelf:
    """One backend's place in the object store (`{prefix}/{backend}`), with the worker's
    local cache of it."""

    def __init__(self, store: ObjectStore, name: str, cache: Cache) -> None:
        self.store, self.name, self.cache = store, name, cache

    def key(self, relative: str) -> str:
        return f"{self.name}/{relative}"

    def fetch(self, relative: str, step: int, local: Path) -> Path | None:
        """The step's directory in the local cache (`local`), downloaded if absent; None
        when the store has no such complete step (its manifest is read each time: a step
        another process deleted is never loaded from a stale copy here)."""
        info = self.store.info(self.key(relative), step)
        if info is None:  # never written, or deleted by another process: not served
            shutil.rmtree(local, ignore_errors=True)
            return None
        if local.is_dir():
            self.cache.used(local, added=False)
            return local
        partial = local.with_name(f".{local.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        partial.mkdir(parents=True)
        try:
            self.store.download(self.key(relative), step, info, partial)
            if local.is_dir():  # another thread fetched it meanwhile
                shutil.rmtree(partial, ignore_errors=True)
            else:
                os.rename(partial, local)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        self.cache.used(local)
        return local


class Storage:
    """Where every backend of this process keeps checkpoints, from the settings."""

    def __init__(self, settings: Settings) -> None:
        url = settings.checkpoint_url
        self.store: ObjectStore | None = None
        self.cache: Cache | None = None
        if url is None:
            self.root = Path(settings.data_dir)
            return
        scheme, location, prefix = parse_checkpoint_url(url)
        if scheme == "file":
            self.root = Path(location)
            return
        secret = settings.checkpoint_s3_secret_access_key
        self.store = ObjectStore(
            location,
            prefix,
            endpoint=settings.checkpoint_s3_endpoint,
            region=settings.checkpoint_s3_region,
            access_key_id=settings.checkpoint_s3_access_key_id,
            secret_access_key=secret.get_secret_value() if secret is not None else None,
        )
        self.root = Path(settings.data_dir) / "checkpoint-cache"
        self.cache = Cache(self.root, settings.checkpoint_cache_bytes)

    def place(self, backend: str) -> tuple[Path, Shelf | None]:
        """A backend's local directory, and its shelf in the object store (None: local)."""
        if self.store is None or self.cache is None:
            return self.root / backend, None
        return self.root / backend, Shelf(self.store, backend, self.cache)
