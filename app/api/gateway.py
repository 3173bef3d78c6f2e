"""The OpenAI-compatible gateway's routes (`app.gateway`): chat completions and models,
behind the API's keys, with errors in OpenAI's envelope."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from starlette.background import BackgroundTask

from app.api.body import parse_json
from app.api.deps import Caller
from app.backends import SPECS
from app.backends.openai_chat import (
    MAX_PARTS,
    MAX_TOOLS,
    ROLES,
    TEXT_PARTS,
    ChatInvalid,
    check_chat,
)
from app.errors import format_path
from app.gateway import PREFIX, Gateway, GatewayError, parse_model, served_names
from app.ingest import jsontext
from app.models import ModelRow
from app.tenants.keys import Principal
from app.tenants.metering import GatewayMeter, metered, tokens_in

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.2
# Counted for a request that states no `max_tokens` (the cpu backend's most per answer).
UNSTATED_MAX_TOKENS = 1024

router = APIRouter(prefix=PREFIX, tags=["gateway"])

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
        (401, "No key, or an unknown, revoked or expired one (`invalid_api_key`)."),
        (403, "The key lacks the `sample` scope (`missing_scope`)."),
        (
            404,
            "No such model or step, or the model is not served (its backend serves none, "
            "or cannot run here).",
        ),
        (
            429,
            "The model is saturated: its admitted work (n x max_tokens) is at the bound "
            "(Retry-After).",
        ),
        (502, "The serving endpoint failed."),
        (503, "The serving endpoint is not reachable right now (Retry-After)."),
    ]
}
# A chat message as the gateway reads it (`app.backends.openai_chat`): what it refuses, the
# document does not offer. Content is text (a string, or text parts); only an assistant's may
# be null, and only an assistant's carries `tool_calls`.
_TEXT_PART = {  # `{"type": "text", "text": ...}`, `{"type": "refusal", "refusal": ...}`
    "oneOf": [
        {
            "type": "object",
            "properties": {"type": {"const": kind}, kind: {"type": "string"}},
            "required": ["type", kind],
        }
        for kind in sorted(TEXT_PARTS)
    ]
}
_CONTENT = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "maxItems": MAX_PARTS, "items": _TEXT_PART},
    ]
}
_TOOL_CALL = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            "required": ["name", "arguments"],
        },
    },
    "required": ["id", "function"],
}
_NAMES = {"name": {"type": "string"}, "tool_call_id": {"type": "string"}}
_MESSAGE = {
    "oneOf": [
        {
            "type": "object",
            "properties": {
                "role": {"enum": sorted(ROLES - {"assistant"})},
                "content": _CONTENT,
                "tool_calls": {"type": "null"},  # only an assistant calls tools
                **_NAMES,
            },
            "required": ["role", "content"],
        },
        {
            "type": "object",
            "properties": {
                "role": {"const": "assistant"},
                "content": {"anyOf": [*_CONTENT["anyOf"], {"type": "null"}]},
                "tool_calls": {"type": "array", "maxItems": MAX_TOOLS, "items": _TOOL_CALL},
                **_NAMES,
            },
            "required": ["role"],
        },
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
                        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
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
    try:
        return check_chat(body)
    except ChatInvalid as exc:
        raise GatewayError(400, exc.message, exc.code) from exc


def _tokens(body: dict[str, Any]) -> int:
    """The work a request asks for, as admission counts it: `n x max_tokens`."""
    most = body.get("max_completion_tokens") or body.get("max_tokens") or UNSTATED_MAX_TOKENS
    return int(body.get("n") or 1) * int(most)


async def _until_disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body is read: what is left to receive
    is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(DISCONNECT_POLL_S)  # more body: not expected; never a busy loop


def _meter(
    request: Request, caller: Principal, requested: str
) -> Callable[[tuple[int, int]], Awaitable[None]]:
    """What records an answer's tokens: for the calling key and its project."""
    meter: GatewayMeter = request.app.state.tenants.meter
    model = parse_model(requested)[0]

    async def counted(tokens: tuple[int, int]) -> None:
        await meter.record(
            project_id=caller.owner, key_id=caller.key_id, model=model, tokens=tokens
        )

    return counted


@router.post(
    "/chat/completions",
    summary="Chat completions from any served model and step (OpenAI-compatible)",
    response_class=Response,
    responses={200: {"description": "The serving endpoint's answer, as it sent it."}, **_ERRORS},
    openapi_extra=_CHAT_BODY,
)
async def chat_completions(request: Request, caller: Caller) -> Response:
    gateway = _gateway(request)
    try:
        body = await _chat_request(request)
        # A short session: none is held while the endpoint answers.
        async with request.app.state.sessions() as session:
            if caller.sees is not None:  # a key of one project: only its models
                row = await session.get(ModelRow, parse_model(body["model"])[0])
                if row is not None and row.project_id != caller.sees:
                    requested = body["model"]
                    message = f"The model `{requested}` does not exist."
                    raise GatewayError(404, message, "model_not_found")
            route = await gateway.resolve(session, body["model"])
        ticket = gateway.admit(parse_model(body["model"])[0], _tokens(body))
        released_later = False
        try:
            # The client may go away while the endpoint works: then the upstream request
            # is cancelled (its connection closed), and the endpoint stops generating.
            forward = asyncio.ensure_future(gateway.forward(route, "/chat/completions", body))
            gone = asyncio.ensure_future(_until_disconnected(request))
            try:
                await asyncio.wait({forward, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not forward.done():
                    forward.cancel()
            if not forward.done() or forward.cancelled():
                ticket.abandon()
                return Response(status_code=499)  # nobody reads it
            response = forward.result()
            counted = _meter(request, caller, body["model"])
            if isinstance(response, StreamingResponse):
                # Admitted until the stream ends (or its client goes away).
                response.background = BackgroundTask(ticket.release)
                response.body_iterator = metered(response.body_iterator, counted)
                released_later = True
            elif response.status_code == 200:
                tokens = tokens_in(bytes(response.body))
                if tokens is not None:  # recorded after the answer is sent
                    response.background = BackgroundTask(counted, tokens)
            return response
        finally:
            if not released_later:
                ticket.release()
    except GatewayError as exc:
        return exc.response()
    except Exception as exc:  # never a text/plain traceback to an OpenAI client
        log.exception("gateway: chat completion failed")
        return GatewayError(
            500, f"The gateway failed: {type(exc).__name__}.", "internal_error", kind="server_error"
        ).response()


@router.get(
    "/models",
    summary="The model names the gateway serves (OpenAI-compatible)",
    responses={
        200: {"description": "`{object: list, data: [{id, object, owned_by}]}`"},
        401: _ERRORS[401],
        403: _ERRORS[403],
    },
)
async def models(request: Request, caller: Caller) -> dict[str, Any]:
    serving = [name for name, spec in SPECS.items() if spec.serves]
    query = select(ModelRow).where(ModelRow.backend.in_(serving)).order_by(ModelRow.name)
    if caller.sees is not None:  # a key of one project: only its models
        query = query.where(ModelRow.project_id == caller.sees)
    async with request.app.state.sessions() as session:
        rows = (await session.scalars(query)).all()
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "trainyard"}
        for row in rows
        for name in served_names(row)
    ]
    return {"object": "list", "data": data}
