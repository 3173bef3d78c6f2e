"""Webhooks kept apart by project (issue 28 §2): an endpoint belongs to the project of the
key that registered it, another project's answers 404 on every route, and the outbox
writes a delivery only to the endpoints of the job's own project, on both fan-out paths
(the statement `app.jobs.outbox.fan_out` runs in a transaction; the Postgres one-statement
final write has its own CTE), on both dialects."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from sqlalchemy import select

from app.db import write_connection
from app.jobs.events import append_event
from app.jobs.lifecycle import ErrorInfo, EventType, Failed, JobKind, Succeeded
from app.jobs.outbox import deliveries
from app.jobs.store import QueueStore, cancel_job_now
from app.models import DEFAULT_PROJECT_ID
from tests.conftest import LiveServer
from tests.factories import model_body, nat_collection
from tests.processes import until
from tests.test_projects import FRESH, ROOT, bearer, key, project
from tests.test_store import _job, _model
from tests.test_webhooks import JOB_EVENTS, Receiver
from tests.test_webhooks import _endpoint as endpoint

EVERY = [*JOB_EVENTS, "run.started", "run.cancelled"]


async def _endpoint(store: QueueStore, project_id: str) -> str:
    return await endpoint(store, EVERY, project_id=project_id)


async def _delivered(store: QueueStore) -> set[tuple[str, str, str | None]]:
    query = select(deliveries.c.endpoint_id, deliveries.c.event_type, deliveries.c.job_id)
    async with store.engine.connect() as conn:
        return {(row[0], row[1], row[2]) for row in await conn.execute(query)}


async def test_a_jobs_events_go_only_to_its_projects_endpoints(store: QueueStore) -> None:
    """Final writes (Postgres: the one-statement CTE; SQLite: `fan_out` in the write's
    transaction), a queued job's cancel and a run's events (`fan_out` on both dialects):
    each reaches the endpoint of its job's project, never the other's nor the default's."""
    a, b = await _endpoint(store, "proj_a"), await _endpoint(store, "proj_b")
    await _endpoint(store, DEFAULT_PROJECT_ID)
    await _model(store, "ma", "proj_a")
    await _model(store, "mb", "proj_b")
    ja, jb = await _job(store, "ma"), await _job(store, "mb")
    claims = await store.claim(owner="w", lease_seconds=30, limit=2)
    lease = {claim.lease.job_id: claim.lease for claim in claims}
    assert set(lease) == {ja, jb}
    await store.apply(lease[ja], Succeeded({"final_step": 4}))
    error = ErrorInfo(type="Bad", message="no", transient=False)
    await store.apply(lease[jb], Failed(error))
    assert await _delivered(store) == {(a, "job.succeeded", ja), (b, "job.failed", jb)}

    queued = await _job(store, "mb")
    async with write_connection(store.engine) as conn:
        await cancel_job_now(conn, queued)
    run = await _job(store, "ma", JobKind.run)
    async with write_connection(store.engine) as conn:
        await append_event(conn, run, (EventType.run_started, {}))
    assert await _delivered(store) == {
        (a, "job.succeeded", ja),
        (b, "job.failed", jb),
        (b, "job.cancelled", queued),
        (a, "run.started", run),
    }


@asynccontextmanager
async def _as(live: LiveServer, secret: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=live.url, headers=bearer(secret), timeout=30) as c:
        yield c


async def test_another_projects_endpoint_is_a_404_everywhere_and_nothing_changes(
    serve: Any,
) -> None:
    async with serve(**FRESH) as live:
        c = live.client
        pa, pb = await project(c, "a"), await project(c, "b")
        a_key, b_key = await key(c, pa, "write"), await key(c, pb, "write")
        async with _as(live, a_key["secret"]) as a, _as(live, b_key["secret"]) as b:
            body = {"url": "https://hooks.example.com/a", "event_types": JOB_EVENTS}
            made = await a.post("/v1/webhooks", json=body)
            assert made.status_code == 201, made.text
            mine = made.json()
            path = f"/v1/webhooks/{mine['id']}"
            before = (await a.get(path)).json()
            for method, suffix, json in [
                ("GET", "", None),
                ("PATCH", "", {"enabled": False}),
                ("DELETE", "", None),
                ("POST", "/rotate-secret", None),
                ("POST", "/test", None),
                ("GET", "/deliveries", None),
            ]:
                answer = await b.request(method, path + suffix, json=json)
                assert answer.status_code == 404, (method, suffix, answer.text)
                assert answer.headers["content-type"] == "application/problem+json"
                assert [e["path"] for e in answer.json()["errors"]] == ["endpoint_id"]
                # Word for word the answer for an id that does not exist.
                missing = await b.request(method, "/v1/webhooks/wh_nope" + suffix, json=json)
                assert (
                    answer.json()["detail"].replace(mine["id"], "wh_nope")
                    == (missing.json()["detail"])
                )
            assert (await a.get(path)).json() == before  # not disabled, not rotated
            assert (await a.get(f"{path}/deliveries")).json()["data"] == []  # no test queued
            assert (await b.get("/v1/webhooks")).json()["data"] == []
            theirs = await b.post("/v1/webhooks", json={**body, "url": "https://h.example/b"})
            assert theirs.status_code == 201
            assert [e["id"] for e in (await a.get("/v1/webhooks")).json()["data"]] == [mine["id"]]
            every = (await c.get("/v1/webhooks", headers=ROOT)).json()["data"]
            assert {e["id"] for e in every} == {mine["id"], theirs.json()["id"]}
            # An admin key reaches every project's endpoint.
            assert (await c.get(path, headers=ROOT)).status_code == 200
            assert (await a.delete(path)).status_code == 204


async def test_the_endpoint_limit_is_each_projects(serve: Any) -> None:
    body = {"url": "https://hooks.example.com/a", "event_types": JOB_EVENTS}
    async with serve(**FRESH, webhook_max_endpoints=1) as live:
        c = live.client
        pa, pb = await project(c, "a"), await project(c, "b")
        a_key, b_key = await key(c, pa, "write"), await key(c, pb, "write")
        async with _as(live, a_key["secret"]) as a, _as(live, b_key["secret"]) as b:
            assert (await a.post("/v1/webhooks", json=body)).status_code == 201
            refused = await a.post("/v1/webhooks", json=body)
            assert refused.status_code == 409, refused.text
            assert "this project has 1 webhook endpoints" in refused.json()["detail"]
            assert (await b.post("/v1/webhooks", json=body)).status_code == 201
            assert (await c.post("/v1/webhooks", json=body, headers=ROOT)).status_code == 201


HOOKS = FRESH | {"worker_enabled": True, "webhook_poll_seconds": 0.1}


async def test_each_receiver_gets_only_its_projects_jobs(serve: Any) -> None:
    """Over loopback: two projects, a receiver each, a job each on a dry-run model; each
    receiver gets its own project's job's end and nothing else."""
    ra, rb = Receiver(), Receiver()
    async with (
        LiveServer(ra.app()) as hook_a,
        LiveServer(rb.app()) as hook_b,
        serve(**HOOKS) as live,
    ):
        c = live.client
        pa, pb = await project(c, "a"), await project(c, "b")
        a_key, b_key = await key(c, pa, "write"), await key(c, pb, "write")
        async with _as(live, a_key["secret"]) as a, _as(live, b_key["secret"]) as b:
            secrets, jobs = {}, {}
            for name, client, hook in (("a", a, hook_a), ("b", b, hook_b)):
                made = await client.post(
                    "/v1/webhooks", json={"url": f"{hook.url}/hook", "event_types": JOB_EVENTS}
                )
                assert made.status_code == 201, made.text
                secrets[name] = made.json()["secret"]
                model = await client.post("/v1/models", json=model_body(f"m-{name}"))
                assert model.status_code == 201, model.text
                job = await client.post(
                    "/v1/training-jobs",
                    json={"model": f"m-{name}", "collection": nat_collection()},
                )
                assert job.status_code == 202, job.text
                jobs[name] = job.json()["id"]

            async def both() -> bool:
                return len(ra.requests) >= 1 and len(rb.requests) >= 1

            await until(both, timeout=60, what="a delivery at each receiver")

            async def ended() -> bool:  # every job ended and each delivery was recorded
                for client in (a, b):
                    hooks = (await client.get("/v1/webhooks")).json()["data"]
                    log = (await client.get(f"/v1/webhooks/{hooks[0]['id']}/deliveries")).json()
                    if [d["status"] for d in log["data"]] != ["succeeded"]:
                        return False
                return True

            await until(ended, timeout=60, what="each delivery recorded")
        for name, receiver in (("a", ra), ("b", rb)):
            messages = receiver.accepted(secrets[name])
            assert [m["data"]["id"] for m in messages.values()] == [jobs[name]]
            assert [m["type"] for m in messages.values()] == ["job.succeeded"]
