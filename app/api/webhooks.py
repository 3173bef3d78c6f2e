"""Webhook endpoints: register, list, show, change, remove; their delivery log; a test."""

from __future__ import annotations

from typing import Annotated, TypeVar

from fastapi import APIRouter, Header, Query, Request, Response
from pydantic import WithJsonSchema

from app.api.body import Reading, json_body, read_json
from app.api.deps import Caller, Cursor, JobId, Session
from app.egress import EgressPolicy
from app.schemas.common import Page, problem_responses
from app.schemas.webhooks import (
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEndpointCreate,
    WebhookEndpointCreated,
    WebhookEndpointUpdate,
)
from app.settings import Settings
from app.webhooks import service

Body = TypeVar("Body", WebhookEndpointCreate, WebhookEndpointUpdate)


def _checked(body: Body, raw: bytes, settings: Settings) -> Body:
    service.check_destination(body, EgressPolicy.from_settings(settings))
    return body


CREATING = Reading(WebhookEndpointCreate, _checked)
UPDATING = Reading(WebhookEndpointUpdate, _checked)

IF_MATCH = r'^(W/)?"?[1-9][0-9]{0,8}"?$'
"""`If-Match` of a rotation: a `secret_version`, bare or as an entity tag (below 10^9: a
version the column can hold)."""

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], responses=problem_responses(401))
EndpointId = JobId


@router.post(
    "",
    response_model=WebhookEndpointCreated,
    status_code=201,
    summary="Register a webhook endpoint of the key's project (its secret is in this answer "
    "only); 409 past `TRAINYARD_WEBHOOK_MAX_ENDPOINTS` in the project",
    responses=problem_responses(409, 413, 422),
    openapi_extra=json_body(WebhookEndpointCreate),
)
async def create(
    request: Request, session: Session, caller: Caller, response: Response
) -> WebhookEndpointCreated:
    settings: Settings = request.app.state.settings
    endpoint = await service.create_endpoint(
        session,
        body=await read_json(request, CREATING),
        max_endpoints=settings.webhook_max_endpoints,
        project_id=caller.owner,
    )
    await session.commit()
    response.headers["Location"] = f"/v1/webhooks/{endpoint.id}"
    return endpoint


@router.get(
    "",
    name="list",
    response_model=Page[WebhookEndpoint],
    summary="List the webhook endpoints of the key's project (an admin key: every "
    "project's), newest first",
    responses=problem_responses(422),
)
async def list_all(
    session: Session,
    caller: Caller,
    after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Page[WebhookEndpoint]:
    items, has_more = await service.list_endpoints(
        session, after=after, limit=limit, project_id=caller.sees
    )
    return Page(data=items, has_more=has_more, next_cursor=items[-1].id if has_more else None)


@router.get(
    "/{endpoint_id}",
    response_model=WebhookEndpoint,
    summary="Get a webhook endpoint",
    responses=problem_responses(404),
)
async def get(endpoint_id: EndpointId, session: Session, caller: Caller) -> WebhookEndpoint:
    return service.to_wire(await service.get_endpoint(session, endpoint_id, caller.sees))


@router.patch(
    "/{endpoint_id}",
    response_model=WebhookEndpoint,
    summary="Change a webhook endpoint: its URL, event types, description, or enabled",
    responses=problem_responses(404, 413, 422),
    openapi_extra=json_body(WebhookEndpointUpdate),
)
async def update(
    endpoint_id: EndpointId, request: Request, session: Session, caller: Caller
) -> WebhookEndpoint:
    body = await read_json(request, UPDATING)
    endpoint = await service.update_endpoint(
        session, endpoint_id, body=body, project_id=caller.sees
    )
    await session.commit()
    request.app.state.notifier.webhooks_due()  # enabled again: what waited is due
    return endpoint


@router.post(
    "/{endpoint_id}/rotate-secret",
    name="rotate_secret",
    response_model=WebhookEndpointCreated,
    summary="Give the endpoint a new secret (in this answer only, with its "
    "`secret_version`); the previous one keeps signing deliveries too for "
    "`TRAINYARD_WEBHOOK_SECRET_GRACE_SECONDS`. Concurrent rotations are serialised; with "
    "`If-Match: <secret_version>` a rotation of a secret rotated meanwhile is a 409",
    responses=problem_responses(404, 409, 422),
)
async def rotate_secret(
    endpoint_id: EndpointId,
    request: Request,
    session: Session,
    caller: Caller,
    if_match: Annotated[
        str | None,
        # A header is sent or not, never JSON null: no `null` branch in the schema.
        WithJsonSchema({"type": "string", "maxLength": 24, "pattern": IF_MATCH}),
        Header(
            max_length=24,
            pattern=IF_MATCH,
            description="The `secret_version` being replaced: 409 if the secret is at "
            "another version.",
        ),
    ] = None,
) -> WebhookEndpointCreated:
    settings: Settings = request.app.state.settings
    expected = None if if_match is None else int(if_match.removeprefix("W/").strip('"'))
    endpoint = await service.rotate_secret(
        session,
        endpoint_id,
        grace_seconds=settings.webhook_secret_grace_seconds,
        project_id=caller.sees,
        expected_version=expected,
    )
    await session.commit()
    return endpoint


@router.delete(
    "/{endpoint_id}",
    status_code=204,
    summary="Remove a webhook endpoint and its delivery log",
    responses=problem_responses(404),
)
async def delete(endpoint_id: EndpointId, session: Session, caller: Caller) -> Response:
    await service.delete_endpoint(session, endpoint_id, caller.sees)
    await session.commit()
    return Response(status_code=204)


@router.get(
    "/{endpoint_id}/deliveries",
    name="deliveries",
    response_model=Page[WebhookDelivery],
    summary="The endpoint's deliveries, newest first, each with its attempts",
    responses=problem_responses(404, 422),
)
async def deliveries(
    endpoint_id: EndpointId,
    session: Session,
    caller: Caller,
    after: Annotated[
        int | None,
        Query(ge=0, le=2**31 - 1, description="`next_cursor` of the previous page"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Page[WebhookDelivery]:
    items, has_more = await service.list_deliveries(
        session, endpoint_id, after=after, limit=limit, project_id=caller.sees
    )
    cursor = str(items[-1].id) if has_more else None
    return Page(data=items, has_more=has_more, next_cursor=cursor)


@router.post(
    "/{endpoint_id}/test",
    name="test",
    response_model=WebhookDelivery,
    status_code=202,
    summary="Send the endpoint a `webhook.test` message (a worker sends it)",
    responses=problem_responses(404),
)
async def test(
    endpoint_id: EndpointId, request: Request, session: Session, caller: Caller
) -> WebhookDelivery:
    delivery = await service.send_test(session, endpoint_id, caller.sees)
    await session.commit()
    request.app.state.notifier.webhooks_due()
    return delivery
