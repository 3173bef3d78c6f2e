"""The outbox: which state changes are webhook events, and the rows that deliver them.

A delivery row is written by the statement or transaction that changes the job's state,
so a state change and its deliveries commit together or not at all, and a write repeated
after it committed (its lease token is gone) writes neither again. Every state change
appends a job event; `app.jobs.events.add_events` fans each event that is a webhook
event out to the endpoints of the job's project subscribed to it (`fan_out`: an
endpoint never hears of another project's jobs), and on Postgres the one-statement
final write does the same in a CTE (`app.jobs.statements.write_in_one`). The message id is
the event's: `msg_<job id>_<seq>`; a unique key on (endpoint, message) holds it once.

Pure apart from the statements: no I/O here.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from typing import Any, cast

from sqlalchemy import (
    Insert,
    Integer,
    String,
    Table,
    and_,
    bindparam,
    case,
    insert,
    literal,
    select,
)

from app.db import UTCDateTime
from app.jobs.lifecycle import EventType, JobKind
from app.models import (
    JobRow,
    WebhookAttemptRow,
    WebhookDeliveryRow,
    WebhookEndpointRow,
    WebhookSubscriptionRow,
)

endpoints = cast(Table, WebhookEndpointRow.__table__)
subscriptions = cast(Table, WebhookSubscriptionRow.__table__)
deliveries = cast(Table, WebhookDeliveryRow.__table__)
attempts = cast(Table, WebhookAttemptRow.__table__)
jobs = cast(Table, JobRow.__table__)

PENDING, SUCCEEDED, FAILED = "pending", "succeeded", "failed"


class WebhookEventType(enum.StrEnum):
    """What an endpoint may subscribe to: a job (training or rollout) or a run ending,
    and a run starting. A run's child jobs are jobs too."""

    job_succeeded = "job.succeeded"
    job_failed = "job.failed"
    job_cancelled = "job.cancelled"
    run_started = "run.started"
    run_succeeded = "run.succeeded"
    run_failed = "run.failed"
    run_cancelled = "run.cancelled"


TEST_EVENT = "webhook.test"
"""The type of the message `POST /v1/webhooks/{id}/test` sends (to that endpoint only)."""

# Job event -> (the webhook event of a job, of a run). `job_cancelled` ends both.
_OUTBOX: Mapping[EventType, tuple[WebhookEventType | None, WebhookEventType | None]] = {
    EventType.training_ended: (WebhookEventType.job_succeeded, None),
    EventType.rollout_ended: (WebhookEventType.job_succeeded, None),
    EventType.evaluation_ended: (WebhookEventType.job_succeeded, None),
    EventType.training_failed: (WebhookEventType.job_failed, None),
    EventType.rollout_failed: (WebhookEventType.job_failed, None),
    EventType.evaluation_failed: (WebhookEventType.job_failed, None),
    EventType.job_cancelled: (WebhookEventType.job_cancelled, WebhookEventType.run_cancelled),
    EventType.run_started: (None, WebhookEventType.run_started),
    EventType.run_ended: (None, WebhookEventType.run_succeeded),
    EventType.run_failed: (None, WebhookEventType.run_failed),
}

STATUS_OF = {
    WebhookEventType.job_succeeded: "succeeded",
    WebhookEventType.job_failed: "failed",
    WebhookEventType.job_cancelled: "cancelled",
    WebhookEventType.run_started: "running",
    WebhookEventType.run_succeeded: "succeeded",
    WebhookEventType.run_failed: "failed",
    WebhookEventType.run_cancelled: "cancelled",
}
"""The status a job or run has once the event happened (the body says it)."""


def reported(event: EventType) -> tuple[str | None, str | None] | None:
    """The webhook event types `event` is for a job and for a run; None: not reported."""
    pair = _OUTBOX.get(event)
    if pair is None:
        return None
    job, run = pair
    return (job.value if job else None, run.value if run else None)


def webhook_type(event: EventType, kind: JobKind) -> str | None:
    """The webhook event type of `event` in a job of `kind`, if it is one."""
    pair = reported(event)
    if pair is None:
        return None
    return pair[1] if kind is JobKind.run else pair[0]


def message_id(job_id: str, seq: int) -> str:
    return f"msg_{job_id}_{seq}"


COLUMNS = [
    "endpoint_id",
    "message_id",
    "event_type",
    "job_id",
    "event_seq",
    "status",
    "attempts",
    "next_attempt_at",
    "created_at",
]


@functools.cache
def fan_out() -> Insert:
    """One delivery per enabled endpoint of the job's project subscribed to the event
    `w_seq` of job `w_job_id`, whose webhook type is `w_job` for a job and `w_run` for a run
    (NULL: none)."""
    now = bindparam("w_now", type_=UTCDateTime())
    kind_type = case(
        (jobs.c.kind == JobKind.run.value, bindparam("w_run", type_=String)),
        else_=bindparam("w_job", type_=String),
    )
    rows = (
        select(
            subscriptions.c.endpoint_id,
            bindparam("w_message", type_=String),
            subscriptions.c.event_type,
            jobs.c.id,
            bindparam("w_seq", type_=Integer),
            literal(PENDING, String),
            literal(0, Integer),
            now,
            now,
        )
        .select_from(
            jobs.join(subscriptions, subscriptions.c.event_type == kind_type).join(
                endpoints,
                and_(
                    endpoints.c.id == subscriptions.c.endpoint_id,
                    endpoints.c.enabled,
                    endpoints.c.project_id == jobs.c.project_id,
                ),
            )
        )
        .where(jobs.c.id == bindparam("w_job_id"))
    )
    return insert(deliveries).from_select(COLUMNS, rows)


def fan_out_params(
    job_id: str, seq: int, pair: tuple[str | None, str | None], now: Any
) -> dict[str, Any]:
    return {
        "w_job_id": job_id,
        "w_seq": seq,
        "w_message": message_id(job_id, seq),
        "w_job": pair[0],
        "w_run": pair[1],
        "w_now": now,
    }
