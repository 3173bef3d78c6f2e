"""The OpenAI-compatible gateway's routes (`app.gateway`): chat completions and models,
behind the API's keys, with errors in OpenAI's envelope."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from sqlalchemy import select

from app.api.body import parse_json
from app.backends import SPECS
from app.errors import format_path
from app.gateway import PREFIX, Gateway, GatewayError, served_names
from app.ingest import jsontext
from app.models import ModelRow
from app.schemas.common import problem_responses

router = APIRouter(prefix=PREFIX, tags=["gateway"], responses=problem_responses(401))

_ENVELOPE = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": "string"},
            },
            "required": ["message", "type", "code"],
        }
    },
    "required": ["error"],
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"description": why, "content": {"application/json": {"schema": _ENVELOPE}}}
    for status, why in [
        (400, "The request is not a chat completion request."),
        (
            404,
            "No such model or step, or the model is not served (its backend serves none, "
            "or cannot run here).",
        ),
        (503, "The serving endpoint is not reachable right now (Retry-After)."),
    ]
}
_CHAT_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "model": {
                            "type": "string",
                            "minLength": 1,
                            "description": "`name` (latest step), `name@latest`, "
                            "`name@N` (a past step, while its checkpoint exists) or "
                            "`name@alias` (`best`, or an alias set on the model).",
                        },
                        "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
                        "stream": {"type": "boolean"},
                    },
                    "required": ["model", "messages"],
                    "additionalProperties": True,
                }
            }
        },
    }
}


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def _chat_request(request: Request) -> dict[str, Any]:
    try:
        body = await parse_json(request)
    except jsontext.JsonTextError as exc:
        where = f" at character {exc.pos}" if exc.pos is not None else ""
        where += f" at {format_path(exc.path)}" if exc.path else ""
        raise GatewayError(
            400, f"The body is not JSON: {exc.message}{where}", "invalid_json"
        ) from exc
    except jsontext.JsonValueErrors as exc:
        first = exc.errors[0]
        raise GatewayError(
            400,
            f"The body is not JSON text at `{format_path(first.path)}`: {first.message}",
            "invalid_json",
        ) from exc
    if not isinstance(body, dict):
        raise GatewayError(400, "The body must be a JSON object.", "invalid_request")
    model = body.get("model")
    if not isinstance(model, str) or not model or len(model) > 300 or "\x00" in model:
        raise GatewayError(400, "`model` must be a model name (see GET /models).", "invalid_model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "`messages` must be a non-empty list.", "invalid_messages")
    if not isinstance(body.get("stream", False), bool):
        raise GatewayError(400, "`stream` must be a boolean.", "invalid_stream")
    return body


@router.post(
    "/chat/completions",
    summary="Chat completions from any served model and step (OpenAI-compatible)",
    response_class=Response,
    responses={200: {"description": "The serving endpoint's answer, as it sent it."}, **_ERRORS},
    openapi_extra=_CHAT_BODY,
)
async def chat_completions(request: Request) -> Response:
    try:
        body = await _chat_request(request)
        # A short session: none is held while the endpoint answers.
        async with request.app.state.sessions() as session:
            route = await _gateway(request).resolve(session, body["model"])
        return await _gateway(request).forward(route, "/chat/completions", body)
    except GatewayError as exc:
        return exc.response()


@router.get(
    "/models",
    summary="The model names the gateway serves (OpenAI-compatible)",
    responses={200: {"description": "`{object: list, data: [{id, object, owned_by}]}`"}},
)
async def models(request: Request) -> dict[str, Any]:
    serving = [name for name, spec in SPECS.items() if spec.serves]
    async with request.app.state.sessions() as session:
        rows = (
            await session.scalars(
                select(ModelRow).where(ModelRow.backend.in_(serving)).order_by(ModelRow.name)
            )
        ).all()
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "trainyard"}
        for row in rows
        for name in served_names(row)
    ]
    return {"object": "list", "data": data}
