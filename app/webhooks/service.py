"""What the webhook routes do: register, show, change and remove endpoints, list their
deliveries, queue a test message."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import begin_write, utcnow
from app.egress import EgressPolicy
from app.errors import ConflictError, InvalidInputError, not_found
from app.jobs.outbox import PENDING, TEST_EVENT, subscriptions
from app.models import WebhookAttemptRow, WebhookDeliveryRow, WebhookEndpointRow
from app.schemas.common import FieldError
from app.schemas.webhooks import (
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEndpointCreate,
    WebhookEndpointCreated,
    WebhookEndpointHealth,
    WebhookEndpointUpdate,
)
from app.webhooks.sender import new_secret


def new_endpoint_id() -> str:
    return f"wh_{time.time_ns() // 1000:014x}{secrets.token_hex(5)}"


def check_destination(
    body: WebhookEndpointCreate | WebhookEndpointUpdate, policy: EgressPolicy
) -> None:
    """422 for a URL the egress policy refuses before resolving it (an address literal, a
    denied name); every send is checked again when it is made."""
    if body.url is None:
        return
    refused = policy.refuse_url(str(body.url))
    if refused is not None:
        error = FieldError(
            location="body",
            path="url",
            message=f"refused by the egress policy: {refused}",
            type="egress",
        )
        raise InvalidInputError("1 invalid field(s) in the request", errors=[error])


def host_of(url: str) -> str:
    """The host name the senders cap in-flight deliveries by."""
    return (urlsplit(url).hostname or "").lower()[:255]


def health_of(row: WebhookEndpointRow, now: datetime) -> WebhookEndpointHealth:
    until = row.breaker_open_until
    breaker = "closed" if until is None else "open" if until > now else "half_open"
    return WebhookEndpointHealth(
        breaker=breaker,
        consecutive_timeouts=row.consecutive_timeouts,
        breaker_open_until=until if breaker == "open" else None,
        answered_at=row.answered_at,
    )


def to_wire(row: WebhookEndpointRow) -> WebhookEndpoint:
    now = utcnow()
    expires = row.previous_secret_expires_at
    if expires is not None and expires <= now:  # the previous secret signs no more
        expires = None
    return WebhookEndpoint(
        id=row.id,
        url=row.url,
        description=row.description,
        event_types=row.event_types,
        enabled=row.enabled,
        secret_version=row.secret_version,
        health=health_of(row, now),
        previous_secret_expires_at=expires,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


ENDPOINTS_LOCK = 0x7472_7765  # "trwe": Postgres registrations count the endpoints in turn


async def create_endpoint(
    session: AsyncSession, *, body: WebhookEndpointCreate, max_endpoints: int, project_id: str
) -> WebhookEndpointCreated:
    """An endpoint of `project_id`; 409 once that project has `max_endpoints`: the limit is
    a project's, so one project cannot use up another's, and the count a refusal names is
    its own (registrations are counted one at a time: SQLite's write lock, a Postgres
    advisory lock)."""
    await begin_write(session)
    if session.get_bind().dialect.name == "postgresql":
        await session.execute(select(func.pg_advisory_xact_lock(ENDPOINTS_LOCK)))
    count = await session.scalar(
        select(func.count())
        .select_from(WebhookEndpointRow)
        .where(WebhookEndpointRow.project_id == project_id)
    )
    if (count or 0) >= max_endpoints:
        raise ConflictError(
            f"this project has {count} webhook endpoints, its limit "
            f"(TRAINYARD_WEBHOOK_MAX_ENDPOINTS={max_endpoints}); remove one first",
            limit=max_endpoints,
        )
    now = utcnow()
    row = WebhookEndpointRow(
        id=new_endpoint_id(),
        url=str(body.url),
        host=host_of(str(body.url)),
        secret_version=1,
        consecutive_timeouts=0,
        description=body.description,
        secret=new_secret(),
        event_types=list(body.event_types),
        enabled=body.enabled,
        created_at=now,
        updated_at=now,
        project_id=project_id,
    )
    session.add(row)
    await session.flush()
    await session.execute(
        insert(subscriptions),
        [{"endpoint_id": row.id, "event_type": type_} for type_ in body.event_types],
    )
    return WebhookEndpointCreated(**to_wire(row).model_dump(), secret=row.secret)


async def get_endpoint(
    session: AsyncSession, endpoint_id: str, project_id: str | None
) -> WebhookEndpointRow:
    """The endpoint; with `project_id`, only if it is that project's (another project's is
    a 404 like a missing one)."""
    row = await session.get(WebhookEndpointRow, endpoint_id)
    if row is None or (project_id is not None and row.project_id != project_id):
        raise not_found("webhook endpoint", endpoint_id, param="endpoint_id")
    return row


async def list_endpoints(
    session: AsyncSession, *, after: str | None, limit: int, project_id: str | None
) -> tuple[list[WebhookEndpoint], bool]:
    """Newest first (ids are time-ordered); with `project_id`, only that project's."""
    query = select(WebhookEndpointRow).order_by(WebhookEndpointRow.id.desc()).limit(limit + 1)
    if after:
        query = query.where(WebhookEndpointRow.id < after)
    if project_id is not None:
        query = query.where(WebhookEndpointRow.project_id == project_id)
    rows = (await session.scalars(query)).all()
    return [to_wire(row) for row in rows[:limit]], len(rows) > limit


async def update_endpoint(
    session: AsyncSession, endpoint_id: str, *, body: WebhookEndpointUpdate, project_id: str | None
) -> WebhookEndpoint:
    """Only what the body names changes; an empty body changes nothing (not `updated_at`).
    Pending deliveries read the endpoint's URL and secret when they are sent, so they go
    to a new URL from their next attempt; they were queued for the event types of their
    time and are sent whatever the new list."""
    await begin_write(session)
    row = await get_endpoint(session, endpoint_id, project_id)
    changes = body.model_dump(exclude_none=True)
    if body.url is not None:
        row.url = str(body.url)
        row.host = host_of(row.url)
    if body.event_types is not None:
        row.event_types = list(body.event_types)
        await session.execute(
            delete(subscriptions).where(subscriptions.c.endpoint_id == endpoint_id)
        )
        await session.execute(
            insert(subscriptions),
            [{"endpoint_id": endpoint_id, "event_type": type_} for type_ in body.event_types],
        )
    if body.enabled is not None:
        row.enabled = body.enabled
    if body.description is not None:
        row.description = body.description
    if changes:
        row.updated_at = utcnow()
    await session.flush()
    return to_wire(row)


async def rotate_secret(
    session: AsyncSession,
    endpoint_id: str,
    *,
    grace_seconds: float,
    project_id: str | None,
    expected_version: int | None = None,
) -> WebhookEndpointCreated:
    """A new secret, returned this once with its `secret_version`; the current one
    becomes the previous one and signs deliveries too for `grace_seconds` (none: it stops
    at once). Rotating again within the grace period drops the older previous secret.

    One statement reads and writes the row (Postgres: under its row lock), so concurrent
    rotations are serialised: each gets its own version, the highest is current, and each
    one's previous secret is the one it replaced. With `expected_version` (If-Match) a
    rotation of a secret that is no longer that version is a 409, changing nothing. Another
    project's endpoint (`project_id`) is a 404 before anything is written."""
    await begin_write(session)
    await get_endpoint(session, endpoint_id, project_id)
    now = utcnow()
    keep = grace_seconds > 0
    table = WebhookEndpointRow.__table__
    secret = new_secret()
    rotate = (
        update(WebhookEndpointRow)
        .where(WebhookEndpointRow.id == endpoint_id)
        .values(
            previous_secret=table.c.secret if keep else None,
            previous_secret_expires_at=now + timedelta(seconds=grace_seconds) if keep else None,
            secret=secret,
            secret_version=table.c.secret_version + 1,
            updated_at=now,
        )
        .returning(WebhookEndpointRow.secret_version)
        .execution_options(synchronize_session=False)
    )
    if expected_version is not None:
        rotate = rotate.where(WebhookEndpointRow.secret_version == expected_version)
    version = (await session.execute(rotate)).scalar_one_or_none()
    row = await session.get(WebhookEndpointRow, endpoint_id, populate_existing=True)
    if row is None:
        raise not_found("webhook endpoint", endpoint_id, param="endpoint_id")
    if version is None:
        raise ConflictError(
            f"the endpoint's secret is at version {row.secret_version}, not "
            f"{expected_version} (If-Match): it was rotated meanwhile",
            secret_version=row.secret_version,
        )
    return WebhookEndpointCreated(**to_wire(row).model_dump(), secret=secret)


async def delete_endpoint(session: AsyncSession, endpoint_id: str, project_id: str | None) -> None:
    """With its subscriptions and deliveries (ON DELETE CASCADE)."""
    await begin_write(session)
    await session.delete(await get_endpoint(session, endpoint_id, project_id))
    await session.flush()


async def send_test(
    session: AsyncSession, endpoint_id: str, project_id: str | None
) -> WebhookDelivery:
    """Queue a `webhook.test` message for the endpoint alone; a worker sends it."""
    await begin_write(session)
    await get_endpoint(session, endpoint_id, project_id)
    now = utcnow()
    row = WebhookDeliveryRow(
        endpoint_id=endpoint_id,
        message_id=f"msg_test_{time.time_ns() // 1000:014x}{secrets.token_hex(5)}",
        event_type=TEST_EVENT,
        status=PENDING,
        attempts=0,
        next_attempt_at=now,
        created_at=now,
    )
    session.add(row)
    await session.flush()
    return delivery_to_wire(row, [])


async def list_deliveries(
    session: AsyncSession,
    endpoint_id: str,
    *,
    after: int | None,
    limit: int,
    project_id: str | None,
) -> tuple[list[WebhookDelivery], bool]:
    """The endpoint's deliveries, newest first, each with its attempts."""
    await get_endpoint(session, endpoint_id, project_id)
    query = (
        select(WebhookDeliveryRow)
        .where(WebhookDeliveryRow.endpoint_id == endpoint_id)
        .order_by(WebhookDeliveryRow.id.desc())
        .limit(limit + 1)
    )
    if after is not None:
        query = query.where(WebhookDeliveryRow.id < after)
    rows = (await session.scalars(query)).all()[: limit + 1]
    page = rows[:limit]
    tries = (
        await session.scalars(
            select(WebhookAttemptRow)
            .where(WebhookAttemptRow.delivery_id.in_([row.id for row in page]))
            .order_by(WebhookAttemptRow.delivery_id, WebhookAttemptRow.attempt)
        )
    ).all()
    by_delivery: dict[int, list[WebhookAttemptRow]] = {}
    for attempt in tries:
        by_delivery.setdefault(attempt.delivery_id, []).append(attempt)
    items = [delivery_to_wire(row, by_delivery.get(row.id, [])) for row in page]
    return items, len(rows) > limit


def delivery_to_wire(
    row: WebhookDeliveryRow, tries: Sequence[WebhookAttemptRow]
) -> WebhookDelivery:
    return WebhookDelivery(
        id=row.id,
        message_id=row.message_id,
        event_type=row.event_type,
        job_id=row.job_id,
        event_seq=row.event_seq,
        status=row.status,
        attempts=[WebhookAttempt.model_validate(t, from_attributes=True) for t in tries],
        next_attempt_at=row.next_attempt_at if row.status == PENDING else None,
        created_at=row.created_at,
        finished_at=row.finished_at,
    )
