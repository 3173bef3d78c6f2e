"""Wire types shared by every router: the problem envelope and cursor pages."""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")


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
        404: "Not found",
        409: "Conflict with the current state",
        413: "Request body too large",
        422: "Validation failed; `errors` lists each failing field",
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
