"""`python -m bench.checkpoints`: a checkpoint saved and loaded through the object store
against the same on local disk, in one run.

The object store is moto's standalone S3 server (`moto[server]`, the dev extra) on a
loopback port, the server the tests use: a Python server keeping objects in memory, so
the figures bound the client path (obstore, HTTP, the manifest) from above rather than
predict MinIO's or S3's. A save is `CheckpointDirs.writing` of one step (an adapter of
`SIZES` bytes and its config); local: written and renamed into place; object store: that,
then uploaded, then its manifest put. A load is reading the step's adapter: local, from
its directory; object store, `local_step` on a worker whose cache does not hold it (one
manifest GET, the download, the rename), then the same read."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from app.backends.checkpoints import CheckpointDirs
from app.backends.storage import Cache, ObjectStore, Shelf

SIZES = (1 << 20, 16 << 20)  # a rank-8 LoRA of a small model; one of a ~1B model
ROUNDS = 5


class _Model:
    name, project = "bench", "bench"


def _save(dirs: CheckpointDirs, step: int, weights: bytes) -> float:
    start = time.perf_counter()
    with dirs.writing(_Model(), step) as partial:
        (partial / "adapter_config.json").write_text('{"r": 8}')
        (partial / "adapter_model.safetensors").write_bytes(weights)
    return time.perf_counter() - start


def _load(dirs: CheckpointDirs, step: int) -> float:
    start = time.perf_counter()
    path = dirs.local_step(_Model(), step)
    assert path is not None
    (path / "adapter_model.safetensors").read_bytes()
    return time.perf_counter() - start


def _ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1000


def run() -> None:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        keys = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys).create_bucket(
            Bucket=bucket
        )
        store = ObjectStore(
            bucket,
            "bench",
            endpoint=endpoint,
            region="us-east-1",
            access_key_id="bench",
            secret_access_key="bench",
        )
        print("checkpoints (save and load through moto's S3 server on loopback ÷ local disk)")
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            local = CheckpointDirs(root / "local")
            writer = CheckpointDirs(
                root / "writer", shelf=Shelf(store, "cpu", Cache(root / "writer", 1 << 40))
            )
            step = 0
            for size in SIZES:
                weights = os.urandom(size)
                saves: dict[str, list[float]] = {"local": [], "store": []}
                loads: dict[str, list[float]] = {"local": [], "store": []}
                for round_ in range(ROUNDS + 1):  # round 0 warms both paths, uncounted
                    step += 1
                    local_save, store_save = (
                        _save(local, step, weights),
                        _save(writer, step, weights),
                    )
                    # A reader with an empty cache: every load downloads.
                    reader = CheckpointDirs(
                        root / f"reader-{step}",
                        shelf=Shelf(store, "cpu", Cache(root / f"reader-{step}", 1 << 40)),
                    )
                    local_load, store_load = _load(local, step), _load(reader, step)
                    if round_ == 0:
                        continue
                    saves["local"].append(local_save)
                    saves["store"].append(store_save)
                    loads["local"].append(local_load)
                    loads["store"].append(store_load)
                mib = size >> 20
                save_ratio = _ms(saves["store"]) / _ms(saves["local"])
                load_ratio = _ms(loads["store"]) / _ms(loads["local"])
                print(
                    f"  {mib:>3} MiB adapter: save {_ms(saves['store']):7.1f} ms store ÷ "
                    f"{_ms(saves['local']):6.1f} ms local = {save_ratio:5.1f}x; load (cold cache) "
                    f"{_ms(loads['store']):7.1f} ms ÷ {_ms(loads['local']):6.1f} ms = "
                    f"{load_ratio:5.1f}x  (median of {len(saves['local'])})"
                )
    finally:
        server.stop()


if __name__ == "__main__":
    run()
