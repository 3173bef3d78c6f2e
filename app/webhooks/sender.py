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

from sqlalchemy import Float, and_, bindparam, delete, insert, literal_column, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import is_unavailable, json_dumps, utcnow, write_connection
from app.egress import EgressClient, EgressError, EgressPolicy, Reply
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


@dataclass(frozen=True)
class Result:
    due: Due
    started_at: datetime
    duration_ms: int
    status_code: int | None
    error: str | None

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


class WebhookSender:
    """One per worker process: a loop that sends due deliveries, `concurrency` at once."""

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

    async def run(self, stopping: asyncio.Event) -> None:
        """Send until `stopping` is set; a batch under way is finished first."""
        next_prune = time.monotonic()  # at start, then every PRUNE_EVERY_SECONDS
        while not stopping.is_set():
            self._wake.clear()  # before looking: a wake-up while it looks is kept
            try:
                if time.monotonic() >= next_prune:
                    next_prune = time.monotonic() + PRUNE_EVERY_SECONDS
                    await self.prune(stopping=stopping)
                sent = await self.send_due()
            except Exception as exc:  # keep the loop alive; the next poll tries again
                if is_unavailable(exc):  # the database restarting: expected, and brief
                    log.warning("webhooks: database unavailable (%s); retrying", exc)
                else:
                    log.exception("webhooks: sending failed; retrying")
                sent = 0
            if sent == self.settings.webhook_concurrency:
                continue  # a full batch: more may be due
            stop = asyncio.ensure_future(stopping.wait())
            wake = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait(
                (stop, wake),
                timeout=self.settings.webhook_poll_seconds,
                return_when=asyncio.FIRST_COMPLETED,
            )
            stop.cancel()
            wake.cancel()

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

    async def send_due(self) -> int:
        """Claim a batch of due deliveries, send them at once, record every attempt.
        Returns how many were claimed."""
        token = secrets.token_hex(16)
        batch = await self.claim(token, limit=self.settings.webhook_concurrency)
        if batch:
            results = await asyncio.gather(*(self.send(due) for due in batch))
            await self.record(token, results)
        return len(batch)

    def _now(self) -> Any:
        return database_clock() if self.postgres else bindparam("now")

    def _due(self) -> Any:
        return (
            select(deliveries.c.id)
            .join(endpoints, endpoints.c.id == deliveries.c.endpoint_id)
            .where(
                deliveries.c.status == PENDING,
                deliveries.c.next_attempt_at <= self._now(),
                endpoints.c.enabled,
            )
            .order_by(deliveries.c.next_attempt_at)
        )

    async def claim(self, token: str, *, limit: int) -> list[Due]:
        # A read first: the claim is a write transaction (SQLite: the file's write lock),
        # not worth taking every poll when nothing is due.
        async with self.engine.connect() as conn:
            if (await conn.execute(self._due().limit(1), {"now": utcnow()})).first() is None:
                return []
        now = self._now()
        due = self._due().limit(limit)
        if self.postgres:
            due = due.with_for_update(skip_locked=True, of=deliveries)
            until: Any = now + literal_column("interval '1 second'") * bindparam(
                "lease", type_=Float
            )
        else:
            until = bindparam("until")
        claim = (
            update(deliveries)
            .where(deliveries.c.id.in_(due.scalar_subquery()))
            .values(lease_token=token, next_attempt_at=until)
            .returning(deliveries.c.id)
        )
        moment = utcnow()
        lease = lease_seconds(self.settings)
        params = {"now": moment, "until": moment + timedelta(seconds=lease), "lease": lease}
        async with write_connection(self.engine) as conn:
            ids = list((await conn.execute(claim, params)).scalars())
            if not ids:
                return []
            rows = (await conn.execute(_claimed().where(deliveries.c.id.in_(ids)))).all()
        return [
            Due(row.id, row.message_id, row.url, _signing(row, moment), row.attempts, body_of(row))
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
        except Exception as exc:  # whatever else broke: its kind, never its words
            error = f"request failed: {type(exc).__name__}"
        duration = round((time.monotonic() - clock) * 1000)
        return Result(due, started_at, duration, status, error)

    async def record(self, token: str, results: Sequence[Result]) -> None:
        """Each attempt, and what follows it: done, failed for good, or the next try."""
        schedule = self.settings.webhook_retry_schedule
        now = utcnow()
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
