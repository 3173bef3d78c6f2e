"""Trainable models and the backends they can run on."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import BaseModel, Field

from app.api.body import Reading, json_body, read_json
from app.api.deps import Caller, Cursor, Session
from app.backends import SPECS
from app.errors import not_found
from app.gateway import PREFIX as GATEWAY_PREFIX
from app.models import ModelRow
from app.registry import models as service
from app.schemas.common import NO_NUL, Page, problem_responses
from app.schemas.models import Model, ModelCreate, TinkerStep
from app.tinker import journal
from app.tinker.listing import PROJECT as TINKER_PROJECT

READING = Reading(ModelCreate, lambda body, raw, settings: body)

router = APIRouter(prefix="/v1/models", tags=["models"], responses=problem_responses(401))
backends_router = APIRouter(
    prefix="/v1/backends", tags=["backends"], responses=problem_responses(401)
)


@router.post(
    "",
    response_model=Model,
    status_code=201,
    summary="Register a trainable model",
    responses={
        200: {"model": Model, "description": "An identical model already exists"},
        **problem_responses(409, 422),
    },
    openapi_extra=json_body(ModelCreate),
)
async def create(request: Request, session: Session, caller: Caller, response: Response) -> Model:
    model, created = await service.create_model(
        session,
        body=await read_json(request, READING),
        model_roots=request.app.state.settings.allowed_model_roots(),
        project_id=caller.owner,
    )
    await session.commit()
    if created:
        request.app.state.notifier.models_changed()
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"/v1/models/{model.name}"
    return _with_gateway(model, request)


@router.get(
    "",
    response_model=Page[Model],
    name="list",
    summary="List models",
    responses=problem_responses(422),
)
async def list_all(
    request: Request,
    session: Session,
    caller: Caller,
    after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Page[Model]:
    models, has_more = await service.list_models(
        session, after=after, limit=limit, project_id=caller.sees
    )
    return Page(
        data=[_with_gateway(m, request) for m in models],
        has_more=has_more,
        next_cursor=models[-1].name if has_more and models else None,
    )


@router.get(
    "/{name}", response_model=Model, summary="Get a model", responses=problem_responses(404)
)
async def get(
    name: Annotated[str, Path(pattern=NO_NUL)], request: Request, session: Session, caller: Caller
) -> Model:
    model = await service.get_model(session, name=name, project_id=caller.sees)
    return _with_gateway(model, request)


@router.get(
    "/{name}/tinker-metrics",
    response_model=Page[TinkerStep],
    summary="A Tinker training run's curves: one row per optimizer step",
    description="The model of a Tinker training run (project `tinker`, made by the Tinker "
    "SDK's `create_lora_training_client`): its `optim_step`s in order, each with the summed "
    "`loss:sum` of the `forward_backward` calls it applied and its learning rate, read from "
    "the run's journal. Pass `next_cursor` as `after` for the next page.",
    responses=problem_responses(404, 422),
)
async def tinker_metrics(
    name: Annotated[str, Path(pattern=NO_NUL)],
    session: Session,
    caller: Caller,
    after: Annotated[int, Query(ge=0, le=2**31 - 1, description="Steps after this one.")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Page[TinkerStep]:
    row = await session.get(ModelRow, name)
    theirs = row is not None and caller.sees is not None and row.project_id != caller.sees
    if row is None or row.project != TINKER_PROJECT or theirs:
        raise not_found(
            "Tinker training run",
            name,
            param="name",
            detail=f"no Tinker training run {name!r} (a model of project 'tinker')",
        )
    items, has_more = await journal.steps(session, name, after=after, limit=limit)
    return Page(
        data=items,
        has_more=has_more,
        next_cursor=str(items[-1].step) if has_more and items else None,
    )


def _with_gateway(model: Model, request: Request) -> Model:
    """The gateway's base URL, under the API's public URL (or this request's), as
    `openai_base_url` and, while a worker serves the model, `inference_base_url`."""
    if not model.openai_model_names:
        return model
    public = request.app.state.settings.public_url or str(request.base_url)
    gateway = public.rstrip("/") + GATEWAY_PREFIX
    update = {"openai_base_url": gateway}
    if model.inference_base_url is not None:
        update["inference_base_url"] = gateway
    return model.model_copy(update=update)


class Backend(BaseModel):
    name: str
    description: str
    hyperparameters: dict[str, Any] = Field(description="JSON Schema of the accepted keywords.")
    config: dict[str, Any] = Field(description="JSON Schema of a model's `config`.")
    methods: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="The training methods it offers beside `rl` (`sft`, `dpo`): JSON Schema "
        "of each one's keywords (a training job's `hyperparameters` with that `method`).",
    )


@backends_router.get("", name="list", response_model=list[Backend], summary="List trainer backends")
async def list_backends() -> list[Backend]:
    return [
        Backend(
            name=s.name,
            description=s.description,
            hyperparameters=s.hyperparameters.model_json_schema(),
            config=s.config.model_json_schema(),
            methods={m: hp.model_json_schema() for m, hp in s.other_methods.items()},
        )
        for s in SPECS.values()
    ]
