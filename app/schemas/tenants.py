"""Wire types of projects, their keys and the audit log."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

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
