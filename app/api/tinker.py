"""`/tinker/api/v1/...`: the routes the Tinker SDK (0.38) calls, with the bodies it sends.

Point the SDK at `TINKER_BASE_URL=<trainyard>/tinker`. Bodies are JSON, except
`forward_backward`'s (protobuf, `application/x-protobuf`; zstd only if `client/config` asks
for it, which it does not). Results come back through `retrieve_future`: protobuf for
`forward`/`forward_backward` and `sample`, JSON for the rest; 408 with a `try_again` body
when a result is not ready within the long poll. Errors are problem+json: the SDK raises
them as its own classes (400 `BadRequestError`, 404 `NotFoundError`, ...). docs/tinker.md
lists the routes. Left out of the OpenAPI document: this surface is the SDK's, not ours.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.api.body import parse_json
from app.errors import problem_response
from app.ingest.edge import body_of, principal_of
from app.tenants.keys import Principal
from app.tinker import wire
from app.tinker.service import SAMPLER, TinkerError, TinkerService

PREFIX = "/tinker/api/v1"
PROTOBUF = "application/x-protobuf"

router = APIRouter(prefix=PREFIX, include_in_schema=False)


def service(request: Request) -> TinkerService:
    state = request.app.state
    if getattr(state, "tinker", None) is None:
        state.tinker = TinkerService(state.settings, state.sessions, state.backends)
    tinker: TinkerService = state.tinker
    return tinker


async def json_body(request: Request) -> dict[str, Any]:
    if not await body_of(request):
        return {}
    try:
        body = await parse_json(request)  # the service's one strict parser
    except ValueError as exc:  # JsonTextError, JsonValueErrors
        raise TinkerError(400, f"body: not JSON this service accepts ({exc})") from exc
    if not isinstance(body, dict):
        raise TinkerError(400, "body: must be a JSON object")
    return body


def who(request: Request) -> Principal:
    """The request's key: what it reaches is its project's (every project's for an admin)."""
    return principal_of(request.scope)


def refused(request: Request, exc: TinkerError) -> JSONResponse:
    return problem_response(exc.status, "Tinker request refused", str(exc), request=request)


def future(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id}


# Routes are matched in the order they are defined here, each one passed costing a
# path match: what an RL loop calls most (a sample, and the future of every operation)
# comes first.
@router.post("/asample", response_model=None)
async def asample(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        return await service(request).asample(await json_body(request), who(request))
    except TinkerError as exc:
        return refused(request, exc)


@router.post("/retrieve_future", response_model=None)
async def retrieve_future(request: Request) -> Response:
    tinker = service(request)
    try:
        request_id = str((await json_body(request)).get("request_id", ""))
    except TinkerError as exc:
        return refused(request, exc)
    try:
        result = await tinker.retrieve(request_id, who(request))
    except KeyError:
        # 410: the SDK's "promise expired" (neither this process nor the journal knows it).
        return problem_response(
            410, "Gone", f"request_id: no future {request_id!r}", request=request
        )
    except TinkerError as exc:
        return refused(request, exc)
    if result is None:
        body = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        return JSONResponse(body, status_code=408)
    if result.error is not None:
        return JSONResponse({"error": result.error, "category": result.category})
    if result.proto is not None:
        return Response(result.proto, media_type=PROTOBUF)
    return JSONResponse(result.json)


@router.post("/client/config")
async def client_config() -> dict[str, Any]:
    # httpx's own transport, no compressed bodies, one poll per future, losses run here.
    return {"use_pyqwest_transport": False, "proto_compress_fwdbwd": False}


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> dict[str, Any]:
    # No cancel requests: an abandoned sample runs to its end (it is short here).
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/create_session")
async def create_session(request: Request) -> dict[str, Any]:
    await json_body(request)
    session_id = await service(request).create_session(who(request))
    return {"type": "create_session", "session_id": session_id}


@router.post("/session_heartbeat", response_model=None)
async def session_heartbeat(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        session_id = str((await json_body(request)).get("session_id", ""))
        await service(request).heartbeat(session_id, who(request))
    except TinkerError as exc:
        return refused(request, exc)
    return {"type": "session_heartbeat"}


@router.get("/get_server_capabilities")
async def get_server_capabilities(request: Request) -> dict[str, Any]:
    return {"supported_models": await service(request).capabilities(who(request))}


@router.post("/create_model", response_model=None)
async def create_model(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        body = await json_body(request)
        request_id, model_id = await service(request).create_model(body, who(request))
    except TinkerError as exc:
        return refused(request, exc)
    return future(request_id, model_id)


@router.post("/get_info", response_model=None)
async def get_info(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        model_id = str((await json_body(request)).get("model_id", ""))
        return await service(request).info(model_id, who(request))
    except TinkerError as exc:
        return refused(request, exc)


@router.post("/forward_backward", response_model=None)
async def forward_backward(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise TinkerError(415, f"content-type: forward_backward takes {PROTOBUF}")
        raw = await body_of(request)
        try:
            body = wire.read_forward_backward(raw)
        except (wire.WireError, UnicodeDecodeError) as exc:
            raise TinkerError(400, f"body: not a ForwardBackwardRequest ({exc})") from exc
        request_id = await service(request).forward_backward(body, raw, who(request))
        return future(request_id, body.model_id)
    except TinkerError as exc:
        return refused(request, exc)


@router.post("/optim_step", response_model=None)
async def optim_step(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        body = await json_body(request)
        return future(await service(request).optim_step(body, who(request)), body.get("model_id"))
    except TinkerError as exc:
        return refused(request, exc)


@router.post("/save_weights_for_sampler", response_model=None)
async def save_weights_for_sampler(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        body = await json_body(request)
        request_id = await service(request).save(body, SAMPLER, who(request))
        return future(request_id, body.get("model_id"))
    except TinkerError as exc:
        return refused(request, exc)


@router.post("/save_weights", response_model=None)
async def save_weights(request: Request) -> dict[str, Any] | JSONResponse:
    """The SDK's `save_state`."""
    try:
        body = await json_body(request)
        request_id = await service(request).save(body, "weights", who(request))
        return future(request_id, body.get("model_id"))
    except TinkerError as exc:
        return refused(request, exc)


@router.post("/load_weights", response_model=None)
async def load_weights(request: Request) -> dict[str, Any] | JSONResponse:
    """The SDK's `load_state` and `create_training_client_from_state`."""
    try:
        request_id, model_id = await service(request).load(await json_body(request), who(request))
    except TinkerError as exc:
        return refused(request, exc)
    return future(request_id, model_id)


@router.post("/create_sampling_session", response_model=None)
async def create_sampling_session(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        body = await json_body(request)
        sampler_id = await service(request).create_sampling_session(body, who(request))
    except TinkerError as exc:
        return refused(request, exc)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}", response_model=None)
async def get_sampler(request: Request, sampler_id: str) -> dict[str, Any] | JSONResponse:
    try:
        sampler = await service(request).sampler(sampler_id, who(request))
    except TinkerError as exc:
        return refused(request, exc)
    return {
        "sampler_id": sampler_id,
        "base_model": sampler.base_model,
        "model_path": sampler.model_path,
    }


@router.get("/training_runs", response_model=None)
async def list_training_runs(
    request: Request, limit: int = 20, offset: int = 0
) -> dict[str, Any] | JSONResponse:
    try:
        return await service(request).training_runs(limit, offset, who(request))
    except TinkerError as exc:
        return refused(request, exc)


@router.get("/training_runs/{training_run_id}", response_model=None)
async def get_training_run(request: Request, training_run_id: str) -> Any:
    try:
        return await service(request).training_run(training_run_id, who(request))
    except TinkerError as exc:
        return refused(request, exc)


@router.get("/training_runs/{training_run_id}/checkpoints", response_model=None)
async def list_checkpoints(request: Request, training_run_id: str) -> Any:
    try:
        return await service(request).training_run(training_run_id, who(request), checkpoints=True)
    except TinkerError as exc:
        return refused(request, exc)


@router.delete("/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(request: Request, training_run_id: str, checkpoint_id: str) -> Any:
    try:
        await service(request).delete_checkpoint(training_run_id, checkpoint_id, who(request))
    except TinkerError as exc:
        return refused(request, exc)
    return Response(status_code=204)


@router.get("/checkpoints", response_model=None)
async def list_user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> Any:
    try:
        return await service(request).user_checkpoints(limit, offset, who(request))
    except TinkerError as exc:
        return refused(request, exc)


@router.post("/weights_info", response_model=None)
async def weights_info(request: Request) -> Any:
    try:
        return await service(request).weights_info(await json_body(request), who(request))
    except TinkerError as exc:
        return refused(request, exc)


@router.post("/telemetry")
async def telemetry() -> dict[str, str]:
    return {"status": "accepted"}
