"""What a project used, and its estimated cost (issue 28 §4)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request

from app.api.deps import Caller, Session
from app.api.projects import TIME, check_window, parse_time
from app.db import utcnow
from app.errors import not_found
from app.schemas.common import NO_NUL, problem_responses
from app.schemas.tenants import Usage
from app.tenants import usage as ledger

router = APIRouter(prefix="/v1/usage", tags=["usage"], responses=problem_responses(401, 403))
DEFAULT_DAYS = 30


@router.get(
    "",
    name="get",
    response_model=Usage,
    summary="What the key's project used (an admin: every project, or `project_id`'s) in "
    "[`from`, `to`): trainer and rollout seconds, tokens sampled and trained, gateway calls, "
    "grouped, with their estimated cost",
    description="A job counts the seconds it ran within the window (from its last claim to "
    "its end, or to now while it runs; its earlier attempts' if that claim is in the "
    "window), on the UTC day it started (or `from`), and its "
    "tokens if it ended in the window; a gateway call counts on the day it was answered, "
    "for the calling key's project. group_by=model adds the bytes each model's checkpoints "
    "take now. `from` defaults to 30 days before `to`, `to` to now (a `from` at or after "
    "`to`: an empty window).",
    responses=problem_responses(404, 422),
)
async def get(
    request: Request,
    session: Session,
    caller: Caller,
    since: Annotated[
        str | None, Query(alias="from", **TIME, description="At or after this time.")
    ] = None,
    until: Annotated[str | None, Query(alias="to", **TIME, description="Before this time.")] = None,
    group_by: Literal["day", "model", "run", "kind", "key"] = "day",
    project_id: Annotated[
        str | None,
        Query(pattern=NO_NUL, max_length=40, description="An admin's choice of project."),
    ] = None,
) -> Usage:
    if project_id is not None and not caller.admin and project_id != caller.owner:
        raise not_found("project", project_id, param="project_id", location="query")
    end = parse_time("to", until) or utcnow()
    start = parse_time("from", since) or end - timedelta(days=DEFAULT_DAYS)
    check_window(start, end)
    scope = project_id if caller.admin else caller.owner
    return await ledger.usage(
        session,
        request.app.state.settings,
        request.app.state.backends,
        since=start,
        until=end,
        group_by=group_by,
        project_id=scope,
    )
