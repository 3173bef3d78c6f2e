"""The routes' work on projects and keys, and reading the audit log."""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import begin_write, utcnow
from app.errors import ConflictError, InvalidInputError, not_found
from app.models import ApiKeyRow, AuditEventRow, ProjectRow
from app.schemas.common import FieldError
from app.schemas.tenants import ApiKey, ApiKeyCreate, ApiKeyCreated, AuditEvent, Project
from app.tenants.keys import PREFIX_SHOWN, TINKER_KEY_PREFIX, new_secret, secret_hash


def _project(row: ProjectRow) -> Project:
    return Project(id=row.id, name=row.name, created_at=row.created_at)


def _key(row: ApiKeyRow) -> ApiKey:
    return ApiKey(
        id=row.id,
        project_id=row.project_id,
        name=row.name,
        scopes=list(row.scopes),
        prefix=row.prefix,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
        last_used_at=row.last_used_at,
        created_at=row.created_at,
    )


async def create_project(session: AsyncSession, name: str) -> Project:
    await begin_write(session)
    if await session.scalar(select(ProjectRow.id).where(ProjectRow.name == name)):
        raise ConflictError(f"name: a project named {name!r} exists")
    row = ProjectRow(id="proj_" + secrets.token_hex(8), name=name, created_at=utcnow())
    session.add(row)
    try:
        await session.flush()
    except IntegrityError:  # made meanwhile by another request
        await session.rollback()
        raise ConflictError(f"name: a project named {name!r} exists") from None
    return _project(row)


async def list_projects(
    session: AsyncSession, *, after: str | None, limit: int, only: str | None = None
) -> tuple[list[Project], bool]:
    query = select(ProjectRow).order_by(ProjectRow.id).limit(limit + 1)
    if after is not None:
        query = query.where(ProjectRow.id > after)
    if only is not None:
        query = query.where(ProjectRow.id == only)
    rows = list((await session.scalars(query)).all())
    return [_project(row) for row in rows[:limit]], len(rows) > limit


async def get_project(session: AsyncSession, project_id: str) -> Project:
    row = await session.get(ProjectRow, project_id)
    if row is None:
        raise not_found("project", project_id, param="project_id")
    return _project(row)


async def create_key(session: AsyncSession, project_id: str, body: ApiKeyCreate) -> ApiKeyCreated:
    await begin_write(session)
    await get_project(session, project_id)
    now = utcnow()
    if body.expires_at is not None and body.expires_at <= now:
        raise _invalid("expires_at", "must be in the future")
    secret = new_secret()
    row = ApiKeyRow(
        id="key_" + secrets.token_hex(8),
        project_id=project_id,
        name=body.name,
        scopes=sorted(set(body.scopes)),
        secret_sha256=secret_hash(secret),
        prefix=secret[:PREFIX_SHOWN],
        expires_at=body.expires_at,
        created_at=now,
    )
    session.add(row)
    await session.flush()
    return ApiKeyCreated(
        **_key(row).model_dump(), secret=secret, tinker_api_key=TINKER_KEY_PREFIX + secret
    )


async def list_keys(
    session: AsyncSession, project_id: str, *, after: str | None, limit: int
) -> tuple[list[ApiKey], bool]:
    await get_project(session, project_id)
    query = (
        select(ApiKeyRow)
        .where(ApiKeyRow.project_id == project_id)
        .order_by(ApiKeyRow.id)
        .limit(limit + 1)
    )
    if after is not None:
        query = query.where(ApiKeyRow.id > after)
    rows = list((await session.scalars(query)).all())
    return [_key(row) for row in rows[:limit]], len(rows) > limit


async def revoke_key(session: AsyncSession, project_id: str, key_id: str) -> None:
    """Revoke the key (a key revoked already stays as it was: repeating is harmless)."""
    await begin_write(session)
    row = await session.get(ApiKeyRow, key_id)
    if row is None or row.project_id != project_id:
        raise not_found("key", key_id, param="key_id", detail=f"no key {key_id!r} in this project")
    if row.revoked_at is None:
        await session.execute(
            update(ApiKeyRow).where(ApiKeyRow.id == key_id).values(revoked_at=utcnow())
        )


def _invalid(field: str, why: str) -> Exception:
    return InvalidInputError(
        f"{field}: {why}",
        errors=[FieldError(location="body", path=field, message=why, type="value_error")],
    )


async def list_audit(
    session: AsyncSession,
    *,
    after: str | None,
    limit: int,
    key_id: str | None = None,
    project_id: str | None = None,
    route: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> tuple[list[AuditEvent], bool]:
    """Newest first; `after` is the id of the last event of the previous page."""
    query = select(AuditEventRow).order_by(AuditEventRow.id.desc()).limit(limit + 1)
    filters: list[Any] = []
    if after is not None:
        filters.append(AuditEventRow.id < after)
    if key_id is not None:
        filters.append(AuditEventRow.key_id == key_id)
    if project_id is not None:
        filters.append(AuditEventRow.project_id == project_id)
    if route is not None:
        filters.append(AuditEventRow.route == route)
    if since is not None:
        filters.append(AuditEventRow.at >= since)
    if until is not None:
        filters.append(AuditEventRow.at < until)
    rows = list((await session.scalars(query.where(*filters))).all())
    events = [
        AuditEvent(
            id=row.id,
            at=row.at,
            key_id=row.key_id,
            project_id=row.project_id,
            method=row.method,
            route=row.route,
            resource_id=row.resource_id,
            status=row.status,
            request_id=row.request_id,
        )
        for row in rows[:limit]
    ]
    return events, len(rows) > limit
