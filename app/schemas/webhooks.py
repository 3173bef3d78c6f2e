"""Wire types of webhook endpoints and their deliveries."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator

from app.schemas.common import NO_NUL, PatchBody
from app.schemas.graders import OutboundUrl

MAX_URL_LENGTH = 2048
"""The longest endpoint URL, as stored (`webhook_endpoints.url`)."""

EventTypeName = Literal[
    "job.succeeded",
    "job.failed",
    "job.cancelled",
    "run.started",
    "run.succeeded",
    "run.failed",
    "run.cancelled",
]
"""`app.jobs.outbox.WebhookEventType`'s values (a test checks they agree)."""


def _url_fits(value: HttpUrl) -> HttpUrl:
    if len(str(value)) > MAX_URL_LENGTH:
        raise ValueError(f"longer than {MAX_URL_LENGTH} characters")
    return value


class WebhookEndpointCreate(BaseModel):
    """A URL to POST signed events to."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "url": "https://hooks.example.com/trainyard",
                    "event_types": ["job.succeeded", "job.failed", "run.succeeded"],
                    "description": "ops alerts",
                }
            ]
        },
    )

    url: OutboundUrl = Field(
        description="Where to POST each event (http or https, no credentials). Subject to the "
        "egress policy (`TRAINYARD_EGRESS_ALLOW`, `TRAINYARD_EGRESS_DENY`) now and at every "
        "send; redirects are not followed."
    )
    event_types: list[EventTypeName] = Field(
        min_length=1, max_length=16, description="The events it receives."
    )
    description: str = Field(default="", max_length=512, pattern=NO_NUL)
    enabled: bool = Field(default=True, description="Disabled: nothing is sent to it.")

    @field_validator("url")
    @classmethod
    def _fits(cls, value: HttpUrl) -> HttpUrl:
        return _url_fits(value)

    @field_validator("event_types")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))


class WebhookEndpointUpdate(PatchBody):
    """What a PATCH may change; a field left out stays as it is (none may be null)."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {"enabled": False},
                {"url": "https://hooks.example.com/v2", "event_types": ["run.failed"]},
            ]
        },
    )

    url: OutboundUrl | None = Field(
        default=None,
        description="A new URL, checked as at registration (the egress policy too). "
        "Deliveries still pending go to it from their next attempt.",
    )
    event_types: list[EventTypeName] | None = Field(
        default=None,
        min_length=1,
        max_length=16,
        description="The events it receives from now on (replacing the list). Deliveries "
        "already queued are still sent.",
    )
    enabled: bool | None = Field(
        default=None, description="Disable it (deliveries wait) or enable it again."
    )
    description: str | None = Field(default=None, max_length=512, pattern=NO_NUL)

    @field_validator("url")
    @classmethod
    def _fits(cls, value: HttpUrl | None) -> HttpUrl | None:
        return None if value is None else _url_fits(value)

    @field_validator("event_types")
    @classmethod
    def _once_each(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else list(dict.fromkeys(value))


class WebhookEndpointHealth(BaseModel):
    """Whether the endpoint answers, as the senders see it: its circuit breaker."""

    breaker: Literal["closed", "open", "half_open"] = Field(
        description="`open`: its last attempts all timed out, and "
        "nothing is sent to it until `breaker_open_until`; `half_open`: that time passed, "
        "and it is tried one delivery at a time until it answers; `closed`: it answers (or "
        "has not failed often enough to be held back)."
    )
    consecutive_timeouts: int = Field(
        description="Attempts in a row that timed out (0 once it answers)."
    )
    breaker_open_until: datetime | None = Field(
        description="While the breaker is open: when it is tried again."
    )
    answered_at: datetime | None = Field(
        description="When it last answered an attempt (any status); null: never."
    )


class WebhookEndpoint(BaseModel):
    """A registered endpoint. Its secret is shown once, when it is created."""

    id: str
    url: str
    description: str
    event_types: list[EventTypeName]
    enabled: bool
    secret_version: int = Field(
        description="1 at registration, one more at each rotation: the answer of a "
        "rotation carries the version of the secret it holds (the highest is current)."
    )
    health: WebhookEndpointHealth
    previous_secret_expires_at: datetime | None = Field(
        description="After a secret rotation: until when deliveries are signed with the "
        "previous secret too; null when only the current one signs them."
    )
    created_at: datetime
    updated_at: datetime


class WebhookEndpointCreated(WebhookEndpoint):
    secret: str = Field(
        description="`whsec_` + base64 of the key that signs every delivery (Standard "
        "Webhooks): shown only in this answer (of the registration or of a rotation)."
    )


class WebhookAttempt(BaseModel):
    attempt: int = Field(description="1 for the first send.")
    started_at: datetime
    duration_ms: int
    status_code: int | None = Field(description="The receiver's answer, if one came.")
    error: str | None = Field(description="Why the attempt failed; null when it succeeded.")


class WebhookDelivery(BaseModel):
    """One message to one endpoint and every attempt to send it."""

    id: int
    message_id: str = Field(description="The `webhook-id` header, the same on every attempt.")
    event_type: str = Field(description="An event type, or `webhook.test`.")
    job_id: str | None = Field(description="The job or run it reports (null: a test).")
    event_seq: int | None = Field(description="The event in that job's log it reports.")
    status: Literal["pending", "succeeded", "failed"] = Field(
        description="`pending` until an attempt succeeds or the retries are spent."
    )
    attempts: list[WebhookAttempt]
    next_attempt_at: datetime | None = Field(description="When it is tried next, if pending.")
    created_at: datetime
    finished_at: datetime | None
