"""Checkpoints in an S3-compatible object store: a real one, moto's standalone server
(`moto[server]`, started here on a loopback port), reached over HTTP by obstore as any S3
server would be. Two processes' worth of backends with their own caches share the store:
a step appears only with its manifest, each reads what the other wrote, deletes are seen by
both, the cache stays in its bounds (LRU), and the registry lists, deletes and exports
through the store over real HTTP."""

from __future__ import annotations

import io
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from app.backends.base import ModelSpec
from app.backends.dry_run import DryRunBackend
from app.backends.storage import Cache, ObjectStore, Shelf, Storage
from app.settings import Settings

KEYS = {"checkpoint_s3_access_key_id": "test", "checkpoint_s3_secret_access_key": "test"}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    """A fresh bucket in the server (made with boto3, as an operator would)."""
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    ).create_bucket(Bucket=name)
    return name


def _store(endpoint: str, bucket: str, prefix: str = "fleet") -> ObjectStore:
    return ObjectStore(
        bucket,
        prefix,
        endpoint=endpoint,
        region="us-east-1",
        access_key_id="test",
        secret_access_key="test",
    )


def _worker(root: Path, store: ObjectStore, max_bytes: int = 1 << 30) -> DryRunBackend:
    """One process's dry-run backend: its own cache directory, the shared store."""
    return DryRunBackend(root / "dry-run", shelf=Shelf(store, "dry-run", Cache(root, max_bytes)))


def _model() -> Any:
    import art

    return art.TrainableModel(name="m", project="p", base_model="b")


async def test_a_step_exists_in_the_store_only_once_its_manifest_is_written(
    s3_endpoint, bucket, tmp_path
) -> None:
    import obstore

    store = _store(s3_endpoint, bucket)
    worker = _worker(tmp_path / "a", store)
    model = _model()
    await worker.register(model)
    assert worker.steps(model).keys() == {0}
    key = "dry-run/p/models/m/checkpoints"
    # Files of step 1 uploaded, the manifest not yet (a trainer killed mid-upload).
    raw = obstore.store.S3Store(
        bucket,
        prefix="fleet",
        endpoint=s3_endpoint,
        region="us-east-1",
        access_key_id="test",
        secret_access_key="test",
        client_options={"allow_http": True},
    )
    obstore.put(raw, f"{key}/0001/adapter_model.safetensors", b"half")
    assert worker.step_on_disk(model) == 0
    assert store.info(key, 1) is None
    assert worker.local_step(model, 1) is None
    # A write that fails inside leaves nothing in the store; one that lands shows whole.
    with pytest.raises(RuntimeError), worker.writing(model, 2) as partial:
        (partial / "adapter_config.json").write_text("{}")
        raise RuntimeError("killed mid-write")
    assert worker.step_on_disk(model) == 0
    trained = await worker.train(model, [])
    assert trained.step == 1
    info = store.info(key, 1)
    assert info is not None and set(info.files) == {"manifest.json"}
    assert (
        info.size_bytes
        == (tmp_path / "a" / "dry-run" / key.split("/", 1)[1] / "0001" / "manifest.json")
        .stat()
        .st_size
    )


async def test_two_workers_with_their_own_caches_share_steps_through_the_store(
    s3_endpoint, bucket, tmp_path
) -> None:
    store = _store(s3_endpoint, bucket)
    a, b = _worker(tmp_path / "a", store), _worker(tmp_path / "b", store)
    model = _model()
    await a.register(model)
    for _ in range(3):
        await a.train(model, [])
    assert b.step_on_disk(model) == 3 and sorted(b.steps(model)) == [0, 1, 2, 3]
    assert not (b.checkpoints_dir(model) / "0002").exists()  # nothing on b's disk yet
    fetched = b.local_step(model, 2)
    assert fetched == b.checkpoints_dir(model) / "0002"
    written = a.checkpoints_dir(model) / "0002" / "manifest.json"
    assert (fetched / "manifest.json").read_bytes() == written.read_bytes()
    # b trains the next step from what a wrote; a sees it.
    assert (await b.train(model, [])).step == 4
    assert a.step_on_disk(model) == 4
    # A delete through one is a delete for both: b's cached copy is never served again.
    await a._delete_checkpoint_files(model, [0, 1, 3, 4])
    assert sorted(b.steps(model)) == [0, 1, 3, 4]
    assert b.local_step(model, 2) is None
    assert not (b.checkpoints_dir(model) / "0002").exists()
    # A step newer than every kept one is being written: never deleted.
    await b._delete_checkpoint_files(model, [1, 3])
    assert sorted(a.steps(model)) == [1, 3, 4]


async def test_the_cache_keeps_within_its_bytes_and_evicts_the_least_recently_used(
    s3_endpoint, bucket, tmp_path
) -> None:
    store = _store(s3_endpoint, bucket)
    writer = _worker(tmp_path / "writer", store)
    model = _model()
    await writer.register(model)
    for _ in range(4):
        with writer.writing(model, writer.step_on_disk(model) + 1) as partial:
            (partial / "adapter_model.safetensors").write_bytes(b"w" * 1000)
    reader = _worker(tmp_path / "reader", store, max_bytes=2500)  # two steps fit, not three
    cached = reader.checkpoints_dir(model)

    def held() -> list[int]:
        return sorted(int(p.name) for p in cached.iterdir() if p.name.isdigit())

    assert reader.local_step(model, 1) is not None
    assert reader.local_step(model, 2) is not None
    assert held() == [1, 2]
    assert reader.local_step(model, 1) is not None  # used again: 2 is now the oldest use
    assert reader.local_step(model, 3) is not None
    assert held() == [1, 3]
    assert reader.shelf is not None and reader.shelf.cache.size() <= 2500
    # A step larger than the whole cache is still loaded (the one in use always stays).
    tiny = _worker(tmp_path / "tiny", store, max_bytes=10)
    assert tiny.local_step(model, 4) is not None
    assert sorted(int(p.name) for p in tiny.checkpoints_dir(model).iterdir()) == [4]


def test_a_bad_checkpoint_url_or_endpoint_is_refused_at_start(tmp_path) -> None:
    for field, value in [
        ("checkpoint_url", "ftp://host/dir"),
        ("checkpoint_url", "relative/dir"),
        ("checkpoint_url", "s3:///no-bucket"),
        ("checkpoint_url", "file://host/dir"),
        ("checkpoint_s3_endpoint", "minio:9000"),
    ]:
        with pytest.raises(ValidationError) as caught:
            Settings(data_dir=tmp_path, **{field: value})
        assert [error["loc"] for error in caught.value.errors()] == [(field,)], value
    # The embedded default, a directory, an object store.
    assert Storage(Settings(data_dir=tmp_path)).place("cpu") == (tmp_path / "cpu", None)
    shared = Storage(Settings(data_dir=tmp_path, checkpoint_url=f"file://{tmp_path}/shared"))
    assert shared.place("cpu") == (tmp_path / "shared" / "cpu", None)
    remote = Storage(Settings(data_dir=tmp_path, checkpoint_url="s3://b/p", **KEYS))
    path, shelf = remote.place("cpu")
    assert path == tmp_path / "checkpoint-cache" / "cpu" and shelf is not None
    assert shelf.store.url == "s3://b/p"


async def test_the_registry_lists_deletes_and_exports_through_the_store(
    serve, s3_endpoint, bucket, tmp_path
) -> None:
    """Two API processes (each its own data directory: nothing shared on disk) on one
    database and one store: what one writes the other lists, deletes and exports."""
    shared = {
        "checkpoint_url": f"s3://{bucket}/trainyard",
        "checkpoint_s3_endpoint": s3_endpoint,
        "checkpoint_s3_region": "us-east-1",
        **KEYS,
    }
    async with (
        serve(data_dir=tmp_path / "one", **shared) as one,
        serve(data_dir=tmp_path / "two", **shared) as two,
    ):
        body = {"name": "dry", "base_model": "m", "backend": "dry-run"}
        assert (await one.client.post("/v1/models", json=body)).status_code == 201
        backend = one.app.state.backends.get("dry-run")
        model = await backend.model(ModelSpec("dry", "default", "m"))
        writer = backend.backend
        assert isinstance(writer, DryRunBackend) and writer.shelf is not None
        for _ in range(3):
            await writer.train(model, [])
        with writer.writing(model, 4) as partial:  # an adapter, to export
            (partial / "adapter_config.json").write_text('{"r": 1}')
            (partial / "adapter_model.safetensors").write_bytes(b"weights")

        listed = (await two.client.get("/v1/models/dry/checkpoints")).json()["data"]
        assert [c["step"] for c in listed] == [4, 3, 2, 1, 0]
        assert listed[0]["aliases"] == ["latest"] and listed[0]["size_bytes"] == len('{"r": 1}') + 7
        assert not (tmp_path / "two" / "checkpoint-cache" / "dry-run").exists()

        exported = await two.client.get("/v1/models/dry/checkpoints/4/export")
        assert exported.status_code == 200, exported.text
        with tarfile.open(fileobj=io.BytesIO(exported.content)) as tar:
            member = tar.extractfile("dry-step0004/adapter_model.safetensors")
            assert member is not None and member.read() == b"weights"

        assert (await two.client.delete("/v1/models/dry/checkpoints/2")).status_code == 204
        protected = await two.client.delete("/v1/models/dry/checkpoints/4")
        assert protected.status_code == 409
        assert protected.json()["errors"][0]["path"] == "step"
        steps = [
            c["step"] for c in (await one.client.get("/v1/models/dry/checkpoints")).json()["data"]
        ]
        assert steps == [4, 3, 1, 0]
        missing = await one.client.get("/v1/models/dry/checkpoints/2/export")
        assert missing.status_code == 404
        assert missing.json()["errors"][0]["path"] == "step"

        put = await one.client.put("/v1/models/dry/retention", json={"keep_last": 1})
        assert put.status_code in (200, 201), put.text
        applied = await two.client.post("/v1/models/dry/retention/apply")
        assert applied.status_code == 200, applied.text
        # 0 is the model's current step (no job moved it): protected.
        assert applied.json()["kept"] == [0, 4] and applied.json()["deleted"] == [1, 3]
        assert sorted(writer.steps(model)) == [0, 4]


@pytest.mark.torch
async def test_a_merged_export_reads_its_step_through_the_store(
    serve, s3_endpoint, bucket, tmp_path
) -> None:
    """One process writes a step to the store; another, whose cache lacks it, exports it
    merged into the base model (the base is local to both)."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from app.backends.tiny_model import make_tiny_model
    from tests.test_checkpoint_merged import _adapter, _logits, _untar

    tiny = make_tiny_model(tmp_path / "models" / "tiny")
    adapter = tmp_path / "adapter"
    _adapter(tiny, adapter, r=4, target_modules=["q_proj", "o_proj"])
    shared = {
        "checkpoint_url": f"s3://{bucket}/trainyard",
        "checkpoint_s3_endpoint": s3_endpoint,
        "checkpoint_s3_region": "us-east-1",
        "model_roots": [tiny.parent],
        **KEYS,
    }
    async with (
        serve(data_dir=tmp_path / "one", **shared) as one,
        serve(data_dir=tmp_path / "two", **shared) as two,
    ):
        body = {"name": "dry", "base_model": str(tiny), "backend": "dry-run"}
        assert (await one.client.post("/v1/models", json=body)).status_code == 201
        backend = one.app.state.backends.get("dry-run")
        writer = backend.backend
        model = await backend.model(ModelSpec("dry", "default", str(tiny)))
        with writer.writing(model, 1) as partial:
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copy(adapter / name, partial / name)
        assert not (tmp_path / "two" / "checkpoint-cache" / "dry-run").exists()
        exported = await two.client.get(
            "/v1/models/dry/checkpoints/1/export", params={"format": "merged"}
        )
        assert exported.status_code == 200, exported.text

    _untar(exported.content, tmp_path / "out")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "dry-step0001-merged")
    base = AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
    with_adapter = _logits(PeftModel.from_pretrained(base, adapter))
    assert _logits(merged).allclose(with_adapter, atol=1e-4, rtol=1e-4)


def test_compose_workers_and_api_share_one_object_store(monkeypatch) -> None:
    """docker-compose.yml: every app service stores checkpoints in the `minio` service's
    bucket, which `minio-init` creates before any of them starts."""
    from tests.test_deploy import APP_SERVICES, environment, services, settings_from_env

    svc = services()
    stores = set()
    for name in APP_SERVICES:
        settings = settings_from_env(environment(svc[name]), monkeypatch)
        assert settings.checkpoint_url is not None and settings.checkpoint_s3_endpoint
        stores.add((settings.checkpoint_url, settings.checkpoint_s3_endpoint))
        depends = svc[name]["depends_on"]
        assert depends["minio-init"]["condition"] == "service_completed_successfully"
    assert len(stores) == 1, stores
    ((url, endpoint),) = stores
    bucket = url.removeprefix("s3://").split("/")[0]
    assert endpoint == "http://minio:9000" and "minio" in svc
    init = " ".join(svc["minio-init"]["entrypoint"])
    assert f"mc mb --ignore-existing fleet/{bucket}" in init
    assert svc["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    minio_env = environment(svc["minio"])
    app_env = environment(svc[APP_SERVICES[0]])
    assert minio_env["MINIO_ROOT_USER"] == app_env["TRAINYARD_CHECKPOINT_S3_ACCESS_KEY_ID"]
    assert minio_env["MINIO_ROOT_PASSWORD"] == app_env["TRAINYARD_CHECKPOINT_S3_SECRET_ACCESS_KEY"]


@pytest.mark.torch
async def test_cpu_workers_without_a_shared_disk_train_on_and_serve_each_others_steps(
    serve, s3_endpoint, bucket, tmp_path, tmp_path_factory
) -> None:
    """One cpu worker trains two steps and stops; another, its own data directory and
    nothing on disk from the first, trains step 3 from step 2 (loaded from the store) and
    its gateway serves `toy@1`, fetched into its cache."""
    import openai

    from app.backends.tiny_model import make_tiny_model

    base = make_tiny_model(tmp_path_factory.mktemp("storage-models") / "tiny")
    shared = {
        "checkpoint_url": f"s3://{bucket}/fleet",
        "checkpoint_s3_endpoint": s3_endpoint,
        "checkpoint_s3_region": "us-east-1",
        "worker_enabled": True,
        "model_roots": [base.parent],
        **KEYS,
    }
    group = {
        "trajectories": [
            {
                "messages_and_choices": [
                    {"role": "user", "content": "say yes"},
                    {"role": "assistant", "content": answer},
                ],
                "reward": reward,
            }
            for answer, reward in (("yes", 1.0), ("no", 0.0))
        ]
    }
    hyperparameters = {"learning_rate": 0.05, "allow_training_without_logprobs": True}
    body = {"model": "toy", "groups": [group], "hyperparameters": hyperparameters}

    async def train(client: Any) -> int:
        from tests.backends import wait_final

        response = await client.post("/v1/training-jobs", json=body)
        assert response.status_code == 202, response.text
        job = await wait_final(client, response.json()["id"])
        assert job["status"] == "succeeded", job
        step = int(job["result"]["final_step"])
        where = f"s3://{bucket}/fleet/cpu/tests/models/toy/checkpoints/{step:04d}"
        assert job["result"]["checkpoint_path"] == where
        return step

    async with serve(data_dir=tmp_path / "one", **shared) as one:
        model = {"name": "toy", "project": "tests", "base_model": str(base), "backend": "cpu"}
        assert (await one.client.post("/v1/models", json=model)).status_code == 201
        assert [await train(one.client), await train(one.client)] == [1, 2]

    cache = tmp_path / "two" / "checkpoint-cache" / "cpu" / "tests" / "models" / "toy"
    async with serve(data_dir=tmp_path / "two", **shared) as two:
        assert await train(two.client) == 3
        assert sorted(p.name for p in (cache / "checkpoints").iterdir() if p.name.isdigit()) == [
            "0002",
            "0003",
        ]  # step 2 loaded from the store to train from, step 3 written
        listed = (await two.client.get("/v1/models/toy/checkpoints")).json()["data"]
        assert [c["step"] for c in listed] == [3, 2, 1, 0]
        gateway = openai.AsyncOpenAI(base_url=f"{two.url}/openai/v1", api_key="none", max_retries=0)
        answer = await gateway.chat.completions.create(
            model="toy@1", messages=[{"role": "user", "content": "say yes"}], max_tokens=1
        )
        assert answer.model == "toy@1"
        assert (cache / "checkpoints" / "0001" / "adapter_model.safetensors").exists()


async def test_a_step_written_again_is_replaced_whole_for_readers(
    s3_endpoint, bucket, tmp_path
) -> None:
    store = _store(s3_endpoint, bucket)
    a, b = _worker(tmp_path / "a", store), _worker(tmp_path / "b", store)
    model = _model()
    with a.writing(model, 1) as partial:
        (partial / "adapter_model.safetensors").write_bytes(b"old")
        (partial / "optimizer.pt").write_bytes(b"state")
    with a.writing(model, 1) as partial:
        (partial / "adapter_model.safetensors").write_bytes(b"newer")
    info = store.info("dry-run/p/models/m/checkpoints", 1)
    assert info is not None and info.files == {"adapter_model.safetensors": 5}
    fetched = b.local_step(model, 1)
    assert fetched is not None
    assert sorted(p.name for p in fetched.iterdir()) == ["adapter_model.safetensors"]
    assert (fetched / "adapter_model.safetensors").read_bytes() == b"newer"
    # replace=False keeps the step in the store, whatever this process wrote.
    with a.writing(model, 1, replace=False) as partial:
        (partial / "adapter_model.safetensors").write_bytes(b"other")
    assert store.info("dry-run/p/models/m/checkpoints", 1) == info
