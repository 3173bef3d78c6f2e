"""Fair webhook delivery: how soon an endpoint that answers gets its deliveries while
1,000 endpoints that never answer have deliveries due before them.

Real parts: a SQLite file at the schema's head, `WebhookSender.run` (the workers' loop)
in this process, real HTTP over loopback. The silent receiver accepts every connection
and never answers (each attempt runs into `TRAINYARD_WEBHOOK_TIMEOUT_SECONDS`); the
healthy one answers 200 at once. 1,000 silent endpoints each get one delivery, due a
minute ago; then the healthy endpoint (which has answered before) gets a delivery every
0.25 s for 6 s, and the bench measures, for each, the time from being due (inserted, the
sender woken as a job ending wakes it) to its attempt reaching the receiver.

Three senders, same settings (concurrency 8, timeout 1 s, poll 0.2 s):
- baseline: the claim before fair delivery (the oldest due deliveries first, no cap), in
  this run: the healthy endpoint waits behind every silent delivery, about
  1,000 / 8 x 1 s = 125 s; the bench stops looking after `WINDOW` seconds;
- fair, distinct hosts: the silent endpoints as if each were on a host of its own (the
  per-host cap raised to 1,024): only the unproven share of the slots and the round-robin
  protect the healthy endpoint;
- fair, one host: the silent endpoints all on one host (default per-host cap, 4).
Goal: every healthy delivery attempted within 2 s (median and worst are printed), against
the baseline's none within the window.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import insert, select, update

from app.db import create_engine, utcnow, write_connection
from app.jobs.outbox import PENDING, deliveries, endpoints
from app.migrate import migrate
from app.settings import Settings
from app.webhooks.sender import Due, WebhookSender, _claimed, _signing, body_of, lease_seconds
from bench.common import report

SILENT = 1000
CONCURRENCY = 8
TIMEOUT = 1.0
HEALTHY_EVERY = 0.25
HEALTHY_FOR = 6.0
WINDOW = 15.0
GOAL = 2.0
SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


class FifoSender(WebhookSender):
    """The baseline: the claim as it was before fair delivery (the oldest due first)."""

    async def claim(
        self, token: str, *, limit: int, unproven_limit: int, now: Any = None
    ) -> list[Due]:
        moment = utcnow()
        due = (
            select(deliveries.c.id)
            .where(deliveries.c.status == PENDING, deliveries.c.next_attempt_at <= moment)
            .order_by(deliveries.c.next_attempt_at)
            .limit(limit)
        )
        lease = moment + timedelta(seconds=lease_seconds(self.settings))
        async with write_connection(self.engine) as conn:
            ids = list((await conn.execute(due)).scalars())
            if not ids:
                return []
            await conn.execute(
                update(deliveries)
                .where(deliveries.c.id.in_(ids))
                .values(lease_token=token, next_attempt_at=lease)
            )
            rows = (await conn.execute(_claimed().where(deliveries.c.id.in_(ids)))).all()
        return [
            Due(
                r.id,
                r.message_id,
                r.url,
                _signing(r, moment),
                r.attempts,
                body_of(r),
                r.endpoint_id,
            )
            for r in rows
        ]


class Receivers:
    """One port that never answers; one that answers 200 and notes when each message came."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.silent_connections = 0

    async def silent(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.silent_connections += 1
        try:
            while await reader.read(65536):
                pass
        finally:
            writer.close()

    async def healthy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                    if name.strip().lower() == b"webhook-id":
                        self.arrived.setdefault(value.strip().decode(), time.monotonic())
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def scenario(
    name: str, sender_class: type[WebhookSender], **overrides: Any
) -> tuple[list[float], int]:
    """Latencies (s) of the healthy deliveries attempted within the window, and how many
    were sent."""
    receivers = Receivers()
    silent_server = await asyncio.start_server(receivers.silent, "127.0.0.1", 0)
    healthy_server = await asyncio.start_server(receivers.healthy, "127.0.0.1", 0)
    silent_port = silent_server.sockets[0].getsockname()[1]
    healthy_port = healthy_server.sockets[0].getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        engine = create_engine(url)
        await migrate(engine)
        settings = Settings(
            database_url=url,
            data_dir=Path(tmp),
            egress_allow=["loopback"],
            webhook_concurrency=CONCURRENCY,
            webhook_timeout_seconds=TIMEOUT,
            webhook_poll_seconds=0.2,
            webhook_max_endpoints=SILENT + 1,
            **overrides,
        )
        past = utcnow() - timedelta(minutes=1)
        async with write_connection(engine) as conn:
            rows = [
                _endpoint(f"wh_silent{i:04}", f"http://127.0.0.1:{silent_port}/{i}", None)
                for i in range(SILENT)
            ]
            rows.append(_endpoint("wh_healthy", f"http://localhost:{healthy_port}/hook", past))
            await conn.execute(insert(endpoints), rows)
            await conn.execute(
                insert(deliveries),
                [_delivery(f"wh_silent{i:04}", f"msg_silent_{i}", past) for i in range(SILENT)],
            )
        wake, stopping = asyncio.Event(), asyncio.Event()
        sender = sender_class(engine=engine, settings=settings, wake=wake)
        loop = asyncio.create_task(sender.run(stopping))
        await asyncio.sleep(0.5)  # the silent deliveries are in flight
        due_at: dict[str, float] = {}
        started = time.monotonic()
        i = 0
        while time.monotonic() - started < HEALTHY_FOR:
            message = f"msg_healthy_{i}"
            async with write_connection(engine) as conn:
                await conn.execute(insert(deliveries), [_delivery("wh_healthy", message, utcnow())])
            due_at[message] = time.monotonic()
            wake.set()
            i += 1
            await asyncio.sleep(HEALTHY_EVERY)
        deadline = started + WINDOW
        while len(receivers.arrived) < len(due_at) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        stopping.set()
        await asyncio.wait_for(loop, timeout=10 * TIMEOUT)  # what is in flight ends
        await sender.close()
        await engine.dispose()
    for server in (silent_server, healthy_server):
        server.close()
    latencies = [receivers.arrived[m] - due_at[m] for m in due_at if m in receivers.arrived]
    print(
        f"  {name}: {len(latencies)}/{len(due_at)} healthy deliveries attempted, "
        f"{receivers.silent_connections} silent attempts",
        flush=True,
    )
    return latencies, len(due_at)


def _endpoint(endpoint_id: str, url: str, answered: Any) -> dict[str, Any]:
    now = utcnow()
    return {
        "id": endpoint_id,
        "url": url,
        "host": url.split("//", 1)[1].split(":", 1)[0],
        "description": "",
        "secret": SECRET,
        "secret_version": 1,
        "event_types": ["job.succeeded"],
        "enabled": True,
        "consecutive_timeouts": 0,
        "answered_at": answered,
        "created_at": now,
        "updated_at": now,
    }


def _delivery(endpoint_id: str, message_id: str, due: Any) -> dict[str, Any]:
    return {
        "endpoint_id": endpoint_id,
        "message_id": message_id,
        "event_type": "webhook.test",
        "status": PENDING,
        "attempts": 0,
        "next_attempt_at": due,
        "created_at": due,
    }


def _describe(latencies: list[float], sent: int) -> str:
    if not latencies:
        return f"none of {sent} attempted within {WINDOW:g} s"
    median, worst = statistics.median(latencies), max(latencies)
    missing = sent - len(latencies)
    tail = f", {missing} not within {WINDOW:g} s" if missing else ""
    return f"median {median * 1000:.0f} ms, worst {worst * 1000:.0f} ms{tail}"


async def run() -> None:
    print(f"\nwebhooks_fair: {SILENT} silent endpoints, timeout {TIMEOUT:g} s, {CONCURRENCY} slots")
    baseline = await scenario("baseline (oldest due first)", FifoSender)
    distinct = await scenario(
        "fair, silent on distinct hosts", WebhookSender, webhook_max_in_flight_per_host=1024
    )
    one_host = await scenario("fair, silent on one host", WebhookSender)
    worst = max(distinct[0] + one_host[0], default=float("inf"))
    met = len(distinct[0]) == distinct[1] and len(one_host[0]) == one_host[1] and worst <= GOAL
    estimate = SILENT / CONCURRENCY * TIMEOUT
    report(
        "Webhooks: a healthy endpoint among 1,000 silent ones (attempted after being due)",
        [
            ("baseline", f"{_describe(*baseline)} (about {estimate:.0f} s expected)"),
            ("fair, distinct hosts", _describe(*distinct)),
            ("fair, one host", _describe(*one_host)),
            ("goal", f"every one within {GOAL:g} s: {'met' if met else 'NOT met'}"),
        ],
    )


def main() -> None:
    asyncio.run(run())


if __name__ == "__main__":
    main()
