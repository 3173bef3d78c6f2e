"""The `cpu` backend's OpenAI-compatible endpoint: `/v1/models` and `/v1/chat/completions`
with logprobs (tokens as `token_id:N`, as ART's vLLM returns them), for every registered
model as `name@step`: its latest adapter, or any past step whose checkpoint is on disk.

Limits (each refused with a 400 in OpenAI's envelope naming the field): at most
`MAX_TOKENS` tokens per answer, `MAX_N` answers per request, no streaming; messages are
read as `app.backends.openai_chat` defines them (content parts joined). Work per model is
bounded by the backend's `Admission` (`n x max_tokens` admitted at once; past it a 429 with
`Retry-After`), and a request whose client goes away stops: between tokens while it
samples, and while it waits for the model. `tools` go
through the model's chat template; tool calls the model writes in the Hermes/Qwen
`<tool_call>` convention come back as OpenAI `tool_calls` (`app.backends.tool_calls`).

It runs in its own thread with its own event loop, so sampling never stalls the service.
It binds loopback by default. Each model has its own key (`ModelKeys`), handed out with
the model's endpoint (ART's `inference_api_key`): an `agent` rollout's service is told its
model's, and sees no other model there (`/v1/models` lists that one; another's answers
404, as one that does not exist); no key or an unknown one answers 401.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.backends.admission import Abandoned, Refused, Ticket
from app.backends.openai_chat import (
    INT64_MAX,
    INT64_MIN,
    ChatInvalid,
    check_tools,
    is_step,
    normalize_messages,
)
from app.backends.tool_calls import parse_tool_calls

if TYPE_CHECKING:
    from app.backends.cpu import CpuBackend
    from app.backends.lora_pool import AdapterPool


MAX_TOKENS = 1024
MAX_N = 64
DEFAULT_MAX_TOKENS = 64


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send more; ignore the rest

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto"] | None = Field(
        default=None,
        description="`auto` (default with tools) or `none`; the cpu backend cannot force a "
        "call (`required` or a named function are refused).",
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)


class _UnauthorizedError(Exception):
    """A request without a key of this endpoint (answered 401)."""


def _error(status: int, message: str, code: str) -> JSONResponse:
    # OpenAI's error envelope, which OpenAI clients parse.
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": code}},
        status_code=status,
    )


class ModelKeys:
    """A key per model, derived from a secret this server draws at its start: one
    model's key names no other (HMAC-SHA256), and a restart changes them all (the worker
    writes its endpoint and key again when it serves the model)."""

    PREFIX = "tycpu_"

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)
        self._keys: dict[str, bytes] = {}  # by model: computed once, compared per request

    def key(self, model: str) -> str:
        return self._key(model).decode()

    def _key(self, model: str) -> bytes:
        key = self._keys.get(model)
        if key is None:
            digest = hmac.new(self._secret, model.encode(), hashlib.sha256).hexdigest()
            key = self._keys[model] = (self.PREFIX + digest).encode()
        return key

    def model_of(self, authorization: str | None, names: Iterable[str]) -> str | None:
        """The model among `names` whose key the `Authorization` header holds, if any."""
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.startswith(self.PREFIX):
            return None
        found = None
        held = given.strip().encode()
        for name in names:  # each compared in constant time
            if hmac.compare_digest(self._key(name), held):
                found = name
        return found


def create_inference_app(backend: CpuBackend, keys: ModelKeys) -> FastAPI:
    app = FastAPI(title="Trainyard cpu backend inference")

    def holder(http: Request) -> str:
        """The model whose key the request holds; 401 in OpenAI's envelope without one."""
        model = keys.model_of(http.headers.get("authorization"), backend.served)
        if model is None:
            raise _UnauthorizedError
        return model

    @app.exception_handler(_UnauthorizedError)
    async def _unauthorized(_request: Any, _exc: Exception) -> JSONResponse:
        response = _error(401, "No key, or not a key of this endpoint.", "invalid_api_key")
        response.headers["www-authenticate"] = "Bearer"
        return response

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Any, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Any, exc: RequestValidationError) -> JSONResponse:
        problems = [
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
            for e in exc.errors()
        ]
        return _error(400, "; ".join(problems), "invalid_request")

    @app.get("/v1/models")
    def models(http: Request) -> dict[str, Any]:
        mine = holder(http)
        data = [
            {
                "id": backend._model_inference_name(model),
                "object": "model",
                "created": 0,
                "owned_by": "trainyard",
            }
            for name, (model, _) in backend.served.items()
            if name == mine
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: ChatRequest, http: Request) -> dict[str, Any] | JSONResponse:
        mine = holder(http)
        if request.stream:
            return _error(400, "The cpu backend does not stream: send `stream: false`.", "stream")
        try:
            messages = normalize_messages(request.messages)
            check_tools(request.tools)
        except ChatInvalid as exc:
            return _error(400, exc.message, exc.code)
        name, _, step = request.model.partition("@")
        entry = backend.served.get(name) if name == mine else None
        if entry is None or (step and not is_step(step)):
            return _error(404, f"The model `{request.model}` does not exist.", "model_not_found")
        try:
            ticket = backend.admission.admit(name, request.n * _max_tokens(request))
        except Refused as exc:
            return _saturated(str(exc), exc.retry_after)
        abandoned = threading.Event()
        work = asyncio.ensure_future(
            asyncio.to_thread(_serve, backend, entry, request, messages, ticket, abandoned)
        )
        try:
            # The caller may go away while its request waits or runs: then it stops.
            while not (await asyncio.wait({work}, timeout=DISCONNECT_POLL_S))[0]:
                if await http.is_disconnected():
                    abandoned.set()
                    break
            return await work
        except Abandoned:
            ticket.abandon()
            return _error(499, "The client closed the request.", "client_closed_request")
        finally:
            abandoned.set()  # also when this handler is cancelled (the server stops)
            if work.done():
                ticket.release()
            else:  # its thread releases it once it notices
                work.add_done_callback(lambda _: _settle(work, ticket))

    @app.exception_handler(Exception)
    async def _failed(_request: Any, exc: Exception) -> JSONResponse:
        # Never a text/plain traceback: OpenAI clients parse the envelope.
        return JSONResponse(
            {
                "error": {
                    "message": f"The cpu backend failed: {type(exc).__name__}: {exc}"[:2000],
                    "type": "server_error",
                    "code": "internal_error",
                }
            },
            status_code=500,
        )

    return app


DISCONNECT_POLL_S = 0.2


class LoadLoRA(BaseModel):
    """vLLM's `LoadLoRAAdapterRequest`."""

    lora_name: str = Field(min_length=1, max_length=512)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadLoRA(BaseModel):
    """vLLM's `UnloadLoRAAdapterRequest`."""

    lora_name: str = Field(min_length=1, max_length=512)
    lora_int_id: int | None = None


def _vllm_error(status: int, message: str) -> JSONResponse:
    """An error as vLLM's OpenAI server gives it (OpenAI's envelope, vLLM's types)."""
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


def create_pool_app(pool: AdapterPool) -> FastAPI:
    """A serving pool's endpoint (`trainyard serve-pool`): the base model and the adapters
    loaded by vLLM's runtime protocol, each served by its `lora_name`."""
    from fastapi.responses import PlainTextResponse

    from app.backends.lora_pool import AdapterRefused

    app = FastAPI(title="Trainyard serving pool")

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Any, exc: HTTPException) -> JSONResponse:
        return _vllm_error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Any, exc: RequestValidationError) -> JSONResponse:
        problems = [
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
            for e in exc.errors()
        ]
        return _vllm_error(400, "; ".join(problems))

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        base = {
            "id": pool.base_model,
            "object": "model",
            "created": 0,
            "owned_by": "trainyard",
            "root": pool.base_model,
            "parent": None,
        }
        adapters = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "trainyard",
                "root": adapter.source,
                "parent": pool.base_model,
            }
            for name, adapter in list(pool.adapters.items())
        ]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/load_lora_adapter", response_model=None)
    async def load(request: LoadLoRA) -> PlainTextResponse | JSONResponse:
        try:
            await asyncio.to_thread(
                pool.load, request.lora_name, request.lora_path, inplace=request.load_inplace
            )
        except AdapterRefused as exc:
            return _vllm_error(exc.status, exc.message)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_model=None)
    async def unload(request: UnloadLoRA) -> PlainTextResponse | JSONResponse:
        try:
            pool.unload(request.lora_name)
        except AdapterRefused as exc:
            return _vllm_error(exc.status, exc.message)
        return PlainTextResponse(
            f"Success: LoRA adapter '{request.lora_name}' removed successfully."
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: ChatRequest, http: Request) -> dict[str, Any] | JSONResponse:
        if request.stream:
            return _vllm_error(400, "This pool does not stream: send `stream: false`.")
        try:
            messages = normalize_messages(request.messages)
            check_tools(request.tools)
        except ChatInvalid as exc:
            return _vllm_error(400, exc.message)
        adapter = pool.adapters.get(request.model)
        if adapter is None and request.model != pool.base_model:
            return _vllm_error(404, f"The model `{request.model}` does not exist.")
        try:
            ticket = pool.admission.admit(pool.base_model, request.n * _max_tokens(request))
        except Refused as exc:
            return _saturated(str(exc), exc.retry_after)
        abandoned = threading.Event()

        def serve() -> dict[str, Any] | JSONResponse:
            policy = pool.policy(adapter)
            while not policy.lock.acquire(timeout=DISCONNECT_POLL_S):
                if abandoned.is_set():
                    raise Abandoned("the request was abandoned while it waited")
            try:
                ticket.start()
                try:
                    pool.ready(policy, adapter)
                except AdapterRefused as exc:
                    return _vllm_error(exc.status, exc.message)
                return _complete(policy, request, messages, request.model, abandoned.is_set)
            finally:
                policy.lock.release()

        work = asyncio.ensure_future(asyncio.to_thread(serve))
        try:
            while not (await asyncio.wait({work}, timeout=DISCONNECT_POLL_S))[0]:
                if await http.is_disconnected():
                    abandoned.set()
                    break
            return await work
        except Abandoned:
            ticket.abandon()
            return _vllm_error(499, "The client closed the request.")
        finally:
            abandoned.set()
            if work.done():
                ticket.release()
            else:
                work.add_done_callback(lambda _: _settle(work, ticket))

    @app.exception_handler(Exception)
    async def _failed(_request: Any, exc: Exception) -> JSONResponse:
        return _vllm_error(500, f"The pool failed: {type(exc).__name__}: {exc}"[:2000])

    return app


def _settle(work: asyncio.Future[Any], ticket: Ticket) -> None:
    if not work.cancelled() and isinstance(work.exception(), Abandoned):
        ticket.abandon()
    ticket.release()


def _max_tokens(request: ChatRequest) -> int:
    return request.max_completion_tokens or request.max_tokens or DEFAULT_MAX_TOKENS


def _saturated(message: str, retry_after: int) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "rate_limit_error", "code": "model_saturated"}},
        status_code=429,
        headers={"Retry-After": str(retry_after)},
    )


def _serve(
    backend: CpuBackend,
    entry: tuple[Any, Any],
    request: ChatRequest,
    messages: list[dict[str, Any]],
    ticket: Ticket,
    abandoned: threading.Event,
) -> dict[str, Any] | JSONResponse:
    """On a worker thread: wait for the model (a training step or another request holds
    it), then answer; stops with `Abandoned` once `abandoned` is set."""
    model, policy = entry
    name, _, step = request.model.partition("@")
    while not policy.lock.acquire(timeout=DISCONNECT_POLL_S):
        if abandoned.is_set():
            raise Abandoned("the request was abandoned while it waited")
    try:
        ticket.start()
        backend.sync(model, policy)
        latest = policy.loaded_step
        wanted = int(step) if step else latest
        if wanted == latest:
            return _complete(policy, request, messages, f"{name}@{latest}", abandoned.is_set)
        checkpoint = backend.checkpoint(model, wanted)
        if checkpoint is None:
            return _error(
                404,
                f"The model `{request.model}` does not exist: no checkpoint of step "
                f"{wanted} (the latest is `{name}@{latest}`).",
                "model_not_found",
            )
        # A past step: its adapter for this request, then the latest again.
        policy.load(checkpoint, wanted)
        try:
            return _complete(policy, request, messages, f"{name}@{wanted}", abandoned.is_set)
        finally:
            backend.sync(model, policy)
    finally:
        policy.lock.release()


def _complete(
    policy: Any,
    request: ChatRequest,
    messages: list[dict[str, Any]],
    served_name: str,
    abandoned: Callable[[], bool],
) -> dict[str, Any]:
    max_tokens = _max_tokens(request)
    stops = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    stop_ids = {
        int(i)
        for s in stops
        for i in policy.tokenizer(s, add_special_tokens=False)["input_ids"][:1]
    }
    tools = request.tools if request.tool_choice != "none" else None
    prompt = policy.encode_prompt(messages, request.tools)
    samples = policy.sample(
        prompt,
        n=request.n,
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_logprobs=request.top_logprobs or 0,
        stop_ids=stop_ids,
        seed=request.seed,
        abandoned=abandoned,
    )
    choices = []
    for index, sample in enumerate(samples):
        text_ids = [t for t in sample.token_ids if t != policy.eos_id and t not in stop_ids]
        text = policy.tokenizer.decode(text_ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish_reason = sample.finish_reason
        if tools:
            content, calls = parse_tool_calls(text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish_reason = "tool_calls"
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "finish_reason": finish_reason,
            "logprobs": None,
        }
        if request.logprobs:
            choice["logprobs"] = {
                "content": [
                    {
                        **_token(policy, token, logprob),
                        "top_logprobs": [_token(policy, t, lp) for t, lp in top],
                    }
                    for token, logprob, top in zip(
                        sample.token_ids, sample.logprobs, sample.top_logprobs, strict=True
                    )
                ],
                "refusal": None,
            }
        choices.append(choice)
    completion_tokens = sum(len(s.token_ids) for s in samples)
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt) + completion_tokens,
        },
    }


def _token(policy: Any, token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "token": f"token_id:{token_id}",
        "logprob": logprob,
        "bytes": list(policy.token_text(token_id).encode()),
    }


class _Protocol(HttpToolsProtocol):
    """uvicorn's protocol without access lines: the access logger is the API server's too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.access_log = False


class InferenceServer:
    """uvicorn in a daemon thread; `start` returns once it listens.

    It leaves logging alone: uvicorn's loggers are process-wide, and a `log_level` or
    `log_config` here would reset those of the API's own server (whose access log would go
    silent once a model is served)."""

    def __init__(self, backend: CpuBackend, *, host: str, port: int) -> None:
        self.keys = ModelKeys()
        config = uvicorn.Config(
            create_inference_app(backend, self.keys),
            host=host,
            port=port,
            http=_Protocol,
            log_config=None,
            log_level=None,
            lifespan="off",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="cpu-inference", daemon=True)
        self.base_url = ""

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the cpu backend's inference server did not start")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.base_url = f"http://{host}:{port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
