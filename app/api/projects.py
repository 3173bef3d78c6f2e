"""Projects and their keys (admin keys; a key may read its own project), and the audit
log (admin keys)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from app.api.body import Reading, json_body, read_json
from app.api.deps import Caller, Cursor, JobId, Session, require_admin
from app.db import begin_write
from app.errors import InvalidInputError, not_found
from app.jobs import quotas
from app.schemas.common import NO_NUL, FieldError, Page, problem_responses
from app.schemas.tenants import (
    ApiKey,
    ApiKeyCreate,
    ApiKeyCreated,
    AuditEvent,
    Project,
    ProjectCreate,
    ProjectQuotas,
    Quotas,
)
from app.tenants import Tenants, service

router = APIRouter(prefix="/v1/projects", tags=["projects"], responses=problem_responses(401, 403))
audit_router = APIRouter(
    prefix="/v1/audit-events", tags=["audit"], responses=problem_responses(401, 403)
)
ProjectId = JobId
Limit = Annotated[int, Query(ge=1, le=100)]

CREATING = Reading(ProjectCreate, lambda body, raw, settings: body)
CREATING_KEY = Reading(ApiKeyCreate, lambda body, raw, settings: body)
SETTING_QUOTAS = Reading(Quotas, lambda body, raw, settings: body)


RFC3339 = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})$"
)
TIME: dict[str, Any] = {
    "pattern": RFC3339,
    "max_length": 40,
    "json_schema_extra": {"format": "date-time"},
}


def parse_time(name: str, value: str | None) -> datetime | None:
    """An RFC 3339 time with its offset (the pattern checked its shape); 422 for a date or
    time that does not exist."""
    if value is None:
        return None
    try:
        return datetime.fromisoformat(value.upper())
    except ValueError:
        why = "not a real date and time"
        raise InvalidInputError(
            f"{name}: {why}",
            errors=[FieldError(location="query", path=name, message=why, type="datetime")],
        ) from None


def check_window(
    start: datetime | None, end: datetime | None, names: tuple[str, str] = ("from", "to")
) -> None:
    """422 for a window that holds no time: its start at or after its end."""
    if start is not None and end is not None and start >= end:
        why = f"must be before `{names[1]}`"
        raise InvalidInputError(
            f"{names[0]}: {why}",
            errors=[FieldError(location="query", path=names[0], message=why, type="value_error")],
        )


def _tenants(request: Request) -> Tenants | None:
    tenants: Tenants | None = getattr(request.app.state, "tenants", None)
    return tenants


@router.post(
    "",
    response_model=Project,
    status_code=201,
    summary="Create a project (admin); 409 if its name is taken",
    responses=problem_responses(409, 413, 422),
    openapi_extra=json_body(ProjectCreate),
)
async def create(request: Request, session: Session, caller: Caller, response: Response) -> Project:
    require_admin(caller)
    body = await read_json(request, CREATING)
    project = await service.create_project(session, body.name)
    await session.commit()
    response.headers["Location"] = f"/v1/projects/{project.id}"
    return project


@router.get(
    "",
    name="list",
    response_model=Page[Project],
    summary="List projects, oldest first (admin)",
    responses=problem_responses(422),
)
async def list_all(
    session: Session, caller: Caller, after: Cursor = None, limit: Limit = 20
) -> Page[Project]:
    require_admin(caller)
    items, has_more = await service.list_projects(session, after=after, limit=limit)
    return Page(data=items, has_more=has_more, next_cursor=items[-1].id if has_more else None)


@router.get(
    "/{project_id}",
    response_model=Project,
    summary="Get a project (admin, or a key of this project)",
    responses=problem_responses(404),
)
async def get(project_id: ProjectId, session: Session, caller: Caller) -> Project:
    if not caller.admin and caller.project_id != project_id:
        raise not_found("project", project_id, param="project_id")  # another's: no leak
    return await service.get_project(session, project_id)


@router.get(
    "/{project_id}/quotas",
    name="get_quotas",
    response_model=ProjectQuotas,
    summary="The project's quotas and what it uses of each now (admin, or a key of this project)",
    responses=problem_responses(404),
)
async def get_quotas(project_id: ProjectId, session: Session, caller: Caller) -> ProjectQuotas:
    if not caller.admin and caller.project_id != project_id:
        raise not_found("project", project_id, param="project_id")  # another's: no leak
    return await quotas.get(session, project_id)


@router.put(
    "/{project_id}/quotas",
    name="set_quotas",
    response_model=ProjectQuotas,
    summary="Set the project's quotas (admin): each one given, or no limit. Over "
    "`running_jobs` jobs wait queued; over the others a submission is refused with 429",
    responses=problem_responses(404, 413, 422),
    openapi_extra=json_body(Quotas),
)
async def set_quotas(
    project_id: ProjectId, request: Request, session: Session, caller: Caller
) -> ProjectQuotas:
    require_admin(caller)
    body = await read_json(request, SETTING_QUOTAS)
    await begin_write(session)
    await quotas.put(session, project_id, body)
    await session.commit()
    quotas.forget(session, project_id)  # this process applies them at once
    return await quotas.get(session, project_id)


@router.post(
    "/{project_id}/keys",
    name="create_key",
    response_model=ApiKeyCreated,
    status_code=201,
    summary="Create a key of the project (admin); its secret is in this answer only",
    responses=problem_responses(404, 413, 422),
    openapi_extra=json_body(ApiKeyCreate),
)
async def create_key(
    project_id: ProjectId, request: Request, session: Session, caller: Caller, response: Response
) -> ApiKeyCreated:
    require_admin(caller)
    body = await read_json(request, CREATING_KEY)
    key = await service.create_key(session, project_id, body)
    await session.commit()
    if (tenants := _tenants(request)) is not None:
        tenants.keys.forget()  # this process sees the new key at once
    response.headers["Location"] = f"/v1/projects/{project_id}/keys/{key.id}"
    return key


@router.get(
    "/{project_id}/keys",
    name="list_keys",
    response_model=Page[ApiKey],
    summary="List the project's keys, oldest first (admin); never their secrets",
    responses=problem_responses(404, 422),
)
async def list_keys(
    project_id: ProjectId, session: Session, caller: Caller, after: Cursor = None, limit: Limit = 20
) -> Page[ApiKey]:
    require_admin(caller)
    items, has_more = await service.list_keys(session, project_id, after=after, limit=limit)
    return Page(data=items, has_more=has_more, next_cursor=items[-1].id if has_more else None)


@router.delete(
    "/{project_id}/keys/{key_id}",
    name="revoke_key",
    status_code=204,
    summary="Revoke a key (admin): refused on every replica within "
    "`TRAINYARD_KEY_CACHE_SECONDS`; revoking it again changes nothing",
    responses=problem_responses(404),
)
async def revoke_key(
    project_id: ProjectId, key_id: ProjectId, request: Request, session: Session, caller: Caller
) -> Response:
    require_admin(caller)
    await service.revoke_key(session, project_id, key_id)
    await session.commit()
    if (tenants := _tenants(request)) is not None:
        tenants.keys.forget()
    return Response(status_code=204)


@audit_router.get(
    "",
    name="list",
    response_model=Page[AuditEvent],
    summary="List audit events, newest first (admin): every request that could change "
    "something, with its answer's status; kept `TRAINYARD_AUDIT_RETENTION_SECONDS`",
    responses=problem_responses(422),
)
async def list_audit(
    request: Request,
    session: Session,
    caller: Caller,
    after: Cursor = None,
    limit: Limit = 50,
    key_id: Annotated[str | None, Query(pattern=NO_NUL, max_length=40)] = None,
    project_id: Annotated[str | None, Query(pattern=NO_NUL, max_length=40)] = None,
    route: Annotated[
        str | None,
        Query(pattern=NO_NUL, max_length=256, description="A route template: `/v1/models`."),
    ] = None,
    since: Annotated[str | None, Query(**TIME, description="At or after this time.")] = None,
    until: Annotated[str | None, Query(**TIME, description="Before this time.")] = None,
) -> Page[AuditEvent]:
    require_admin(caller)
    since_at, until_at = parse_time("since", since), parse_time("until", until)
    check_window(since_at, until_at, ("since", "until"))
    if (tenants := _tenants(request)) is not None:
        await tenants.audit.flush()  # every answer sent before this one is in the page
    items, has_more = await service.list_audit(
        session,
        after=after,
        limit=limit,
        key_id=key_id,
        project_id=project_id,
        route=route,
        since=since_at,
        until=until_at,
    )
    return Page(data=items, has_more=has_more, next_cursor=items[-1].id if has_more else None)
