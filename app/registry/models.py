"""Trainable models: register, read, list."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app.backends import SPECS
from app.backends.cpu import base_model_refusal
from app.db import begin_write
from app.errors import ConflictError, InvalidInputError, field_errors, not_found
from app.gateway import PREFIX as GATEWAY_PREFIX
from app.gateway import served_names
from app.models import DEFAULT_PROJECT_ID, ModelRow
from app.schemas.models import Model, ModelCreate
from app.settings import DEFAULT_POOL


def to_wire(row: ModelRow) -> Model:
    return Model(
        name=row.name,
        project=row.project,
        base_model=row.base_model,
        backend=row.backend,
        config=row.config,
        current_step=row.current_step,
        pool=row.pool or DEFAULT_POOL,
        labels=row.labels or {},
        # Where the backend serves the model (a loopback port that takes any key) stays
        # inside: the public endpoint is the gateway, behind the API's keys, under the API's
        # URL (`app.api.models` prefixes it); null while no worker serves the model.
        inference_base_url=GATEWAY_PREFIX if row.inference_base_url else None,
        inference_model_name=f"{row.name}@{row.current_step}" if row.inference_base_url else None,
        openai_model_names=served_names(row) if SPECS[row.backend].serves else [],
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def _check_backend(body: ModelCreate, model_roots: Sequence[Path]) -> dict:
    spec = SPECS.get(body.backend)
    if spec is None:
        raise InvalidInputError(
            f"unknown backend {body.backend!r}; known: {', '.join(sorted(SPECS))}",
            errors=field_errors(
                [{"loc": ("backend",), "msg": "unknown backend", "type": "unknown_backend"}]
            ),
        )
    try:
        config = spec.config.model_validate(body.config).model_dump(exclude_unset=True)
    except ValidationError as exc:
        errors = [{**e, "loc": ("config", *e["loc"])} for e in exc.errors()]
        raise InvalidInputError(
            f"invalid config for backend {body.backend!r}", errors=field_errors(errors)
        ) from exc
    if spec.name == "cpu":  # it loads `base_model` from this host's disk
        refusal = base_model_refusal(body.base_model, model_roots)
        if refusal is not None:
            raise InvalidInputError(
                f"base_model {refusal}",
                errors=field_errors(
                    [{"loc": ("base_model",), "msg": refusal, "type": "outside_model_roots"}]
                ),
            )
    return config


async def create_model(
    session: AsyncSession,
    *,
    body: ModelCreate,
    model_roots: Sequence[Path],
    project_id: str = DEFAULT_PROJECT_ID,
) -> tuple[Model, bool]:
    """Returns (model, created) in `project_id`. The same definition again is a no-op; a
    different one 409 (names are unique across projects: another project's is a 409 too,
    which says nothing of it). A cpu model's `base_model` must be under `model_roots`."""
    config = _check_backend(body, model_roots)
    await begin_write(session)
    existing = await session.get(ModelRow, body.name)
    if existing is not None and existing.project_id != project_id:
        raise ConflictError(f"the model name {body.name!r} is taken")
    if existing is not None:
        same = (
            existing.project,
            existing.base_model,
            existing.backend,
            existing.config,
            existing.pool or DEFAULT_POOL,
            existing.labels or {},
        ) == (
            body.project,
            body.base_model,
            body.backend,
            config,
            body.pool or DEFAULT_POOL,
            body.labels or {},
        )
        if not same:
            raise ConflictError(f"a different model named {body.name!r} exists")
        return to_wire(existing), False
    row = ModelRow(
        name=body.name,
        project=body.project,
        base_model=body.base_model,
        backend=body.backend,
        config=config,
        current_step=0,
        pool=body.pool,
        project_id=project_id,
    )
    if body.labels:  # none: SQL NULL (never a JSON null, which a claim would not read)
        row.labels = dict(body.labels)
    session.add(row)
    await session.flush()
    return to_wire(row), True


async def get_model(session: AsyncSession, *, name: str, project_id: str | None = None) -> Model:
    """The model; with `project_id`, only if it is that project's (else 404, as missing)."""
    row = await session.get(ModelRow, name)
    if row is None or (project_id is not None and row.project_id != project_id):
        raise not_found("model", name, param="name")
    return to_wire(row)


async def list_models(
    session: AsyncSession, *, after: str | None, limit: int, project_id: str | None = None
) -> tuple[list[Model], bool]:
    query = select(ModelRow).order_by(ModelRow.name).limit(limit + 1)
    if project_id is not None:
        query = query.where(ModelRow.project_id == project_id)
    if after:
        query = query.where(ModelRow.name > after)
    rows = (await session.scalars(query)).all()
    return [to_wire(r) for r in rows[:limit]], len(rows) > limit
