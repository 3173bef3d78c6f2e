"""Webhooks: registration and its refusals, the test message, and the outbox end to end:
every state change delivered once, signed (checked with `standardwebhooks`), to a receiver
on loopback, also when it was down and the service restarted in between."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from sqlalchemy import insert, select, update
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from app.db import utcnow, write_connection
from app.jobs.lifecycle import ErrorInfo, EventType, Failed, JobKind, JobStatus, Succeeded
from app.jobs.outbox import WebhookEventType, reported, webhook_type
from app.models import DEFAULT_PROJECT_ID, JobEventRow
from app.schemas.webhooks import EventTypeName
from app.webhooks.sender import WebhookSender, new_secret, sign, signatures
from tests.conftest import LiveServer
from tests.factories import create_model, submit
from tests.processes import free_port, start_api, stop, until, wait_ready

JOB_EVENTS = ["job.succeeded", "job.failed", "job.cancelled"]


@dataclass
class Receiver:
    """A webhook receiver: records every request; answers `status` (503: "down")."""

    status: int = 200
    requests: list[tuple[dict[str, str], bytes]] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/hook")
        async def hook(request: Request) -> Response:
            self.requests.append((dict(request.headers), await request.body()))
            moved = {"location": "http://other.example/hook"} if self.status in (301, 307) else {}
            return Response(status_code=self.status, headers=moved)

        return app

    def accepted(self, secret: str) -> dict[str, dict[str, Any]]:
        """The messages answered 2xx, by webhook-id, each verified; fails on a duplicate."""
        seen: dict[str, dict[str, Any]] = {}
        verifier = Webhook(secret)
        for headers, body in self.requests[self.first_ok :]:
            message = verifier.verify(body, headers)
            assert headers["webhook-id"] not in seen, f"delivered twice: {headers['webhook-id']}"
            seen[headers["webhook-id"]] = message
        return seen

    first_ok: int = 0  # requests before this index were answered with a failure


async def register(client: httpx.AsyncClient, url: str, types: list[str]) -> dict[str, Any]:
    response = await client.post("/v1/webhooks", json={"url": url, "event_types": types})
    assert response.status_code == 201, response.text
    return response.json()


def test_the_wire_names_every_event_type() -> None:
    assert set(EventTypeName.__args__) == {t.value for t in WebhookEventType}  # type: ignore[attr-defined]


def test_signature_is_standard_webhooks() -> None:
    secret = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"type": "webhook.test"}'
    now = int(time.time())
    headers = {
        "webhook-id": "msg_1",
        "webhook-timestamp": str(now),
        "webhook-signature": sign(secret, "msg_1", now, body),
    }
    assert Webhook(secret).verify(body, headers) == {"type": "webhook.test"}


def test_which_job_events_are_webhook_events() -> None:
    assert webhook_type(EventType.training_ended, JobKind.training) == "job.succeeded"
    assert webhook_type(EventType.rollout_failed, JobKind.rollout) == "job.failed"
    assert webhook_type(EventType.job_cancelled, JobKind.run) == "run.cancelled"
    assert webhook_type(EventType.run_ended, JobKind.run) == "run.succeeded"
    assert reported(EventType.gradient_step) is None
    assert reported(EventType.job_claimed) is None


async def test_bad_registrations_are_refused_with_their_paths(live: LiveServer) -> None:
    ok = {"url": "https://hooks.example.com/x", "event_types": ["job.succeeded"]}
    cases = [
        ({**ok, "url": "ftp://hooks.example.com/x"}, "url"),
        ({**ok, "url": "http://user:pw@hooks.example.com/x"}, "url"),
        ({**ok, "url": "http://169.254.169.254/latest"}, "url"),
        ({**ok, "url": "http://hooks.example.com:0/x"}, "url"),
        ({**ok, "url": "https://hooks.example.com:000/x"}, "url"),
        ({**ok, "event_types": ["job.exploded"]}, "event_types[0]"),
        ({**ok, "event_types": []}, "event_types"),
        ({"url": ok["url"]}, "event_types"),
        ({**ok, "secret": "mine"}, "secret"),
        ({**ok, "description": "x" * 513}, "description"),
    ]
    for body, path in cases:
        response = await live.client.post("/v1/webhooks", json=body)
        assert response.status_code == 422, (body, response.text)
        assert response.headers["content-type"] == "application/problem+json"
        assert path in [error["path"] for error in response.json()["errors"]], response.text
    assert (await live.client.get("/v1/webhooks")).json()["data"] == []  # nothing stored


async def test_endpoints_are_listed_changed_and_removed(live: LiveServer) -> None:
    created = await register(live.client, "https://hooks.example.com/a", JOB_EVENTS)
    assert created["secret"].startswith("whsec_")
    assert created["event_types"] == JOB_EVENTS and created["enabled"] is True
    other = await register(live.client, "https://hooks.example.com/b", ["run.started"])
    shown = (await live.client.get(f"/v1/webhooks/{created['id']}")).json()
    assert "secret" not in shown
    page = (await live.client.get("/v1/webhooks", params={"limit": 1})).json()
    assert [e["id"] for e in page["data"]] == [other["id"]] and page["has_more"]
    page = (await live.client.get("/v1/webhooks", params={"after": page["next_cursor"]})).json()
    assert [e["id"] for e in page["data"]] == [created["id"]] and not page["has_more"]
    patched = await live.client.patch(f"/v1/webhooks/{created['id']}", json={"enabled": False})
    assert patched.status_code == 200 and patched.json()["enabled"] is False
    bad = await live.client.patch(f"/v1/webhooks/{created['id']}", json={"enabled": "no"})
    assert bad.status_code == 422 and bad.json()["errors"][0]["path"] == "enabled"
    assert (await live.client.delete(f"/v1/webhooks/{created['id']}")).status_code == 204
    for path in ("", "/deliveries"):
        missing = await live.client.get(f"/v1/webhooks/{created['id']}{path}")
        assert missing.status_code == 404
        assert missing.headers["content-type"] == "application/problem+json"
    assert (await live.client.post(f"/v1/webhooks/{created['id']}/test")).status_code == 404


HOOK_SETTINGS = {"worker_enabled": True, "webhook_poll_seconds": 0.1}


async def test_the_test_message_is_signed_and_its_attempt_logged(serve) -> None:
    receiver = Receiver()
    async with LiveServer(receiver.app()) as hook, serve(**HOOK_SETTINGS) as live:
        endpoint = await register(live.client, f"{hook.url}/hook", ["run.started"])
        response = await live.client.post(f"/v1/webhooks/{endpoint['id']}/test")
        assert response.status_code == 202, response.text
        queued = response.json()
        assert queued["status"] == "pending" and queued["event_type"] == "webhook.test"
        await until(lambda: _true(receiver.requests), timeout=15, what="the test message")
        (message,) = receiver.accepted(endpoint["secret"]).values()
        assert message["type"] == "webhook.test"
        assert message["data"] == {"endpoint_id": endpoint["id"]}

        async def logged() -> dict[str, Any] | None:
            page = await live.client.get(f"/v1/webhooks/{endpoint['id']}/deliveries")
            delivery = page.json()["data"][0]
            return delivery if delivery["status"] == "succeeded" else None

        delivery = await until(logged, timeout=10, what="the attempt to be logged")
        (attempt,) = delivery["attempts"]
        assert attempt["attempt"] == 1 and attempt["status_code"] == 200
        assert attempt["error"] is None and attempt["duration_ms"] >= 0
        assert delivery["message_id"] == queued["message_id"]


async def _true(value: Any) -> Any:
    return value


async def test_sends_obey_the_egress_policy_and_follow_no_redirect(serve) -> None:
    """A name that passes at registration is checked again at every send (here it
    resolves to a denied loopback address); a redirect is a failed attempt, not followed."""
    receiver = Receiver(status=307)
    async with (
        LiveServer(receiver.app()) as hook,
        serve(**HOOK_SETTINGS, egress_deny=["loopback"]) as denying,
    ):
        port = hook.url.rsplit(":", 1)[1]
        literal = await denying.client.post(
            "/v1/webhooks", json={"url": f"{hook.url}/hook", "event_types": JOB_EVENTS}
        )
        assert literal.status_code == 422 and literal.json()["errors"][0]["path"] == "url"
        assert "egress policy" in literal.json()["errors"][0]["message"]
        named = await register(denying.client, f"http://localhost:{port}/hook", JOB_EVENTS)
        await denying.client.post(f"/v1/webhooks/{named['id']}/test")
        attempt = await _first_attempt(denying.client, named["id"])
        assert "refused by the egress policy" in attempt["error"], attempt
        assert attempt["status_code"] is None and receiver.requests == []
    async with LiveServer(receiver.app()) as hook, serve(**HOOK_SETTINGS) as live:
        moved = await register(live.client, f"{hook.url}/hook", JOB_EVENTS)
        await live.client.post(f"/v1/webhooks/{moved['id']}/test")
        attempt = await _first_attempt(live.client, moved["id"])
        assert attempt["status_code"] == 307 and "redirects are not followed" in attempt["error"]
        assert len(receiver.requests) == 1  # and nothing went to the other host


async def _first_attempt(client: httpx.AsyncClient, endpoint_id: str) -> dict[str, Any]:
    async def attempted() -> dict[str, Any] | None:
        page = (await client.get(f"/v1/webhooks/{endpoint_id}/deliveries")).json()
        tries = page["data"][0]["attempts"]
        return tries[0] if tries else None

    return await until(attempted, timeout=15, what="an attempt")


async def test_every_state_change_is_delivered_once_under_load(serve) -> None:
    """200 training jobs: 180 on three fast dry-run models, 10 that fail, 10 on a slow
    model that are cancelled (running or queued). One signed delivery per job, of its final
    status, each verified."""
    receiver = Receiver()
    settings = HOOK_SETTINGS | {"worker_concurrency": 5, "webhook_concurrency": 16}
    async with LiveServer(receiver.app()) as hook, serve(**settings) as live:
        endpoint = await register(live.client, f"{hook.url}/hook", JOB_EVENTS)
        fast = [f"load{i}" for i in range(3)]
        for name in fast:
            await create_model(live.client, name)
        await create_model(live.client, "failing", fail_with="the trainer refused")
        await create_model(live.client, "slow", seconds_per_step=600)
        plan = [fast[i % 3] for i in range(180)] + ["failing"] * 10 + ["slow"] * 10
        started = time.monotonic()
        ids: list[str] = []
        for chunk in range(0, len(plan), 20):
            answers = await asyncio.gather(*(submit(live.client, m) for m in plan[chunk:][:20]))
            ids += [answer.json()["id"] for answer in answers]
        for job_id in ids[-10:]:  # the slow model's: one running, the rest queued
            cancel = await live.client.post(f"/v1/training-jobs/{job_id}/cancel")
            assert cancel.status_code == 200, cancel.text
        submitted = time.monotonic()

        async def all_delivered() -> bool:
            return len(receiver.requests) >= len(ids)

        await until(all_delivered, timeout=120, what="200 deliveries")
        done = time.monotonic()
        await asyncio.sleep(1.0)  # a duplicate would arrive now
        messages = receiver.accepted(endpoint["secret"])
        assert len(messages) == len(ids) == len(receiver.requests)
        by_job = Counter(m["data"]["id"] for m in messages.values())
        assert set(by_job) == set(ids) and set(by_job.values()) == {1}
        for message_id, message in messages.items():
            job_id = message["data"]["id"]
            job = (await live.client.get(f"/v1/training-jobs/{job_id}")).json()
            assert message["type"] == f"job.{job['status']}", message
            assert message["data"]["status"] == job["status"]
            assert message["data"]["kind"] == "training"
            assert message["data"]["model"] == job["model"]
            assert message_id == f"msg_{job_id}_{message['data']['event']['seq']}"
        types = Counter(m["type"] for m in messages.values())
        assert types == {"job.succeeded": 180, "job.failed": 10, "job.cancelled": 10}

        async def recorded() -> bool:  # each attempt is written after its answer
            metrics = (await live.client.get("/metrics")).text
            return 'trainyard_webhook_deliveries{status="succeeded"} 200.0' in metrics

        await until(recorded, timeout=10, what="every delivery recorded as succeeded")
        print(
            f"\n200 jobs: submitted in {submitted - started:.1f} s; every delivery received "
            f"{done - started:.1f} s after the first submit ({len(ids) / (done - started):.0f}/s)"
        )


RETRY_FAST = ",".join(["0.2", "0.5"] + ["1"] * 40)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
async def test_a_receiver_that_was_down_gets_everything_after_a_restart(
    make_settings, how: str
) -> None:
    """The receiver answers 503, then refuses connections while the service restarts
    (stopped, or killed with deliveries claimed: their lease runs out), then comes back: it
    gets every delivery once, all signed; none was lost on the way."""
    settings = make_settings()
    receiver = Receiver(status=503)
    hook_port, api_port = free_port(), free_port()
    url = f"http://127.0.0.1:{api_port}"
    extra = {
        "TRAINYARD_WEBHOOK_RETRY_SCHEDULE": RETRY_FAST,
        "TRAINYARD_WEBHOOK_POLL_SECONDS": "0.1",
        # The receiver answers at once; 2 s timed out once on a machine loaded by other
        # work, and the first attempt read as a timeout, not the 503 it was sent.
        "TRAINYARD_WEBHOOK_TIMEOUT_SECONDS": "5",
    }
    hook: LiveServer | None = LiveServer(receiver.app(), port=hook_port)
    await hook.__aenter__()
    api = start_api(settings, api_port, **extra)
    try:
        await wait_ready(url, [api])
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            endpoint = await register(client, f"http://127.0.0.1:{hook_port}/hook", JOB_EVENTS)
            await create_model(client, "down")
            ids = [(await submit(client, "down")).json()["id"] for _ in range(20)]

            log = f"/v1/webhooks/{endpoint['id']}/deliveries"

            async def failing() -> bool:  # every job ended, and each delivery failed once
                # Recorded, not only received: a kill between the receiver's 503 and its
                # record would leave that delivery's first recorded attempt a later one.
                page = (await client.get(log, params={"limit": 100})).json()
                return len(page["data"]) == len(ids) and all(
                    any(a["status_code"] == 503 for a in d["attempts"]) for d in page["data"]
                )

            await until(failing, timeout=60, what="a recorded 503 of each delivery")
        if how == "sigkill":
            api.kill()
            api.wait()
        stop(api)
        await hook.__aexit__()  # down: connections are refused now
        hook = None
        api = start_api(settings, api_port, **extra)
        await wait_ready(url, [api])
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def refused() -> bool:
                page = (await client.get(log, params={"limit": 100})).json()
                errors = [a["error"] or "" for d in page["data"] for a in d["attempts"]]
                return any("ConnectError" in e for e in errors)

            await until(refused, timeout=60, what="an attempt that found the receiver down")
            receiver.status, receiver.first_ok = 200, len(receiver.requests)
            hook = LiveServer(receiver.app(), port=hook_port)
            await hook.__aenter__()

            async def delivered() -> bool:
                return len(receiver.requests) - receiver.first_ok >= len(ids)

            await until(delivered, timeout=60, what="every delivery after the receiver is back")
            await asyncio.sleep(1.0)
            messages = receiver.accepted(endpoint["secret"])
            assert sorted(m["data"]["id"] for m in messages.values()) == sorted(ids)
            assert {m["type"] for m in messages.values()} == {"job.succeeded"}
            page = (await client.get(log, params={"limit": 100})).json()
            assert len(page["data"]) == len(ids)
            for delivery in page["data"]:
                assert delivery["status"] == "succeeded", delivery
                tries = delivery["attempts"]
                assert tries[0]["status_code"] == 503 and tries[-1]["status_code"] == 200
                assert [t["attempt"] for t in tries] == list(range(1, len(tries) + 1))
    finally:
        stop(api)
        if hook is not None:
            await hook.__aexit__()


# -- the outbox, at the store: written with the change, on both dialects -------------------


async def _endpoint(
    store: Any, types: list[str], *, enabled: bool = True, project_id: str = DEFAULT_PROJECT_ID
) -> str:
    from app.jobs.outbox import endpoints, subscriptions

    endpoint_id = f"wh_{project_id}_{len(types)}_{int(enabled)}_{time.monotonic_ns()}"
    async with write_connection(store.engine) as conn:
        await conn.execute(
            insert(endpoints).values(
                id=endpoint_id,
                url="http://127.0.0.1:9/hook",
                description="",
                secret="whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                event_types=types,
                enabled=enabled,
                created_at=utcnow(),
                updated_at=utcnow(),
                project_id=project_id,
            )
        )
        for type_ in types:
            await conn.execute(
                insert(subscriptions).values(endpoint_id=endpoint_id, event_type=type_)
            )
    return endpoint_id


async def _deliveries(store: Any) -> list[tuple[str, str, str | None, int | None, str]]:
    from app.jobs.outbox import deliveries as d

    query = select(d.c.endpoint_id, d.c.event_type, d.c.job_id, d.c.event_seq, d.c.message_id)
    async with store.engine.connect() as conn:
        return [tuple(row) for row in await conn.execute(query.order_by(d.c.id))]


async def test_a_final_write_and_its_deliveries_commit_together(store) -> None:
    """Each subscribed, enabled endpoint gets one row, in the final write's own statement
    (Postgres) or transaction (SQLite); a write whose lease is lost writes none."""
    from tests.test_store import _job, _model

    every = await _endpoint(store, JOB_EVENTS)
    ended_only = await _endpoint(store, ["job.succeeded"])
    await _endpoint(store, JOB_EVENTS, enabled=False)
    await _endpoint(store, ["run.started"])
    await _model(store, "m")
    job_id = await _job(store, "m")
    (claim,) = await store.claim(owner="w", lease_seconds=30)
    assert await _deliveries(store) == []  # queued, claimed: not webhook events
    assert await store.apply(claim.lease, Succeeded({"final_step": 4})) == JobStatus.succeeded
    assert await store.apply(claim.lease, Succeeded({"final_step": 4})) is None  # lease gone
    rows = await _deliveries(store)
    seq = rows[0][3]
    assert sorted(rows) == sorted(
        (endpoint, "job.succeeded", job_id, seq, f"msg_{job_id}_{seq}")
        for endpoint in (every, ended_only)
    )
    async with store.engine.connect() as conn:
        event = (
            await conn.execute(
                select(JobEventRow.type).where(JobEventRow.job_id == job_id, JobEventRow.seq == seq)
            )
        ).scalar_one()
    assert event == "training_ended"

    failing = await _job(store, "m")
    (claim,) = await store.claim(owner="w", lease_seconds=30)
    assert claim.lease.job_id == failing
    error = ErrorInfo(type="Bad", message="no", transient=False)
    await store.apply(claim.lease, Failed(error))
    assert [r[:3] for r in (await _deliveries(store))[2:]] == [(every, "job.failed", failing)]


async def test_a_run_is_reported_as_a_run(store) -> None:
    """`job_cancelled` on a run's row is `run.cancelled`; `run_started` a run's only."""
    from app.jobs.events import append_event
    from tests.test_store import _job, _model

    endpoint = await _endpoint(store, ["run.started", "run.cancelled", "job.cancelled"])
    await _model(store, "m")
    run_id = await _job(store, "m", JobKind.run)
    async with write_connection(store.engine) as conn:
        await append_event(conn, run_id, (EventType.run_started, {}))
        await append_event(conn, run_id, (EventType.job_cancelled, {"while": "running"}))
    assert [r[:3] for r in await _deliveries(store)] == [
        (endpoint, "run.started", run_id),
        (endpoint, "run.cancelled", run_id),
    ]


# -- changing an endpoint: its URL and event types ------------------------------------------


async def test_patch_changes_url_and_event_types_and_refuses_what_registration_does(
    live: LiveServer,
) -> None:
    created = await register(live.client, "https://hooks.example.com/a", JOB_EVENTS)
    path = f"/v1/webhooks/{created['id']}"
    cases = [
        ({"url": "ftp://hooks.example.com/x"}, "url"),
        ({"url": "http://user:pw@hooks.example.com/x"}, "url"),
        ({"url": "http://169.254.169.254/latest"}, "url"),
        ({"url": "http://hooks.example.com:0/x"}, "url"),
        ({"url": "https://hooks.example.com/" + "x" * 2048}, "url"),
        ({"url": None}, "url"),
        ({"enabled": None}, "enabled"),
        ({"enabled": False, "event_types": None}, "event_types"),
        ({"description": None}, "description"),
        ({"event_types": ["job.succeeded", "job.exploded"]}, "event_types[1]"),
        ({"event_types": []}, "event_types"),
        ({"event_types": "job.failed"}, "event_types"),
        ({"url": "https://hooks.example.com/b", "secret": "mine"}, "secret"),
        ({"url": "https://hooks.example.com/b", "event_types": ["nope"]}, "event_types[0]"),
    ]
    for body, where in cases:
        response = await live.client.patch(path, json=body)
        assert response.status_code == 422, (body, response.text)
        assert response.headers["content-type"] == "application/problem+json"
        assert where in [error["path"] for error in response.json()["errors"]], response.text
    unchanged = (await live.client.get(path)).json()
    assert unchanged == {k: v for k, v in created.items() if k != "secret"}  # nothing changed
    empty = await live.client.patch(path, json={})
    assert empty.status_code == 200 and empty.json() == unchanged  # not even updated_at

    changed = await live.client.patch(
        path,
        json={"url": "https://hooks.example.com/v2", "event_types": ["run.failed", "run.failed"]},
    )
    assert changed.status_code == 200, changed.text
    shown = changed.json()
    assert shown["url"] == "https://hooks.example.com/v2"
    assert shown["event_types"] == ["run.failed"] and shown["enabled"] is True
    assert shown["updated_at"] > created["updated_at"]
    assert (await live.client.get(path)).json() == shown
    from app.jobs.outbox import subscriptions

    async with live.app.state.engine.connect() as conn:
        rows = await conn.execute(
            select(subscriptions.c.event_type).where(subscriptions.c.endpoint_id == created["id"])
        )
        assert [row.event_type for row in rows] == ["run.failed"]  # the outbox's join
    missing = await live.client.patch("/v1/webhooks/wh_nope", json={"enabled": False})
    assert missing.status_code == 404


async def test_no_patch_route_takes_null_for_a_field_that_cannot_be_null(
    live: LiveServer,
) -> None:
    """The class, not one route: every PATCH route in the API, every field of its body,
    sent as null, is a 422 naming that field and changes nothing. A new PATCH route fails
    here until it is listed (with a resource to change)."""
    from app.schemas.common import PatchBody

    created = await register(live.client, "https://hooks.example.com/a", JOB_EVENTS)
    resources = {"/v1/webhooks/{endpoint_id}": f"/v1/webhooks/{created['id']}"}
    schema = (await live.client.get("/openapi.json")).json()
    patches = {path: ops["patch"] for path, ops in schema["paths"].items() if "patch" in ops}
    assert set(patches) == set(resources), "a PATCH route without a case here"
    for template, operation in patches.items():
        ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        name = ref.rsplit("/", 1)[1]
        fields = schema["components"]["schemas"][name]["properties"]
        assert fields, name
        path = resources[template]
        before = (await live.client.get(path)).json()
        for field_name in fields:
            response = await live.client.patch(path, json={field_name: None})
            assert response.status_code == 422, (template, field_name, response.text)
            assert response.headers["content-type"] == "application/problem+json"
            errors = response.json()["errors"]
            assert [error["path"] for error in errors] == [field_name], errors
            assert "may not be null" in errors[0]["message"]
        assert (await live.client.get(path)).json() == before
    from app.schemas.webhooks import WebhookEndpointUpdate

    assert issubclass(WebhookEndpointUpdate, PatchBody)


async def test_pending_deliveries_go_to_the_new_url(serve) -> None:
    """A delivery queued before the URL changed is sent to the new URL: the sender reads
    the endpoint when it sends."""
    old, new = Receiver(), Receiver()
    async with (
        LiveServer(old.app()) as old_hook,
        LiveServer(new.app()) as new_hook,
        serve(**HOOK_SETTINGS) as live,
    ):
        endpoint = await register(live.client, f"{old_hook.url}/hook", ["run.started"])
        path = f"/v1/webhooks/{endpoint['id']}"
        await live.client.patch(path, json={"enabled": False})  # it waits
        queued = (await live.client.post(f"{path}/test")).json()
        moved = await live.client.patch(path, json={"url": f"{new_hook.url}/hook", "enabled": True})
        assert moved.status_code == 200, moved.text
        await until(lambda: _true(new.requests), timeout=15, what="the delivery at the new URL")
        (message_id,) = new.accepted(endpoint["secret"])
        assert message_id == queued["message_id"] and old.requests == []


# -- secret rotation -------------------------------------------------------------------------


async def _expire_previous_secret(live: LiveServer, endpoint_id: str) -> None:
    from app.jobs.outbox import endpoints

    async with write_connection(live.app.state.engine) as conn:
        await conn.execute(
            update(endpoints)
            .where(endpoints.c.id == endpoint_id)
            .values(previous_secret_expires_at=utcnow() - timedelta(seconds=1))
        )


async def test_a_rotated_secret_signs_beside_the_new_one_for_the_grace_period(serve) -> None:
    receiver = Receiver()
    async with LiveServer(receiver.app()) as hook, serve(**HOOK_SETTINGS) as live:
        endpoint = await register(live.client, f"{hook.url}/hook", ["run.started"])
        path = f"/v1/webhooks/{endpoint['id']}"
        before = time.time()
        rotated = await live.client.post(f"{path}/rotate-secret")
        assert rotated.status_code == 200, rotated.text
        new_secret, old_secret = rotated.json()["secret"], endpoint["secret"]
        assert new_secret.startswith("whsec_") and new_secret != old_secret
        expires = datetime.fromisoformat(rotated.json()["previous_secret_expires_at"])
        assert abs(expires.timestamp() - before - 86400) < 60  # the default grace: a day
        shown = (await live.client.get(path)).json()
        assert "secret" not in shown and shown["previous_secret_expires_at"] is not None

        await live.client.post(f"{path}/test")
        await until(lambda: _true(receiver.requests), timeout=15, what="a delivery")
        headers, body = receiver.requests[0]
        assert len(headers["webhook-signature"].split(" ")) == 2
        for secret in (new_secret, old_secret):  # a receiver holding either accepts it
            assert Webhook(secret).verify(body, headers)["type"] == "webhook.test"

        await _expire_previous_secret(live, endpoint["id"])  # the grace period is over
        assert (await live.client.get(path)).json()["previous_secret_expires_at"] is None
        await live.client.post(f"{path}/test")
        await until(lambda: _true(len(receiver.requests) > 1), timeout=15, what="a delivery")
        headers, body = receiver.requests[1]
        assert len(headers["webhook-signature"].split(" ")) == 1
        assert Webhook(new_secret).verify(body, headers)["type"] == "webhook.test"
        with pytest.raises(WebhookVerificationError):
            Webhook(old_secret).verify(body, headers)
        missing = await live.client.post("/v1/webhooks/wh_nope/rotate-secret")
        assert missing.status_code == 404
        assert missing.headers["content-type"] == "application/problem+json"


async def test_without_a_grace_period_the_old_secret_stops_at_once(serve) -> None:
    async with serve(webhook_secret_grace_seconds=0) as live:
        endpoint = await register(live.client, "https://hooks.example.com/a", ["run.started"])
        rotated = (await live.client.post(f"/v1/webhooks/{endpoint['id']}/rotate-secret")).json()
        assert rotated["previous_secret_expires_at"] is None
        assert rotated["secret"] != endpoint["secret"]


def test_several_secrets_sign_one_header_every_receiver_accepts() -> None:
    old, new = new_secret(), new_secret()
    body, now = b'{"type": "webhook.test"}', int(time.time())
    header = signatures((new, old), "msg_1", now, body)
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(now), "webhook-signature": header}
    assert header.split(" ")[0] == sign(new, "msg_1", now, body)
    for secret in (old, new):
        assert Webhook(secret).verify(body, headers) == {"type": "webhook.test"}
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, headers)


# -- retention -------------------------------------------------------------------------------


async def test_old_ended_deliveries_are_deleted_in_batches_pending_and_recent_stay(
    store, make_settings
) -> None:
    from app.jobs.outbox import attempts as a
    from app.jobs.outbox import deliveries as d

    endpoint_id = await _endpoint(store, ["job.succeeded"])
    now = utcnow()
    old, recent = now - timedelta(days=8), now - timedelta(days=1)
    rows = (
        [("succeeded", old)] * 3
        + [("failed", old)] * 2
        + [("succeeded", recent), ("failed", recent), ("pending", None), ("pending", None)]
    )
    async with write_connection(store.engine) as conn:
        for i, (status, finished) in enumerate(rows):
            delivery_id = (
                await conn.execute(
                    insert(d)
                    .values(
                        endpoint_id=endpoint_id,
                        message_id=f"msg_test_{i}",
                        event_type="webhook.test",
                        status=status,
                        attempts=1,
                        next_attempt_at=old,  # a pending one long overdue stays too
                        created_at=old,
                        finished_at=finished,
                    )
                    .returning(d.c.id)
                )
            ).scalar_one()
            await conn.execute(
                insert(a).values(delivery_id=delivery_id, attempt=1, started_at=old, duration_ms=1)
            )
    sender = WebhookSender(
        engine=store.engine,
        settings=make_settings(webhook_retention_seconds=7 * 86400),
        wake=asyncio.Event(),
    )
    try:
        assert await sender.prune(batch=2) == 5  # in three transactions of at most two
        assert await sender.prune(batch=2) == 0
    finally:
        await sender.close()
    async with store.engine.connect() as conn:
        kept = (await conn.execute(select(d.c.id, d.c.status, d.c.finished_at))).all()
        assert sorted(row.status for row in kept) == ["failed", "pending", "pending", "succeeded"]
        assert all(row.finished_at is None or row.finished_at > old for row in kept)
        tries = (await conn.execute(select(a.c.delivery_id))).scalars().all()
        assert sorted(tries) == sorted(row.id for row in kept)  # their attempts went too
