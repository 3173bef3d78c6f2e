"""Fair webhook delivery: the senders' claim serves endpoints round-robin, caps what is in
flight per endpoint and per host, keeps slots free for endpoints that answer, and holds
back (circuit breaker) an endpoint whose attempts keep timing out. Time is controlled:
every claim and record is given its `now`; nothing here waits on a clock. Also the cap
on endpoints, and secret rotations serialised (real concurrent HTTP calls)."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import insert, select

from app.db import create_engine, utcnow, write_connection
from app.jobs.outbox import deliveries, endpoints, subscriptions
from app.models import WebhookEndpointRow
from app.settings import Settings
from app.webhooks.sender import Due, Result, WebhookSender
from app.webhooks.service import health_of
from tests.conftest import LiveServer

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
FAIR = {
    "webhook_concurrency": 8,
    "webhook_unproven_share": 0.5,
    "webhook_max_in_flight_per_endpoint": 2,
    "webhook_max_in_flight_per_host": 4,
    "webhook_breaker_threshold": 2,
    "webhook_breaker_seconds": 300.0,
    "webhook_timeout_seconds": 10.0,
}


@pytest.fixture
async def sender(database_url: str, make_settings: Any) -> Any:
    engine = create_engine(database_url)
    sender = WebhookSender(engine=engine, settings=make_settings(**FAIR), wake=asyncio.Event())
    try:
        yield sender
    finally:
        await sender.close()
        await engine.dispose()


async def add_endpoint(
    sender: WebhookSender,
    name: str,
    *,
    host: str | None = None,
    answered: bool = False,
    due: int = 1,
    due_at: datetime = T0,
) -> str:
    """An endpoint (at `host`, default its own) with `due` deliveries due at `due_at`."""
    host = host or f"{name}.example"
    async with write_connection(sender.engine) as conn:
        await conn.execute(
            insert(endpoints).values(
                id=name,
                url=f"http://{host}/hook",
                host=host,
                description="",
                secret=SECRET,
                event_types=["job.succeeded"],
                enabled=True,
                answered_at=T0 - timedelta(days=1) if answered else None,
                created_at=T0 - timedelta(days=2),
                updated_at=T0 - timedelta(days=2),
            )
        )
        await conn.execute(insert(subscriptions).values(endpoint_id=name, event_type="run.failed"))
        for i in range(due):
            await conn.execute(
                insert(deliveries).values(
                    endpoint_id=name,
                    message_id=f"msg_test_{name}_{i}",
                    event_type="webhook.test",
                    status="pending",
                    attempts=0,
                    next_attempt_at=due_at,
                    created_at=due_at,
                )
            )
    return name


async def claim(sender: WebhookSender, now: datetime, *, limit: int = 8, unproven: int = 4) -> Any:
    token = secrets.token_hex(8)
    return token, await sender.claim(token, limit=limit, unproven_limit=unproven, now=now)


def outcome(due: Due, *, status: int | None = None, timed_out: bool = False) -> Result:
    error = None if status == 200 else "timed out after 10 s" if timed_out else "HTTP 503"
    return Result(due, T0, 10, status, error, timed_out)


async def endpoint_row(sender: WebhookSender, endpoint_id: str) -> Any:
    async with sender.engine.connect() as conn:
        query = select(WebhookEndpointRow.__table__).where(endpoints.c.id == endpoint_id)
        return (await conn.execute(query)).one()


async def test_an_endpoint_that_answers_is_served_first_whatever_silent_ones_wait(
    sender: WebhookSender,
) -> None:
    """60 silent endpoints with 3 deliveries each, due an hour before the one delivery of
    an endpoint that answers: the first claim takes that one; the silent ones get only
    the slots for endpoints not known to answer, one endpoint after another."""
    silent = [
        await add_endpoint(sender, f"silent{i:02}", due=3, due_at=T0 - timedelta(hours=1))
        for i in range(60)
    ]
    healthy = await add_endpoint(sender, "healthy", answered=True, due_at=T0)
    token, first = await claim(sender, T0)
    by_endpoint = Counter(due.endpoint_id for due in first)
    assert by_endpoint[healthy] == 1
    assert sum(by_endpoint[name] for name in silent) == 4  # the unproven share, no more
    assert all(by_endpoint[name] <= 1 for name in silent)  # one each: not answering yet
    (answered,) = [due for due in first if due.endpoint_id == healthy]
    assert answered.proven
    await sender.record(token, [outcome(answered, status=200)], now=T0)
    # Round-robin: every silent endpoint is served once before any is served twice.
    served = [due.endpoint_id for due in first if due.endpoint_id != healthy]
    now = T0
    while len(served) < 60:
        now += timedelta(seconds=11)  # the leases of earlier claims still hold
        _, batch = await claim(sender, now)
        assert batch, "a silent endpoint was skipped"
        served += [due.endpoint_id for due in batch]
    assert sorted(served) == silent


async def test_an_endpoint_whose_attempts_time_out_is_held_back_then_tried_alone(
    sender: WebhookSender,
) -> None:
    slow = await add_endpoint(sender, "slow", answered=True, due=5)
    token, batch = await claim(sender, T0)
    assert [due.endpoint_id for due in batch] == [slow, slow]  # known to answer: two
    await sender.record(token, [outcome(batch[0], timed_out=True)], now=T0)
    row = await endpoint_row(sender, slow)
    assert row.consecutive_timeouts == 1 and health_of(row, T0).breaker == "closed"
    assert (await claim(sender, T0))[1] == []  # timing out: one in flight, and one is
    now = T0 + timedelta(seconds=10)
    await sender.record(token, [outcome(batch[1], timed_out=True)], now=now)
    row = await endpoint_row(sender, slow)
    assert row.consecutive_timeouts == 2  # webhook_breaker_threshold
    assert row.breaker_open_until == now + timedelta(seconds=300)
    health = health_of(row, now)
    assert health.breaker == "open" and health.breaker_open_until == row.breaker_open_until
    # Open: nothing is claimed, however long its deliveries have been due.
    for later in (now, now + timedelta(seconds=299)):
        assert (await claim(sender, later))[1] == []
    # Half open: one delivery at a time; an answer closes it.
    reopened = row.breaker_open_until + timedelta(seconds=1)
    assert health_of(row, reopened).breaker == "half_open"
    token, batch = await claim(sender, reopened)
    assert len(batch) == 1 and not batch[0].proven
    assert (await claim(sender, reopened))[1] == []  # that one is in flight
    await sender.record(token, [outcome(batch[0], status=503)], now=reopened)
    row = await endpoint_row(sender, slow)
    assert row.consecutive_timeouts == 0 and row.breaker_open_until is None
    assert health_of(row, reopened).breaker == "closed"
    _, batch = await claim(sender, reopened + timedelta(seconds=1))
    assert len(batch) == 2  # known to answer again: its cap per endpoint


async def test_a_timeout_while_half_open_opens_the_breaker_again(sender: WebhookSender) -> None:
    slow = await add_endpoint(sender, "slow", answered=True, due=4)
    token, batch = await claim(sender, T0)
    await sender.record(token, [outcome(d, timed_out=True) for d in batch], now=T0)
    until = (await endpoint_row(sender, slow)).breaker_open_until
    assert until == T0 + timedelta(seconds=300)
    later = until + timedelta(seconds=1)
    token, batch = await claim(sender, later)
    assert len(batch) == 1
    await sender.record(token, [outcome(batch[0], timed_out=True)], now=later)
    assert (await endpoint_row(sender, slow)).breaker_open_until == later + timedelta(seconds=300)


async def test_a_refused_connection_neither_trips_nor_resets_the_breaker(
    sender: WebhookSender,
) -> None:
    down = await add_endpoint(sender, "down", answered=True, due=4)
    token, batch = await claim(sender, T0)
    await sender.record(token, [outcome(batch[0], timed_out=True), outcome(batch[1])], now=T0)
    row = await endpoint_row(sender, down)
    assert row.consecutive_timeouts == 1 and row.breaker_open_until is None


async def test_in_flight_is_capped_per_endpoint_and_per_host(sender: WebhookSender) -> None:
    """Across claims (and so across workers): leased deliveries count until recorded."""
    busy = await add_endpoint(sender, "busy", answered=True, due=10)
    shared = [
        await add_endpoint(sender, f"tenant{i}", host="shared.example", answered=True, due=2)
        for i in range(5)
    ]
    other = await add_endpoint(sender, "other", answered=True, due=1)
    token, first = await claim(sender, T0, limit=16, unproven=16)
    got = Counter(due.endpoint_id for due in first)
    assert got[busy] == 2  # webhook_max_in_flight_per_endpoint
    assert sum(got[name] for name in shared) == 4  # webhook_max_in_flight_per_host
    assert got[other] == 1
    _, second = await claim(sender, T0, limit=16, unproven=16)
    assert second == []  # nothing more until some of those end
    mine = [due for due in first if due.endpoint_id == busy]
    await sender.record(token, [outcome(mine[0], status=200)], now=T0)
    _, third = await claim(sender, T0 + timedelta(seconds=1), limit=16, unproven=16)
    assert [due.endpoint_id for due in third] == [busy]


async def test_a_lease_that_ran_out_frees_its_slot(sender: WebhookSender) -> None:
    """A sender that died holds nothing once its leases pass."""
    busy = await add_endpoint(sender, "busy", answered=True, due=3)
    _, first = await claim(sender, T0)
    assert len(first) == 2
    assert (await claim(sender, T0 + timedelta(seconds=5)))[1] == []
    _, again = await claim(sender, T0 + timedelta(seconds=60))  # lease: 2 x 10 s + 5 s
    assert len(again) == 2 and {due.endpoint_id for due in again} == {busy}


async def test_the_sender_loop_keeps_slots_for_endpoints_that_answer(
    database_url: str, make_settings: Any
) -> None:
    """`fill` (what the loop calls) with the slots of unproven endpoints all in flight
    still claims an answering endpoint's delivery."""
    engine = create_engine(database_url)
    settings: Settings = make_settings(**FAIR)
    sender = WebhookSender(engine=engine, settings=settings, wake=asyncio.Event())
    gate = asyncio.Event()

    async def held(due: Due) -> Result:  # a send that does not end until the test says
        await gate.wait()
        return outcome(due, status=200)

    sender.send = held  # type: ignore[method-assign]
    try:
        past = utcnow() - timedelta(minutes=5)
        for i in range(10):
            await add_endpoint(sender, f"silent{i}", due=2, due_at=past)
        assert await sender.fill() == 4  # the unproven share of 8 slots
        assert await sender.fill() == 0
        await add_endpoint(sender, "healthy", answered=True, due_at=past)
        assert await sender.fill() == 1
        gate.set()
        await asyncio.gather(*list(sender._flying))
    finally:
        await sender.close()
        await engine.dispose()


# -- the API: a cap on endpoints, rotations serialised ---------------------------------------


async def test_endpoints_past_the_cap_are_refused(serve: Any) -> None:
    body = {"url": "https://hooks.example.com/a", "event_types": ["job.failed"]}
    async with serve(webhook_max_endpoints=2) as live:
        for _ in range(2):
            assert (await live.client.post("/v1/webhooks", json=body)).status_code == 201
        refused = await live.client.post("/v1/webhooks", json=body)
        assert refused.status_code == 409, refused.text
        assert refused.headers["content-type"] == "application/problem+json"
        assert "TRAINYARD_WEBHOOK_MAX_ENDPOINTS=2" in refused.json()["detail"]
        assert len((await live.client.get("/v1/webhooks")).json()["data"]) == 2
        shown = (await live.client.get("/v1/webhooks")).json()["data"][0]
        assert shown["health"] == {
            "breaker": "closed",
            "consecutive_timeouts": 0,
            "breaker_open_until": None,
            "answered_at": None,
        }
        assert shown["secret_version"] == 1
        # An open breaker, as the senders leave it: in the JSON and in /metrics.
        until = utcnow() + timedelta(minutes=5)
        async with write_connection(live.app.state.engine) as conn:
            await conn.execute(
                endpoints.update()
                .where(endpoints.c.id == shown["id"])
                .values(consecutive_timeouts=5, breaker_open_until=until)
            )
        health = (await live.client.get(f"/v1/webhooks/{shown['id']}")).json()["health"]
        assert health["breaker"] == "open" and health["consecutive_timeouts"] == 5
        assert datetime.fromisoformat(health["breaker_open_until"]) == until
        metrics = (await live.client.get("/metrics")).text
        assert 'trainyard_webhook_endpoints{breaker="open"} 1.0' in metrics
        assert 'trainyard_webhook_endpoints{breaker="closed"} 1.0' in metrics
        assert "trainyard_webhook_in_flight 0.0" in metrics


async def test_concurrent_registrations_never_pass_the_cap(serve: Any) -> None:
    body = {"url": "https://hooks.example.com/a", "event_types": ["job.failed"]}
    async with serve(webhook_max_endpoints=3) as live:
        answers = await asyncio.gather(
            *(live.client.post("/v1/webhooks", json=body) for _ in range(8))
        )
        assert sorted(a.status_code for a in answers) == [201] * 3 + [409] * 5
        assert len((await live.client.get("/v1/webhooks")).json()["data"]) == 3


async def test_concurrent_rotations_each_get_their_own_version(live: LiveServer) -> None:
    created = await live.client.post(
        "/v1/webhooks", json={"url": "https://hooks.example.com/a", "event_types": ["run.failed"]}
    )
    endpoint = created.json()
    path = f"/v1/webhooks/{endpoint['id']}"
    answers = await asyncio.gather(*(live.client.post(f"{path}/rotate-secret") for _ in range(8)))
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
    rotated = {a.json()["secret_version"]: a.json()["secret"] for a in answers}
    assert sorted(rotated) == list(range(2, 10))  # one version each, none lost
    shown = (await live.client.get(path)).json()
    assert shown["secret_version"] == 9
    async with live.app.state.engine.connect() as conn:
        row = (
            await conn.execute(
                select(endpoints.c.secret, endpoints.c.previous_secret).where(
                    endpoints.c.id == endpoint["id"]
                )
            )
        ).one()
    assert row.secret == rotated[9]  # the highest version is the one that signs
    assert row.previous_secret == rotated[8]  # and the one it replaced signs beside it


async def test_a_rotation_with_if_match_of_a_stale_version_is_409(live: LiveServer) -> None:
    created = await live.client.post(
        "/v1/webhooks", json={"url": "https://hooks.example.com/a", "event_types": ["run.failed"]}
    )
    path = f"/v1/webhooks/{created.json()['id']}/rotate-secret"
    answers = await asyncio.gather(
        *(live.client.post(path, headers={"If-Match": '"1"'}) for _ in range(6))
    )
    assert sorted(a.status_code for a in answers) == [200] + [409] * 5
    (won,) = [a.json() for a in answers if a.status_code == 200]
    assert won["secret_version"] == 2
    lost = next(a for a in answers if a.status_code == 409)
    assert lost.headers["content-type"] == "application/problem+json"
    assert lost.json()["secret_version"] == 2
    assert (await live.client.post(path, headers={"If-Match": "2"})).json()["secret_version"] == 3
    bad = await live.client.post(path, headers={"If-Match": "latest"})
    assert bad.status_code == 422 and bad.json()["errors"][0]["path"] == "if-match"
    missing = await live.client.post(
        "/v1/webhooks/wh_nope/rotate-secret", headers={"If-Match": "1"}
    )
    assert missing.status_code == 404


async def test_neither_silent_endpoints_nor_a_full_host_hide_one_that_answers(
    sender: WebhookSender, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim looks at a bounded number of endpoints: each lane (known to answer, or
    not) is scanned apart, and full endpoints and hosts are left out of the scan."""
    monkeypatch.setattr("app.webhooks.sender.SCAN_ENDPOINTS", 3)
    for i in range(6):  # never claimed: first in round-robin order
        await add_endpoint(sender, f"crowd{i}", host="crowded.example", answered=True, due=2)
    for i in range(6):
        await add_endpoint(sender, f"silent{i}", due=1)
    healthy = await add_endpoint(sender, "healthy", answered=True)
    lone = await add_endpoint(sender, "lone", host="elsewhere.example", answered=True)
    async with write_connection(sender.engine) as conn:  # served a moment ago: last in order
        await conn.execute(
            endpoints.update()
            .where(endpoints.c.id.in_([healthy, lone]))
            .values(last_claimed_at=T0 - timedelta(seconds=1))
        )
    _, first = await claim(sender, T0, limit=16, unproven=2)
    got = Counter(due.endpoint_id for due in first)
    assert sum(n for name, n in got.items() if name.startswith("crowd")) == 4  # its host cap
    assert sum(n for name, n in got.items() if name.startswith("silent")) == 2
    _, second = await claim(sender, T0, limit=16, unproven=0)
    assert {due.endpoint_id for due in second} == {healthy, lone}


async def test_concurrent_claims_of_several_senders_keep_the_caps(
    database_url: str, make_settings: Any
) -> None:
    """Senders of several workers (each its own engine) claiming at once: the caps are
    counted across them (Postgres: claims go one at a time under an advisory lock)."""
    settings = make_settings(**FAIR)
    engines = [create_engine(database_url) for _ in range(3)]
    senders = [WebhookSender(engine=e, settings=settings, wake=asyncio.Event()) for e in engines]
    try:
        busy = await add_endpoint(senders[0], "busy", answered=True, due=10)
        shared = [
            await add_endpoint(senders[0], f"t{i}", host="shared.example", answered=True, due=3)
            for i in range(4)
        ]
        batches = await asyncio.gather(
            *(claim(sender, T0, limit=8, unproven=8) for sender in senders for _ in range(3))
        )
        got = Counter(due.endpoint_id for _, batch in batches for due in batch)
        assert got[busy] == 2
        assert sum(got[name] for name in shared) == 4
        ids = [due.id for _, batch in batches for due in batch]
        assert len(ids) == len(set(ids))  # no delivery leased twice
    finally:
        for sender in senders:
            await sender.close()
        for engine in engines:
            await engine.dispose()
