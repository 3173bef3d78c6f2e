"""Wire types of projects, their keys and the audit log."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field

Scope = Literal["admin", "write", "read", "sample"]
NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class ProjectCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(
        pattern=NAME,
        max_length=128,
        description="Unique: letters, digits, `.`, `_`, `-`, starting with a letter or digit.",
    )


class Project(BaseModel):
    id: str
    name: str
    created_at: datetime


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=128, pattern=r"^[^\x00]*$")
    scopes: list[Scope] = Field(
        min_length=1,
        max_length=4,
        description="`admin`: everything, every project, keys. `write`: submit, cancel, "
        "register, delete in its project, and read. `read`: GET and HEAD only. `sample`: "
        "the OpenAI gateway (`/openai/v1`) only.",
    )
    expires_at: AwareDatetime | None = Field(
        default=None,
        strict=False,  # JSON has no datetime: an RFC 3339 string
        description="When the key stops working (a time with its offset); none: never.",
        json_schema_extra={"type": "string", "format": "date-time"},
    )


class ApiKey(BaseModel):
    id: str
    project_id: str
    name: str
    scopes: list[Scope]
    prefix: str = Field(description="The secret's first characters, to tell keys apart.")
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None
    created_at: datetime


class ApiKeyCreated(ApiKey):
    secret: str = Field(description="The key's secret: in this answer only, never again.")
    tinker_api_key: str = Field(
        description="The same secret as the Tinker SDK takes it (`tml-` and the secret; the "
        "SDK refuses keys without that prefix): its `TINKER_API_KEY`. In this answer only."
    )


class AuditEvent(BaseModel):
    id: str
    at: datetime
    key_id: str | None = Field(description="None: a key from TRAINYARD_API_KEYS, or none.")
    project_id: str | None
    method: str
    route: str = Field(description="The route's template, e.g. `/v1/models/{name}`.")
    resource_id: str | None
    status: int
    request_id: str


QUOTA_MAX = 1_000_000_000


def _whole(value: object) -> object:
    """JSON has one number type: 5.0 is the integer 5 (as JSON Schema's `integer` says);
    5.5, "5" and true stay what they are, and are refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Whole = Annotated[int | None, BeforeValidator(_whole)]


class Quotas(BaseModel):
    """A project's quotas; a missing or null one: no limit."""

    model_config = ConfigDict(extra="forbid", strict=True)

    running_jobs: Whole = Field(
        default=None,
        ge=0,
        le=QUOTA_MAX,
        description="Jobs holding a worker at once (a run's children count; a run does not). "
        "Over it, jobs wait queued, saying so in `waiting_for`; 0 holds every job.",
    )
    queued_jobs: Whole = Field(
        default=None,
        ge=0,
        le=QUOTA_MAX,
        description="Jobs queued at once, of every kind, a run's children too. A submission "
        "that would pass it is refused with 429.",
    )
    submissions_per_minute: Whole = Field(
        default=None,
        ge=0,
        le=QUOTA_MAX,
        description="Jobs and runs submitted through the API in any 60 seconds (not the jobs "
        "a run or a rollout makes). Over it: 429 with `Retry-After`.",
    )
    trainer_seconds_per_day: Whole = Field(
        default=None,
        ge=0,
        le=QUOTA_MAX,
        description="Seconds training jobs ran (each from its last claim to its end, or to "
        "now, and its earlier attempts' if that claim was today) in the current UTC day. "
        "Once used up, submissions are refused with 429 and "
        "`Retry-After` until midnight UTC; what was queued still runs.",
    )


class QuotaUsage(BaseModel):
    running_jobs: int
    queued_jobs: int
    submissions_last_minute: int
    trainer_seconds_today: float


class ProjectQuotas(BaseModel):
    project_id: str
    quotas: Quotas
    usage: QuotaUsage = Field(description="What the project uses of each, now.")


class UsageRow(BaseModel):
    group: str = Field(
        description="The day (`YYYY-MM-DD`, UTC), model, run id, kind (`training`, "
        "`rollout`, `evaluation`, `gateway`) or key id (`none`: jobs no stored key "
        "submitted, e.g. a run's, and keys of TRAINYARD_API_KEYS); `total` for the sum."
    )
    jobs: int = Field(default=0, description="Jobs counted (each once, with every attempt).")
    gateway_calls: int = Field(default=0, description="Gateway answers whose tokens are known.")
    trainer_seconds: float = Field(default=0.0, description="Training jobs' time.")
    rollout_seconds: float = Field(
        default=0.0, description="Rollout and evaluation jobs' time: sampling and grading."
    )
    prompt_tokens: int = Field(
        default=0,
        description="Prompt tokens sampled: rollout and evaluation jobs (run validations "
        "among them) that ended in the window, and gateway calls.",
    )
    completion_tokens: int = Field(default=0, description="Completion tokens sampled.")
    trained_tokens: int = Field(
        default=0, description="Tokens trained: training jobs that ended in the window."
    )
    checkpoint_bytes: int | None = Field(
        default=None,
        description="group_by=model: the bytes its checkpoints take now (null: another "
        "group_by, or checkpoints this service cannot read).",
    )
    cost: float = Field(default=0.0, description="Estimated from `TRAINYARD_PRICES`.")


class Usage(BaseModel):
    since: datetime = Field(description="`from`: what ran at or after it.")
    until: datetime = Field(description="`to`: and before it.")
    group_by: Literal["day", "model", "run", "kind", "key"]
    currency: str
    data: list[UsageRow]
    total: UsageRow
