"""The `cpu` backend's OpenAI-compatible endpoint: `/v1/models` and `/v1/chat/completions`
with logprobs (tokens as `token_id:N`, as ART's vLLM returns them), for every registered
model as `name@step` of its latest adapter.

It runs in its own thread with its own event loop, so sampling never stalls the service.
It binds loopback by default and checks no key (the key it hands out is a placeholder).
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from app.backends.cpu import CpuBackend


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send more; ignore the rest

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1, le=1024)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1024)
    n: int = Field(default=1, ge=1, le=64)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stop: str | list[str] | None = None
    seed: int | None = None


def _error(status: int, message: str, code: str) -> JSONResponse:
    # OpenAI's error envelope, which OpenAI clients parse.
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": code}},
        status_code=status,
    )


def create_inference_app(backend: CpuBackend) -> FastAPI:
    app = FastAPI(title="Trainyard cpu backend inference")

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Any, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "error")

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        data = [
            {
                "id": backend._model_inference_name(model),
                "object": "model",
                "created": 0,
                "owned_by": "trainyard",
            }
            for model, _ in backend.served.values()
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions", response_model=None)
    def chat(request: ChatRequest) -> dict[str, Any] | JSONResponse:
        name, _, step = request.model.partition("@")
        entry = backend.served.get(name)
        if entry is None:
            return _error(404, f"The model `{request.model}` does not exist.", "model_not_found")
        model, policy = entry
        with policy.lock:  # waits while a training step runs, like ART's shared GPU
            backend.sync(model, policy)
            latest = policy.loaded_step
            if step and step != str(latest):
                return _error(
                    404,
                    f"Only the latest step of `{name}` is served: `{name}@{latest}`.",
                    "model_not_found",
                )
            return _complete(policy, request, f"{name}@{latest}")

    return app


def _complete(policy: Any, request: ChatRequest, served_name: str) -> dict[str, Any]:
    max_tokens = request.max_completion_tokens or request.max_tokens or 64
    stops = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    stop_ids = {
        int(i)
        for s in stops
        for i in policy.tokenizer(s, add_special_tokens=False)["input_ids"][:1]
    }
    prompt = policy.encode_prompt(request.messages)
    samples = policy.sample(
        prompt,
        n=request.n,
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_logprobs=request.top_logprobs or 0,
        stop_ids=stop_ids,
        seed=request.seed,
    )
    choices = []
    for index, sample in enumerate(samples):
        text_ids = [t for t in sample.token_ids if t != policy.eos_id and t not in stop_ids]
        choice: dict[str, Any] = {
            "index": index,
            "message": {
                "role": "assistant",
                "content": policy.tokenizer.decode(text_ids, skip_special_tokens=True),
            },
            "finish_reason": sample.finish_reason,
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


class InferenceServer:
    """uvicorn in a daemon thread; `start` returns once it listens."""

    def __init__(self, backend: CpuBackend, *, host: str, port: int) -> None:
        config = uvicorn.Config(
            create_inference_app(backend), host=host, port=port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="cpu-inference", daemon=True)
        self.api_key = "trainyard-cpu"
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
