"""The workers' webhook sender: claim due deliveries with a lease, send each signed
(Standard Webhooks), record the attempt, and schedule the next one or end the delivery.

A claim sets a `lease_token` and moves `next_attempt_at` past the lease, in one statement
(`FOR UPDATE SKIP LOCKED` on Postgres, so senders in many workers never take one row
twice); a sender that dies mid-send leaves the row to be claimed again once the lease
passes. Sending holds no session; the result is written guarded by the token, and a
sender whose lease was taken over writes nothing. Sends go through `app.egress` (its
policy, one total deadline, a capped answer, no redirects). Nothing here touches a job:
a delivery never blocks or fails one.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, delete, func, insert, not_, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import is_unavailable, json_dumps, utcnow, write_connection
from app.egress import EgressClient, EgressError, EgressPolicy, EgressTimeout, Reply
from app.jobs.events import database_clock, job_events
from app.jobs.outbox import (
    FAILED,
    PENDING,
    STATUS_OF,
    SUCCEEDED,
    WebhookEventType,
    attempts,
    deliveries,
    endpoints,
    jobs,
)
from app.settings import Settings

log = logging.getLogger(__name__)
MAX_RESPONSE_BYTES = 64 * 1024
"""A receiver's answer is read up to this size (its body is never stored); more fails."""
SECRET_PREFIX = "whsec_"
PRUNE_EVERY_SECONDS = 600.0
"""How often a sender deletes the deliveries past `TRAINYARD_WEBHOOK_RETENTION_SECONDS`."""
PRUNE_BATCH = 500
"""Deliveries deleted per transaction: the write lock is held briefly, never for a backlog."""


def new_secret() -> str:
    """A signing secret as Standard Webhooks writes one: `whsec_` + base64 of 32 bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header: `v1,` + base64 HMAC-SHA256 of
    `{id}.{timestamp}.{body}`, keyed with the secret's base64-decoded bytes."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def signatures(secrets_: Sequence[str], message_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header for several secrets: their signatures separated by
    spaces (Standard Webhooks), the current secret's first. A receiver holding any of
    them accepts the delivery."""
    return " ".join(sign(secret, message_id, timestamp, body) for secret in secrets_)


def lease_seconds(settings: Settings) -> float:
    """How long a claimed delivery stays leased: two full attempts and a margin."""
    return 2 * settings.webhook_timeout_seconds + 5


@dataclass(frozen=True)
class Due:
    """A claimed delivery, with what sending it needs."""

    id: int
    message_id: str
    url: str
    secrets: tuple[str, ...]
    """The current secret, then the previous one while its grace period lasts."""
    attempts: int
    body: bytes
    endpoint_id: str = ""
    proven: bool = True
    """Its endpoint answered its last attempt (the slots for those it was taken from)."""


@dataclass(frozen=True)
class Result:
    due: Due
    started_at: datetime
    duration_ms: int
    status_code: int | None
    error: str | None
    timed_out: bool = False
    """No whole answer within `webhook_timeout_seconds`: what the circuit breaker counts
    (a refused connection is cheap, and is not counted; an answer resets the count)."""

    @property
    def ok(self) -> bool:
        return self.error is None


def _timestamp(value: datetime) -> str:
    return value.isoformat().replace("+00:00", "Z")


def body_of(row: Any) -> bytes:
    """The message: `{type, timestamp, data}`. For a job event `data` is the job (id,
    kind, model, status once the event happened) and the event as its log holds it."""
    if row.job_id is None:
        data: dict[str, Any] = {"endpoint_id": row.endpoint_id}
        at = row.created_at
    else:
        data = {
            "id": row.job_id,
            "kind": row.kind,
            "model": row.model_name,
            "status": STATUS_OF[WebhookEventType(row.event_type)],
            "event": {"seq": row.event_seq, "type": row.type, "data": row.data},
        }
        at = row.event_created_at
    return json_dumps({"type": row.event_type, "timestamp": _timestamp(at), "data": data}).encode()


CLAIM_LOCK = 0x7472_7768  # "trwh": Postgres senders take their claims one at a time
SCAN_ENDPOINTS = 512
"""Endpoints with due deliveries one claim looks at per lane (known to answer, or not),
longest waiting first; full ones are not looked at."""


class WebhookSender:
    """One per worker process: a loop that keeps up to `concurrency` deliveries in
    flight, claiming more as each ends.

    Fair by endpoint: each claim serves the endpoints that waited longest since their last
    claim (round-robin, `last_claimed_at`), at most `webhook_max_in_flight_per_endpoint`
    deliveries of one endpoint and `webhook_max_in_flight_per_host` of one host in flight
    across all workers. Endpoints not known to answer (never answered yet, or their last
    attempt timed out) take at most `webhook_unproven_share` of a worker's slots, so an
    endpoint that answers always finds one free. An endpoint whose last
    `webhook_breaker_threshold` attempts all timed out is skipped for
    `webhook_breaker_seconds` (its breaker is open), then tried with one delivery at a
    time (half open) until it answers."""

    def __init__(self, *, engine: AsyncEngine, settings: Settings, wake: asyncio.Event) -> None:
        self.engine = engine
        self.settings = settings
        self.postgres = engine.dialect.name == "postgresql"
        self.client = EgressClient(
            EgressPolicy.from_settings(settings), max_connections=settings.webhook_concurrency
        )
        # Set when something may be due now (a job ended here, a test message was asked
        # for: `Notifier.webhooks_due`); polling covers the rest.
        self._wake = wake
        # The deliveries this sender has in flight: task -> sent to an unproven endpoint.
        self._flying: dict[asyncio.Task[None], bool] = {}

    @property
    def unproven_slots(self) -> int:
        """How many of this sender's slots endpoints not known to answer may hold."""
        share = self.settings.webhook_unproven_share
        return max(1, int(self.settings.webhook_concurrency * share))

    async def run(self, stopping: asyncio.Event) -> None:
        """Send until `stopping` is set; the deliveries in flight are finished first."""
        next_prune = time.monotonic()  # at start, then every PRUNE_EVERY_SECONDS
        try:
            while not stopping.is_set():
                self._wake.clear()  # before looking: a wake-up while it looks is kept
                try:
                    if time.monotonic() >= next_prune:
                        next_prune = time.monotonic() + PRUNE_EVERY_SECONDS
                        await self.prune(stopping=stopping)
                    await self.fill()
                except Exception as exc:  # keep the loop alive; the next poll tries again
                    if is_unavailable(exc):  # the database restarting: expected, and brief
                        log.warning("webhooks: database unavailable (%s); retrying", exc)
                    else:
                        log.exception("webhooks: sending failed; retrying")
                stop = asyncio.ensure_future(stopping.wait())
                wake = asyncio.ensure_future(self._wake.wait())
                # A delivery ending frees a slot: look again at once.
                await asyncio.wait(
                    (stop, wake, *self._flying),
                    timeout=self.settings.webhook_poll_seconds,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                stop.cancel()
                wake.cancel()
        finally:
            if self._flying:
                await asyncio.gather(*self._flying, return_exceptions=True)

    async def fill(self) -> int:
        """Claim deliveries for the free slots and start sending them; returns how many."""
        free = self.settings.webhook_concurrency - len(self._flying)
        unproven_free = self.unproven_slots - sum(self._flying.values())
        if free <= 0:
            return 0
        token = secrets.token_hex(16)
        batch = await self.claim(token, limit=free, unproven_limit=max(0, unproven_free))
        for due in batch:
            task = asyncio.create_task(self._deliver(token, due))
            self._flying[task] = not due.proven
            task.add_done_callback(self._flying.pop)
        return len(batch)

    async def _deliver(self, token: str, due: Due) -> None:
        result = await self.send(due)
        for attempt in range(3):  # the database restarting: the lease outlasts a retry
            try:
                await self.record(token, [result])
                return
            except Exception as exc:
                if attempt == 2 or not is_unavailable(exc):
                    log.exception("webhook delivery %s: recording failed", due.id)
                    return
                await asyncio.sleep(1.0)

    async def prune(
        self, *, batch: int = PRUNE_BATCH, stopping: asyncio.Event | None = None
    ) -> int:
        """Delete the deliveries that ended (succeeded or failed) longer ago than the
        retention setting, with their attempts, oldest first, `batch` per transaction.
        Pending ones are never touched. Senders in other workers may prune at the same
        time: a row already gone is simply not deleted twice. Returns how many went."""
        cutoff = utcnow() - timedelta(seconds=self.settings.webhook_retention_seconds)
        old = (
            select(deliveries.c.id)
            .where(
                deliveries.c.finished_at.is_not(None),
                deliveries.c.finished_at < cutoff,
                deliveries.c.status.in_((SUCCEEDED, FAILED)),
            )
            .order_by(deliveries.c.finished_at)
            .limit(batch)
        )
        removed = 0
        while True:
            async with write_connection(self.engine) as conn:
                ids = list((await conn.execute(old)).scalars())
                if ids:
                    await conn.execute(delete(attempts).where(attempts.c.delivery_id.in_(ids)))
                    await conn.execute(delete(deliveries).where(deliveries.c.id.in_(ids)))
            removed += len(ids)
            if len(ids) < batch or (stopping is not None and stopping.is_set()):
                if removed:
                    log.info("webhooks: deleted %d deliveries past retention", removed)
                return removed
            await asyncio.sleep(0)  # between batches, others may write

    async def close(self) -> None:
        await self.client.aclose()

    async def send_due(self, *, now: datetime | None = None) -> int:
        """Claim what the slots allow, send it all, record every attempt; returns how many
        were claimed (tests: one round without the loop)."""
        token = secrets.token_hex(16)
        batch = await self.claim(
            token,
            limit=self.settings.webhook_concurrency,
            unproven_limit=self.unproven_slots,
            now=now,
        )
        if batch:
            results = await asyncio.gather(*(self.send(due) for due in batch))
            await self.record(token, results, now=now)
        return len(batch)

    async def _moment(self, conn: Any) -> datetime:
        if self.postgres:  # every worker by one clock: the database's
            return (await conn.execute(select(database_clock()))).scalar_one()  # type: ignore[no-any-return]
        return utcnow()

    async def claim(
        self, token: str, *, limit: int, unproven_limit: int, now: datetime | None = None
    ) -> list[Due]:
        """Lease up to `limit` due deliveries (at most `unproven_limit` of endpoints not
        known to answer), fairly: see the class. On Postgres the claims of all senders take
        one advisory lock in turn (a claim is a few short statements), so the in-flight
        counts the caps read are never raced."""
        if limit <= 0:
            return []
        settings = self.settings
        # A read first: the claim is a write transaction (SQLite: the file's write lock),
        # not worth taking every poll when nothing is due.
        async with self.engine.connect() as conn:
            moment = now or await self._moment(conn)
            if (await conn.execute(_due(moment).limit(1))).first() is None:
                return []
        async with write_connection(self.engine) as conn:
            if self.postgres:
                await conn.execute(select(func.pg_advisory_xact_lock(CLAIM_LOCK)))
            moment = now or await self._moment(conn)
            per_endpoint = settings.webhook_max_in_flight_per_endpoint
            per_host = settings.webhook_max_in_flight_per_host
            by_endpoint: dict[str, int] = {}
            by_host: dict[str, int] = {}
            for endpoint_id, host, n in (await conn.execute(_in_flight(moment))).all():
                by_endpoint[endpoint_id] = n
                by_host[host] = by_host.get(host, 0) + n
            # Full endpoints and hosts are left out of the scan, and each lane is scanned
            # apart: a thousand endpoints waiting on a full host, or never answering,
            # never hide one that answers.
            full_endpoints = [e for e, n in by_endpoint.items() if n >= per_endpoint]
            full_hosts = [h for h, n in by_host.items() if n >= per_host]
            waiting = [
                *(await conn.execute(_waiting(moment, full_endpoints, full_hosts, known=True))),
                *(await conn.execute(_waiting(moment, full_endpoints, full_hosts, known=False))),
            ]
            take: dict[str, int] = {}
            proven: dict[str, bool] = {}
            taken = unproven_taken = 0
            for _ in range(per_endpoint):  # a round each
                for row in waiting:
                    if taken >= limit:
                        break
                    known = row.consecutive_timeouts == 0 and row.answered_at is not None
                    # Not answering lately (half open too): one delivery at a time.
                    cap = per_endpoint if known else 1
                    mine = take.get(row.id, 0)
                    if (
                        mine >= row.due
                        or by_endpoint.get(row.id, 0) + mine >= cap
                        or by_host.get(row.host, 0) >= per_host
                        or (not known and unproven_taken >= unproven_limit)
                    ):
                        continue
                    take[row.id] = mine + 1
                    proven[row.id] = known
                    by_host[row.host] = by_host.get(row.host, 0) + 1
                    taken += 1
                    unproven_taken += 0 if known else 1
            if not take:
                return []
            ids = [
                row.id
                for row in (await conn.execute(_oldest(moment, take))).all()
                if row.rank <= take[row.endpoint_id]
            ]
            lease = lease_seconds(settings)
            leased = (
                update(deliveries)
                .where(deliveries.c.id.in_(ids), deliveries.c.status == PENDING)
                .values(lease_token=token, next_attempt_at=moment + timedelta(seconds=lease))
                .returning(deliveries.c.id)
            )
            ids = list((await conn.execute(leased)).scalars())
            await conn.execute(
                update(endpoints)
                .where(endpoints.c.id.in_(list(take)))
                .values(last_claimed_at=moment)
            )
            rows = (await conn.execute(_claimed().where(deliveries.c.id.in_(ids)))).all()
        return [
            Due(
                row.id,
                row.message_id,
                row.url,
                _signing(row, moment),
                row.attempts,
                body_of(row),
                endpoint_id=row.endpoint_id,
                proven=proven[row.endpoint_id],
            )
            for row in rows
        ]

    async def send(self, due: Due) -> Result:
        started_at, clock = utcnow(), time.monotonic()
        timestamp = int(time.time())
        headers = {
            "webhook-id": due.message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signatures(due.secrets, due.message_id, timestamp, due.body),
        }
        status: int | None = None
        error: str | None = None
        timed_out = False
        try:
            reply: Reply = await self.client.post_json(
                due.url,
                due.body,
                headers=headers,
                timeout_s=self.settings.webhook_timeout_seconds,
                max_bytes=MAX_RESPONSE_BYTES,
            )
            status = reply.status
            if not reply.ok:
                error = reply.describe()
        except EgressError as exc:
            error = str(exc)
            timed_out = isinstance(exc, EgressTimeout)
        except Exception as exc:  # whatever else broke: its kind, never its words
            error = f"request failed: {type(exc).__name__}"
        duration = round((time.monotonic() - clock) * 1000)
        return Result(due, started_at, duration, status, error, timed_out)

    async def record(
        self, token: str, results: Sequence[Result], *, now: datetime | None = None
    ) -> None:
        """Each attempt, and what follows it: done, failed for good, or the next try; and
        the endpoint's health (it answered; or one more attempt timed out: the breaker)."""
        settings = self.settings
        schedule = settings.webhook_retry_schedule
        now = now or utcnow()
        reopen = now + timedelta(seconds=settings.webhook_breaker_seconds)
        async with write_connection(self.engine) as conn:
            for result in results:
                attempt = result.due.attempts + 1
                values: dict[str, Any] = {
                    "attempts": attempt,
                    "lease_token": None,
                    "last_status_code": result.status_code,
                    "last_error": result.error,
                }
                if result.ok:
                    values |= {"status": SUCCEEDED, "finished_at": now}
                elif attempt > len(schedule):
                    values |= {"status": FAILED, "finished_at": now}
                else:
                    values["next_attempt_at"] = now + timedelta(seconds=schedule[attempt - 1])
                moved = await conn.execute(
                    update(deliveries)
                    .where(
                        and_(
                            deliveries.c.id == result.due.id,
                            deliveries.c.lease_token == token,
                            deliveries.c.status == PENDING,
                        )
                    )
                    .values(values)
                )
                if moved.rowcount != 1:
                    log.warning("webhook delivery %s: lease lost, not recorded", result.due.id)
                    continue
                await conn.execute(
                    insert(attempts).values(
                        delivery_id=result.due.id,
                        attempt=attempt,
                        started_at=result.started_at,
                        duration_ms=result.duration_ms,
                        status_code=result.status_code,
                        error=result.error,
                    )
                )
                health: dict[str, Any]
                if result.status_code is not None:  # it answered (whatever it said)
                    health = {
                        "consecutive_timeouts": 0,
                        "answered_at": now,
                        "breaker_open_until": None,
                    }
                elif result.timed_out:
                    timeouts = endpoints.c.consecutive_timeouts + 1
                    health = {
                        "consecutive_timeouts": timeouts,
                        "breaker_open_until": case(
                            (timeouts >= settings.webhook_breaker_threshold, reopen),
                            else_=endpoints.c.breaker_open_until,
                        ),
                    }
                else:  # refused, not resolved: quick, and says nothing of its answers
                    continue
                await conn.execute(
                    update(endpoints).where(endpoints.c.id == result.due.endpoint_id).values(health)
                )


def _due(now: datetime) -> Any:
    """Due deliveries of enabled endpoints whose breaker is not open."""
    return (
        select(deliveries.c.id)
        .join(endpoints, endpoints.c.id == deliveries.c.endpoint_id)
        .where(
            deliveries.c.status == PENDING,
            deliveries.c.next_attempt_at <= now,
            endpoints.c.enabled,
            or_(endpoints.c.breaker_open_until.is_(None), endpoints.c.breaker_open_until <= now),
        )
    )


def _in_flight(now: datetime) -> Any:
    """Deliveries leased and not past their lease, by endpoint (with its host)."""
    return (
        select(deliveries.c.endpoint_id, endpoints.c.host, func.count())
        .join(endpoints, endpoints.c.id == deliveries.c.endpoint_id)
        .where(
            deliveries.c.status == PENDING,
            deliveries.c.lease_token.is_not(None),
            deliveries.c.next_attempt_at > now,
        )
        .group_by(deliveries.c.endpoint_id, endpoints.c.host)
    )


def _waiting(
    now: datetime, full_endpoints: list[str], full_hosts: list[str], *, known: bool
) -> Any:
    """The endpoints with due deliveries (how many), the one claimed longest ago first:
    those known to answer (`known`: answered, and their last attempt did not time out) or
    the others; none that is full or on a full host."""
    answers = and_(endpoints.c.consecutive_timeouts == 0, endpoints.c.answered_at.is_not(None))
    query = (
        select(
            endpoints.c.id,
            endpoints.c.host,
            endpoints.c.consecutive_timeouts,
            endpoints.c.answered_at,
            func.count(deliveries.c.id).label("due"),
        )
        .join(deliveries, deliveries.c.endpoint_id == endpoints.c.id)
        .where(
            deliveries.c.status == PENDING,
            deliveries.c.next_attempt_at <= now,
            endpoints.c.enabled,
            or_(endpoints.c.breaker_open_until.is_(None), endpoints.c.breaker_open_until <= now),
            answers if known else not_(answers),
        )
        .group_by(
            endpoints.c.id,
            endpoints.c.host,
            endpoints.c.consecutive_timeouts,
            endpoints.c.answered_at,
            endpoints.c.last_claimed_at,
        )
        .order_by(endpoints.c.last_claimed_at.asc().nulls_first(), endpoints.c.id)
        .limit(SCAN_ENDPOINTS)
    )
    if full_endpoints:
        query = query.where(endpoints.c.id.not_in(full_endpoints))
    if full_hosts:
        query = query.where(endpoints.c.host.not_in(full_hosts))
    return query


def _oldest(now: datetime, take: dict[str, int]) -> Any:
    """Each chosen endpoint's due deliveries ranked oldest first (the caller keeps as many
    as it took)."""
    rank = (
        func.row_number()
        .over(
            partition_by=deliveries.c.endpoint_id,
            order_by=(deliveries.c.next_attempt_at, deliveries.c.id),
        )
        .label("rank")
    )
    ranked = (
        select(deliveries.c.id, deliveries.c.endpoint_id, rank)
        .where(
            deliveries.c.endpoint_id.in_(list(take)),
            deliveries.c.status == PENDING,
            deliveries.c.next_attempt_at <= now,
        )
        .subquery()
    )
    return select(ranked.c.id, ranked.c.endpoint_id, ranked.c.rank).where(
        ranked.c.rank <= max(take.values())
    )


def _signing(row: Any, now: datetime) -> tuple[str, ...]:
    """The secrets that sign a delivery now: the endpoint's, and its previous one until
    that expires."""
    expires = row.previous_secret_expires_at
    if row.previous_secret is not None and expires is not None and expires > now:
        return (row.secret, row.previous_secret)
    return (row.secret,)


def _claimed() -> Any:
    """What sending a claimed delivery needs: its endpoint, and its job and event."""
    return (
        select(
            deliveries.c.id,
            deliveries.c.endpoint_id,
            deliveries.c.message_id,
            deliveries.c.event_type,
            deliveries.c.job_id,
            deliveries.c.event_seq,
            deliveries.c.attempts,
            deliveries.c.created_at,
            endpoints.c.url,
            endpoints.c.secret,
            endpoints.c.previous_secret,
            endpoints.c.previous_secret_expires_at,
            jobs.c.kind,
            jobs.c.model_name,
            job_events.c.type,
            job_events.c.data,
            job_events.c.created_at.label("event_created_at"),
        )
        .join(endpoints, endpoints.c.id == deliveries.c.endpoint_id)
        .outerjoin(jobs, jobs.c.id == deliveries.c.job_id)
        .outerjoin(
            job_events,
            and_(
                job_events.c.job_id == deliveries.c.job_id,
                job_events.c.seq == deliveries.c.event_seq,
            ),
        )
    )
