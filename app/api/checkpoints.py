"""A model's checkpoints, aliases and retention policy (`app.checkpoints.service`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import iterate_in_threadpool
from starlette.types import Receive, Scope, Send

from app.api.body import Reading, json_body, read_json
from app.api.deps import Caller, Session
from app.backends import Backends
from app.checkpoints import service
from app.registry.models import get_model
from app.schemas.checkpoints import (
    ALIAS_PATTERN,
    BUILTIN_ALIASES,
    MAX_STEP,
    Alias,
    AliasSet,
    Checkpoint,
    ExportFormat,
    RetentionPolicy,
    RetentionPolicyIn,
    RetentionRun,
)
from app.schemas.common import NO_NUL, Page, problem_responses

ALIAS_SET = Reading(AliasSet, lambda body, raw, settings: body)
RETENTION_POLICY = Reading(RetentionPolicyIn, lambda body, raw, settings: body)

Name = Annotated[str, Path(pattern=NO_NUL, description="The model's name.")]


async def _callers_model(request: Request, caller: Caller, name: Name) -> None:
    """A key that is not admin reaches only its project's models' checkpoints, aliases and
    retention: another project's model is a 404, as a missing one (issue 28 §2)."""
    if caller.sees is None:
        return
    async with request.app.state.sessions() as session:
        await get_model(session, name=name, project_id=caller.sees)


router = APIRouter(
    prefix="/v1/models",
    tags=["checkpoints"],
    responses=problem_responses(401),
    dependencies=[Depends(_callers_model)],
)
Step = Annotated[int, Path(ge=0, le=MAX_STEP, description="A step of the model.")]
AliasName = Annotated[
    str,
    Path(
        pattern=ALIAS_PATTERN,
        description="`[a-z][a-z0-9_-]{0,63}`, not `latest` or `best` (built in).",
        json_schema_extra={"not": {"enum": list(BUILTIN_ALIASES)}},
    ),
]
Limit = Annotated[int, Query(ge=1, le=100)]
NO_LOCAL = (
    "The model's backend keeps no checkpoints on this machine (art-serverless), or cannot run here"
)


class ClosingStream(StreamingResponse):
    """Streams a synchronous iterator from threads, and closes it however the answer ends:
    a client gone mid-stream leaves Starlette's iteration suspended, never finished, and
    the export's open files (a whole model's shards) waiting for the garbage collector."""

    def __init__(self, chunks: Iterator[bytes], **kwargs: Any) -> None:
        self._closing = _closing(chunks)
        super().__init__(self._closing, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._closing.aclose()


async def _closing(chunks: Iterator[bytes]) -> AsyncGenerator[bytes]:
    try:
        async for chunk in iterate_in_threadpool(chunks):
            yield chunk
    finally:
        # No thread runs it now (a cancelled `iterate_in_threadpool` waits for its thread),
        # and a generator's close is quick: it closes files.
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def _backends(request: Request) -> Backends:
    backends: Backends = request.app.state.backends
    return backends


def _problems(*statuses: int, conflict: str = NO_LOCAL) -> dict[int | str, dict[str, Any]]:
    responses = problem_responses(*statuses)
    if 409 in responses:
        responses[409] = {**responses[409], "description": conflict}
    return responses


@router.get(
    "/{name}/checkpoints",
    response_model=Page[Checkpoint],
    name="list",
    summary="List a model's checkpoints, newest first",
    responses=_problems(404, 409, 422),
)
async def list_checkpoints(
    name: Name,
    request: Request,
    session: Session,
    after: Annotated[
        int | None,
        Query(ge=0, le=MAX_STEP, description="`next_cursor` of the previous page"),
    ] = None,
    limit: Limit = 20,
) -> Page[Checkpoint]:
    checkpoints, cursor = await service.list_checkpoints(
        session, _backends(request), name=name, after=after, limit=limit
    )
    return Page(data=checkpoints, has_more=cursor is not None, next_cursor=cursor)


@router.get(
    "/{name}/checkpoints/{step}",
    response_model=Checkpoint,
    name="get",
    summary="Get one checkpoint",
    responses=_problems(404, 409, 422),
)
async def get_checkpoint(name: Name, step: Step, request: Request, session: Session) -> Checkpoint:
    return await service.get_checkpoint(session, _backends(request), name=name, step=step)


@router.delete(
    "/{name}/checkpoints/{step}",
    status_code=204,
    name="delete",
    summary="Delete a checkpoint",
    responses=_problems(
        404,
        409,
        422,
        conflict="The step is protected (the latest; an alias, `best` included, points at "
        "it; a queued or running job needs it: `errors` says which), or the backend keeps "
        "no checkpoints here",
    ),
)
async def delete_checkpoint(name: Name, step: Step, request: Request, session: Session) -> Response:
    await service.delete_checkpoint(session, _backends(request), name=name, step=step)
    await session.commit()
    return Response(status_code=204)


@router.get(
    "/{name}/checkpoints/{step}/export",
    name="export",
    summary="Download a checkpoint: its LoRA adapter for PEFT, or merged into its base model",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "`tar.gz` (also named `peft`) or `zip`: an archive "
            "(`Content-Disposition` names the file: `{name}-step{NNNN}.tar.gz` or `.zip`) "
            "of one folder, `{name}-step{NNNN}/`, "
            "holding `adapter_config.json` and `adapter_model.safetensors`: "
            "`PeftModel.from_pretrained(base_model, folder)` loads it. `merged`: a tar "
            "(`{name}-step{NNNN}-merged.tar`, with a `Content-Length`) of one folder, "
            "`{name}-step{NNNN}-merged/`: the base model's directory (config, tokenizer, "
            "safetensors shards) with the adapter merged into its weights: "
            "`AutoModelForCausalLM.from_pretrained(folder)` loads it.",
            "content": {
                service.ARCHIVE_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}
            },
        },
        **_problems(
            404,
            409,
            422,
            conflict="The checkpoint holds no adapter (dry-run), or the backend keeps no "
            "checkpoints here; `merged` only: the base model is not a local directory under "
            "the model roots (`base-not-local`), or the adapter or the base cannot take a "
            "merge (`not-mergeable`: DoRA, a quantized base, no safetensors weights)",
        ),
    },
)
async def export_checkpoint(
    name: Name,
    step: Step,
    request: Request,
    session: Session,
    format: Annotated[
        ExportFormat,
        Query(
            description="`tar.gz` (or its other name `peft`) or `zip`: the adapter; "
            "`merged`: the base model with the adapter merged in, as a tar"
        ),
    ] = "tar.gz",
) -> StreamingResponse:
    export = await service.export(
        session,
        _backends(request),
        name=name,
        step=step,
        fmt=format,
        model_roots=request.app.state.settings.allowed_model_roots(),
    )
    await session.close()  # nothing from the database while the archive streams
    headers = {"Content-Disposition": f'attachment; filename="{export.filename}"'}
    if export.size is not None:
        headers["Content-Length"] = str(export.size)
    return ClosingStream(export.chunks, media_type=service.ARCHIVE_MEDIA_TYPE, headers=headers)


@router.get(
    "/{name}/aliases",
    response_model=Page[Alias],
    name="list_aliases",
    summary="List a model's aliases, built-in ones included",
    responses=_problems(404, 409, 422),
)
async def list_aliases(
    name: Name,
    request: Request,
    session: Session,
    after: Annotated[
        str | None, Query(pattern=NO_NUL, description="`next_cursor` of the previous page")
    ] = None,
    limit: Limit = 20,
) -> Page[Alias]:
    aliases, cursor = await service.list_aliases(
        session, _backends(request), name=name, after=after, limit=limit
    )
    return Page(data=aliases, has_more=cursor is not None, next_cursor=cursor)


@router.put(
    "/{name}/aliases/{alias}",
    response_model=Alias,
    name="set_alias",
    summary="Point an alias at a step",
    responses={
        200: {"model": Alias, "description": "The alias existed; it points at `step` now"},
        201: {"model": Alias, "description": "The alias was created"},
        **_problems(404, 409, 422),
    },
    openapi_extra=json_body(AliasSet),
)
async def set_alias(
    name: Name,
    alias: AliasName,
    request: Request,
    response: Response,
    session: Session,
) -> Alias:
    body = await read_json(request, ALIAS_SET)
    result, created = await service.set_alias(
        session, _backends(request), name=name, alias=alias, step=body.step
    )
    await session.commit()
    response.status_code = 201 if created else 200
    return result


@router.delete(
    "/{name}/aliases/{alias}",
    status_code=204,
    name="delete_alias",
    summary="Remove an alias (the checkpoint stays)",
    responses=_problems(404, 422),
)
async def delete_alias(name: Name, alias: AliasName, session: Session) -> Response:
    await service.delete_alias(session, name=name, alias=alias)
    await session.commit()
    return Response(status_code=204)


@router.get(
    "/{name}/retention",
    response_model=RetentionPolicy,
    name="get_retention",
    summary="Get a model's retention policy (none set: every checkpoint is kept)",
    responses=_problems(404, 409, 422),
)
async def get_retention(name: Name, request: Request, session: Session) -> RetentionPolicy:
    return await service.get_retention(session, _backends(request), name=name)


@router.put(
    "/{name}/retention",
    response_model=RetentionPolicy,
    name="set_retention",
    summary="Set a model's retention policy (applied after each step)",
    responses={
        200: {"model": RetentionPolicy, "description": "The policy replaced the previous one"},
        201: {"model": RetentionPolicy, "description": "The model had no policy"},
        **_problems(404, 409, 422),
    },
    openapi_extra=json_body(RetentionPolicyIn),
)
async def set_retention(
    name: Name, request: Request, response: Response, session: Session
) -> RetentionPolicy:
    body = await read_json(request, RETENTION_POLICY)
    policy, created = await service.set_retention(session, _backends(request), name=name, body=body)
    await session.commit()
    response.status_code = 201 if created else 200
    return policy


@router.delete(
    "/{name}/retention",
    status_code=204,
    name="delete_retention",
    summary="Remove a model's retention policy: every checkpoint is kept (idempotent)",
    responses=_problems(404, 422),
)
async def delete_retention(name: Name, session: Session) -> Response:
    await service.delete_retention(session, name=name)
    await session.commit()
    return Response(status_code=204)


@router.post(
    "/{name}/retention/apply",
    response_model=RetentionRun,
    name="apply_retention",
    summary="Apply a model's retention policy now (none: every checkpoint is kept)",
    responses=_problems(404, 409, 422),
)
async def apply_retention(name: Name, request: Request, session: Session) -> RetentionRun:
    run = await service.apply_retention(session, _backends(request), name=name)
    await session.commit()
    return run
