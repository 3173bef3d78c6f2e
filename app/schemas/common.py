"""Wire types shared by every router: the problem envelope and cursor pages."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

T = TypeVar("T")

MAX_JSON_DEPTH = 32
"""How deep free-form JSON in a request may nest (`{"a": {"b": 1}}` is 2 deep)."""

NO_NUL = r"^[^\x00]*$"
"""Pattern of text the service stores or looks up: Postgres text and JSON hold no NUL."""


def plain_json(value: T) -> T:
    """Check free-form JSON the service stores and returns: finite numbers only (Python's
    JSON parser accepts NaN and Infinity; JSON and Postgres do not), no NUL character in a
    string or key (Postgres refuses them), and at most `MAX_JSON_DEPTH` levels of nesting
    (responses cannot serialize much deeper values)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError("numbers must be finite (no NaN or Infinity)")
        if isinstance(item, str) and "\x00" in item:
            raise ValueError("text must not contain NUL characters")
        if isinstance(item, dict) and any("\x00" in key for key in item):
            raise ValueError("keys must not contain NUL characters")
        if isinstance(item, dict | list):
            if depth == MAX_JSON_DEPTH:
                raise ValueError(f"nests deeper than {MAX_JSON_DEPTH} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return value


MAX_JSON_OBJECT_BYTES = 64 * 1024
"""How large free-form labels and settings (`metadata`, `config`, `hyperparameters`) may be,
as JSON: they are stored in a row and returned with it on every page that lists it."""


def small_json(value: T) -> T:
    """`plain_json`, and at most `MAX_JSON_OBJECT_BYTES` of JSON text."""
    plain_json(value)
    # Each node takes at least one character: count them first, so that a large value is
    # refused without encoding it.
    nodes = 0
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        nodes += 1 + (len(item) if isinstance(item, str) else 0)
        if isinstance(item, dict):
            nodes += sum(map(len, item))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        if nodes > MAX_JSON_OBJECT_BYTES:
            break
    if nodes > MAX_JSON_OBJECT_BYTES or len(json.dumps(value)) > MAX_JSON_OBJECT_BYTES:
        raise ValueError(f"larger than {MAX_JSON_OBJECT_BYTES} bytes as JSON")
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(small_json)]
"""A free-form JSON object, checked by `small_json`."""


class PatchBody(BaseModel):
    """The body of a PATCH: a field left out stays as it is. A field whose stored value
    cannot be null may not be sent as null either (a 422 naming it), rather than be read
    as "left out": `{"enabled": null}` is a mistake, not a request to change nothing.
    A PATCH body whose field may really be cleared names it in `NULLABLE`."""

    NULLABLE: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="before")
    @classmethod
    def _not_null(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.field_name not in cls.NULLABLE:
            raise ValueError("may not be null; leave the field out to keep its value")
        return value


class FieldError(BaseModel):
    """One failing input field."""

    location: Literal["body", "query", "path", "header", "cookie"] = Field(
        description="Where the field was sent."
    )
    path: str = Field(
        description="Path of the field inside that location, e.g. "
        "`collection.trajectories[3][1].episode[4].logprobs`; empty for the whole location.",
        examples=["collection.trajectories[0][1].episode[2].logprobs"],
    )
    message: str = Field(description="What is wrong with it.")
    type: str = Field(description="Machine-readable error code.", examples=["missing_logprobs"])


class Problem(BaseModel):
    """RFC 9457 problem details: the body of every error response."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(
        default="about:blank",
        description="URI naming the kind of problem.",
        examples=["about:blank"],
    )
    title: str = Field(description="Short summary of the kind of problem.", examples=["Not Found"])
    status: int = Field(description="The HTTP status code.", examples=[404])
    detail: str | None = Field(default=None, description="What happened, for a person.")
    instance: str | None = Field(default=None, description="The request path that failed.")
    errors: list[FieldError] | None = Field(
        default=None, description="Every failing field (validation problems only)."
    )


class Page(BaseModel, Generic[T]):
    """One page of a list; pass `next_cursor` as `after` to get the next one."""

    data: list[T]
    has_more: bool = Field(description="Whether more items follow this page.")
    next_cursor: str | None = Field(
        default=None, description="Cursor for the next page, when `has_more`."
    )


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries documenting problem+json bodies for these statuses."""
    descriptions = {
        400: "Bad request",
        401: "Missing or invalid API key",
        404: "Not found; `errors` names the path parameter that named what is missing",
        409: "Conflict with the current state",
        413: "Request body too large",
        415: "The body is not sent as `Content-Type: application/json`",
        422: "Validation failed; `errors` lists each failing field",
        429: "A quota of the project refuses it (`quota` names it, `limit` its value); "
        "nothing was stored; retry after `Retry-After` seconds",
        503: "A dependency is unavailable; retry after `Retry-After` seconds",
    }
    return {
        status: {
            "description": descriptions.get(status, "Error"),
            "content": {
                "application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}
            },
        }
        for status in statuses
    }
