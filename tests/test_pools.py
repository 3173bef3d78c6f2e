"""Worker pools in the store, on both dialects: a worker claims only jobs of models in its
pool, on its backends, asking for labels it has; the claim stays one statement; a queued
job no live worker can run says why; a drain asked through the database reaches the
worker's heartbeat."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import insert, select, update

from app.db import utcnow, write_connection
from app.errors import NotFoundError
from app.jobs import pools
from app.jobs.lifecycle import JobKind
from app.jobs.payloads import Payload
from app.jobs.pools import Capabilities
from app.jobs.statements import jobs, models, workers
from app.jobs.store import QueueStore, enqueue, new_job
from app.training import spec
from tests import factories as f
from tests.backends import wait_final
from tests.processes import until
from trainyard_client import AsyncTrainyard
from trainyard_client import NotFoundError as MissingError


def _payload() -> Payload:
    return spec.encode([g for g in f.art_groups([[1.0, 0.0]])])


async def _model(
    store: QueueStore,
    name: str,
    *,
    backend: str = "dry-run",
    pool: str | None = None,
    labels: dict[str, str] | None = None,
) -> None:
    values: dict[str, Any] = {
        "name": name,
        "project": "p",
        "base_model": "tiny/base",
        "backend": backend,
        "config": {},
        "current_step": 0,
        "created_at": utcnow(),
        "updated_at": utcnow(),
        "pool": pool,
    }
    if labels is not None:
        values["labels"] = labels
    async with write_connection(store.engine) as conn:
        await conn.execute(insert(models).values(values))


async def _job(store: QueueStore, model: str) -> str:
    job = new_job(
        JobKind.training,
        model=model,
        payload=_payload(),
        summary={"num_groups": 1},
        request_hash="h",
        max_attempts=2,
    )
    async with write_connection(store.engine) as conn:
        await enqueue(conn, job)
    return job.id


async def _claimed(store: QueueStore, caps: Capabilities, limit: int = 8) -> set[str]:
    claims = await store.claim(owner="w", lease_seconds=30, limit=limit, capabilities=caps)
    return {claim.lease.model_name for claim in claims}


CPU = Capabilities("cpu", ("cpu", "dry-run"), {})
GPU_H200 = Capabilities("gpu", ("art-local",), {"gpu": "h200", "zone": "a"})
GPU_A100 = Capabilities("gpu", ("art-local",), {"gpu": "a100"})


async def test_a_worker_claims_only_what_it_can_run(store: QueueStore) -> None:
    await _model(store, "plain")  # no pool: `default`
    await _model(store, "cpu-dry", pool="cpu")
    await _model(store, "cpu-cpu", pool="cpu", backend="cpu")
    await _model(store, "gpu-any", pool="gpu", backend="art-local")
    await _model(store, "gpu-h200", pool="gpu", backend="art-local", labels={"gpu": "h200"})
    await _model(store, "gpu-no-labels", pool="gpu", backend="art-local", labels={})
    await _model(store, "gpu-dry", pool="gpu", backend="dry-run")
    for name in ("plain", "cpu-dry", "cpu-cpu", "gpu-any", "gpu-h200", "gpu-no-labels", "gpu-dry"):
        await _job(store, name)

    # An a100 worker of the gpu pool: not the h200 model, not the dry-run model.
    assert await _claimed(store, GPU_A100) == {"gpu-any", "gpu-no-labels"}
    assert await _claimed(store, Capabilities("cpu", ("cpu",), {})) == {"cpu-cpu"}
    assert await _claimed(store, GPU_H200) == {"gpu-h200"}
    assert await _claimed(store, Capabilities("default", ("cpu",), {})) == set()
    assert await _claimed(store, Capabilities("default", ("dry-run",), {})) == {"plain"}
    assert await _claimed(store, CPU) == {"cpu-dry"}
    # Nobody claimed the gpu pool's dry-run model: no gpu worker runs dry-run.
    async with store.engine.connect() as conn:
        queued = await conn.execute(select(jobs.c.model_name).where(jobs.c.status == "queued"))
        assert [row[0] for row in queued] == ["gpu-dry"]
    # Without capabilities (tools, benchmarks) a claim takes any job, as before pools.
    assert {c.lease.model_name for c in await store.claim(owner="x", lease_seconds=30)} == {
        "gpu-dry"
    }


async def test_labels_must_all_match_and_values_count(store: QueueStore) -> None:
    labels = {"gpu": "h200", "zone": "a"}
    await _model(store, "both", pool="gpu", backend="art-local", labels=labels)
    await _job(store, "both")
    assert await _claimed(store, Capabilities("gpu", ("art-local",), {"gpu": "h200"})) == set()
    zone_b = Capabilities("gpu", ("art-local",), {"gpu": "h200", "zone": "b"})
    assert await _claimed(store, zone_b) == set()
    more = Capabilities("gpu", ("art-local",), {"gpu": "h200", "zone": "a", "x": "1"})
    assert await _claimed(store, more) == {"both"}


async def test_a_pool_of_many_jobs_is_claimed_past_other_pools(store: QueueStore) -> None:
    """The claim pages through the oldest queued jobs: jobs of another pool ahead of them
    never hide a worker's own."""
    for i in range(12):
        await _model(store, f"other-{i}", pool="gpu", backend="art-local")
        await _job(store, f"other-{i}")
    for i in range(3):
        await _model(store, f"mine-{i}", pool="cpu")
        await _job(store, f"mine-{i}")
    assert await _claimed(store, CPU, limit=2) == {"mine-0", "mine-1"}
    assert await _claimed(store, CPU, limit=2) == {"mine-2"}


async def _register(
    store: QueueStore, worker_id: str, caps: Capabilities, *, age: float = 0.0
) -> None:
    await store.beat_worker(
        worker_id=worker_id,
        hostname="h",
        pid=1,
        registration=pools.registration(caps, "0.1.0"),
    )
    if age:
        async with write_connection(store.engine) as conn:
            await conn.execute(
                update(workers)
                .where(workers.c.id == worker_id)
                .values(heartbeat_at=utcnow() - timedelta(seconds=age))
            )


async def _waiting(store: QueueStore, *names: str) -> dict[str, str]:
    async with store.engine.connect() as conn:
        return await pools.waiting_for(conn, [(n, n) for n in names], lease_seconds=30)


async def test_a_job_no_live_worker_can_run_says_why(store: QueueStore) -> None:
    await _model(store, "gpu-h200", pool="gpu", backend="art-local", labels={"gpu": "h200"})
    await _model(store, "cpu-m", pool="cpu", backend="cpu")
    assert await _waiting(store, "gpu-h200", "cpu-m") == {
        "gpu-h200": "no live worker in pool `gpu`",
        "cpu-m": "no live worker in pool `cpu`",
    }
    await _register(store, "cpu-1", Capabilities("cpu", ("dry-run",), {}))
    await _register(store, "gpu-old", GPU_H200, age=31)  # silent for the lease time: gone
    assert await _waiting(store, "gpu-h200", "cpu-m") == {
        "gpu-h200": "no live worker in pool `gpu`",
        "cpu-m": "no live worker in pool `cpu` runs backend `cpu`",
    }
    await _register(store, "gpu-1", GPU_A100)
    await _register(store, "cpu-2", CPU)
    assert await _waiting(store, "gpu-h200", "cpu-m") == {
        "gpu-h200": "no live worker in pool `gpu` that runs backend `art-local` has the "
        "labels `gpu=h200`"
    }
    await _register(store, "gpu-2", GPU_H200)
    assert await _waiting(store, "gpu-h200", "cpu-m") == {}
    # A worker asked to drain claims nothing more: it no longer counts.
    async with write_connection(store.engine) as conn:
        drained = await pools.request_drain(conn, "gpu-2", lease_seconds=30)
    assert drained.draining and drained.drain_requested_at is not None
    assert (await _waiting(store, "gpu-h200"))["gpu-h200"].startswith("no live worker in pool")


async def test_list_and_drain_workers(store: QueueStore) -> None:
    await _model(store, "cpu-m", pool="cpu")
    job_id = await _job(store, "cpu-m")
    await _register(store, "cpu-1", CPU)
    await _register(store, "gone", CPU, age=31)
    claims = await store.claim(owner="cpu-1", lease_seconds=30, capabilities=CPU)
    assert [c.lease.job_id for c in claims] == [job_id]
    async with store.engine.connect() as conn:
        listed = await pools.list_workers(conn, lease_seconds=30)
    assert [(w.id, w.pool, w.backends, w.labels, w.jobs, w.draining) for w in listed] == [
        ("cpu-1", "cpu", ["cpu", "dry-run"], {}, [job_id], False)
    ]
    assert listed[0].version == "0.1.0"
    # The heartbeat tells the worker once a drain is asked; asking twice changes nothing.
    assert await store.beat_worker(worker_id="cpu-1", hostname="h", pid=1) is False
    async with write_connection(store.engine) as conn:
        first = await pools.request_drain(conn, "cpu-1", lease_seconds=30)
    async with write_connection(store.engine) as conn:
        again = await pools.request_drain(conn, "cpu-1", lease_seconds=30)
    assert first.drain_requested_at == again.drain_requested_at
    assert await store.beat_worker(worker_id="cpu-1", hostname="h", pid=1) is True
    with pytest.raises(NotFoundError):
        async with write_connection(store.engine) as conn:
            await pools.request_drain(conn, "gone", lease_seconds=30)


async def test_metrics_counts_by_pool_and_backend(store: QueueStore) -> None:
    await _model(store, "a", pool="cpu")
    await _model(store, "b")
    await _model(store, "c", pool="gpu", backend="art-local")
    for name in ("a", "a", "b", "c"):
        await _job(store, name)
    await _register(store, "cpu-1", CPU)
    await _register(store, "gpu-1", GPU_H200)
    async with store.engine.connect() as conn:
        assert await pools.queue_by_pool(conn) == {
            ("cpu", "dry-run"): 2,
            ("default", "dry-run"): 1,
            ("gpu", "art-local"): 1,
        }
        live = await pools.live_workers(conn, lease_seconds=30, claiming=False)
    assert pools.workers_by_pool(live) == {
        ("cpu", "cpu"): 1,
        ("cpu", "dry-run"): 1,
        ("gpu", "art-local"): 1,
    }


# -- over HTTP: models, jobs, workers, metrics --------------------------------------------


def _body(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "base_model": "tiny/base", "backend": "dry-run", **extra}


async def test_models_say_their_pool_and_labels(live) -> None:
    client = live.client
    created = await client.post("/v1/models", json=_body("g", pool="gpu", labels={"gpu": "h200"}))
    assert created.status_code == 201
    assert (created.json()["pool"], created.json()["labels"]) == ("gpu", {"gpu": "h200"})
    plain = (await client.post("/v1/models", json=_body("p"))).json()
    assert (plain["pool"], plain["labels"]) == ("default", {})
    again = await client.post("/v1/models", json=_body("g", pool="gpu", labels={"gpu": "h200"}))
    assert again.status_code == 200
    other = await client.post("/v1/models", json=_body("g", pool="cpu", labels={"gpu": "h200"}))
    assert other.status_code == 409
    for bad, loc in [
        ({"pool": "GPU pool"}, "pool"),
        ({"pool": ""}, "pool"),
        ({"labels": {"gpu": "h 200"}}, "labels.gpu"),
        ({"labels": {"-gpu": "h200"}}, "labels.-gpu.[key]"),
        ({"labels": {"gpu": 200}}, "labels.gpu"),
        ({"labels": ["gpu=h200"]}, "labels"),
    ]:
        response = await client.post("/v1/models", json=_body("bad", **bad))
        assert response.status_code == 422, bad
        assert response.headers["content-type"] == "application/problem+json"
        errors = response.json()["errors"]
        assert [(e["location"], e["path"]) for e in errors] == [("body", loc)], (bad, errors)
    assert (await client.get("/v1/models/bad")).status_code == 404  # nothing changed


async def test_a_job_of_a_pool_nobody_serves_waits_and_says_why(serve) -> None:
    """The in-process worker serves `default` with every backend this process loads: a job
    of the gpu pool waits, says why in its JSON and in the metrics, and is never claimed."""
    async with serve(worker_enabled=True) as live:
        client = live.client
        await client.post("/v1/models", json=_body("g", pool="gpu"))
        await client.post("/v1/models", json=_body("d"))
        waiting = (await f.submit(client, model="g")).json()
        assert waiting["status"] == "queued"
        assert waiting["waiting_for"] == "no live worker in pool `gpu`"
        ran = (await f.submit(client, model="d")).json()
        done = await wait_final(client, ran["id"])
        assert (done["status"], done["waiting_for"]) == ("succeeded", None)
        job = (await client.get(f"/v1/training-jobs/{waiting['id']}")).json()
        assert (job["status"], job["waiting_for"]) == ("queued", "no live worker in pool `gpu`")
        listed = (await client.get("/v1/training-jobs", params={"status": "queued"})).json()
        assert [(j["id"], j["waiting_for"]) for j in listed["data"]] == [
            (waiting["id"], "no live worker in pool `gpu`")
        ]
        workers = (await client.get("/v1/workers")).json()
        me = live.app.state.worker
        assert [(w["id"], w["pool"], w["draining"]) for w in workers] == [(me.id, "default", False)]
        assert "dry-run" in workers[0]["backends"] and workers[0]["version"]
        metrics = (await client.get("/metrics")).text
        assert 'trainyard_pool_queue_depth{backend="dry-run",pool="gpu"} 1.0' in metrics
        assert 'trainyard_live_workers{backend="dry-run",pool="default"} 1.0' in metrics
        async with AsyncTrainyard(live.url) as sdk:
            assert [w.id for w in await sdk.workers.list()] == [me.id]
            model = await sdk.models.create(
                name="sdk", base_model="b", backend="dry-run", pool="gpu", labels={"a": "b"}
            )
            assert (model.pool, model.labels) == ("gpu", {"a": "b"})
            with pytest.raises(MissingError):
                await sdk.workers.drain("nobody")
        # A model of another pool on a backend that serves: this worker does not try to
        # serve it (it could not run it), and readiness does not wait for it.
        art = {"name": "far", "base_model": "b", "backend": "art-local", "pool": "gpu"}
        assert (await client.post("/v1/models", json=art)).status_code == 201
        notifier = live.app.state.notifier

        async def seen() -> bool:
            return bool(me._models_seen == notifier.models_version)

        await until(seen, what="the worker to look at the new model")
        assert "far" not in me.serving and "far" not in me.not_served
        assert (await client.get("/readyz")).status_code == 200
        # Drained through the API: it stops claiming and shows it.
        assert (await client.post("/v1/workers/nobody/drain")).status_code == 404
        drained = await client.post(f"/v1/workers/{me.id}/drain")
        assert drained.status_code == 202 and drained.json()["draining"] is True
        assert [w["draining"] for w in (await client.get("/v1/workers")).json()] == [True]
        await asyncio.wait_for(me.drain_asked.wait(), 60)
        ready = (await client.get("/readyz")).json()  # the API itself is still fine
        assert ready["checks"]["worker"]["detail"].startswith("drained")
        late = (await f.submit(client, model="d")).json()["id"]

        async def says_why() -> bool:  # the API reads the live workers once a second
            job = (await client.get(f"/v1/training-jobs/{late}")).json()
            assert job["status"] == "queued"
            return bool(job["waiting_for"] == "no live worker in pool `default`")

        await until(says_why, what="the late job to say why it waits")


async def test_requests_that_find_the_waits_stale_at_once_share_one_read(
    store: QueueStore,
) -> None:
    """`waiting_for` of a GET comes from a per-process read of the live workers, made again
    once a second (`app.api.workers.Waits`): the requests that find it stale together wait
    for one read and take what it read, where each made its own."""
    from sqlalchemy import event

    from app.api.workers import Waits

    await _model(store, "gpu-m", pool="gpu", backend="art-local")
    reads: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "FROM workers" in statement:
            reads.append(statement)

    event.listen(store.engine.sync_engine, "before_cursor_execute", count)
    try:
        waits = Waits(store.engine, lease_seconds=30)
        answers = await asyncio.gather(*(waits.reasons({"gpu-m"}) for _ in range(16)))
        assert answers == [{"gpu-m": "no live worker in pool `gpu`"}] * 16
        assert len(reads) == 1, reads
        waits.read_at -= 60  # a second has passed: read again, once
        await _register(store, "gpu-1", Capabilities("gpu", ("art-local",), {}))
        answers = await asyncio.gather(*(waits.reasons({"gpu-m"}) for _ in range(16)))
        assert answers == [{}] * 16
        assert len(reads) == 2, reads
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", count)


async def test_requests_behind_a_slow_or_failed_read_of_the_waits_take_its_result(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that took longer than the time it is trusted for (here: a TTL of 0), or that
    failed, is still the answer of the requests that waited behind it: they do not each
    read again one after another."""
    from app.api import workers as api_workers

    await _model(store, "gpu-m", pool="gpu", backend="art-local")
    monkeypatch.setattr(api_workers, "LIVE_WORKERS_TTL", 0.0)
    real = pools.live_workers
    reads: list[int] = []
    failing = False

    async def live_workers(*args: Any, **kwargs: Any) -> Any:
        reads.append(1)
        await asyncio.sleep(0.01)  # the others queue behind it meanwhile
        if failing:
            raise ConnectionError("the database went away")
        return await real(*args, **kwargs)

    monkeypatch.setattr(pools, "live_workers", live_workers)
    waits = api_workers.Waits(store.engine, lease_seconds=30)
    answers = await asyncio.gather(*(waits.reasons({"gpu-m"}) for _ in range(16)))
    assert answers == [{"gpu-m": "no live worker in pool `gpu`"}] * 16
    assert len(reads) == 1
    failing = True
    answers = await asyncio.gather(
        *(waits.reasons({"gpu-m"}) for _ in range(16)), return_exceptions=True
    )
    assert [type(a).__name__ for a in answers].count("ConnectionError") == 1
    assert [a for a in answers if not isinstance(a, Exception)] == [
        {"gpu-m": "no live worker in pool `gpu`"}
    ] * 15
    assert len(reads) == 2
