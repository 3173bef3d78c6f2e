"""One OpenAI-compatible endpoint for every served model, under the API's own origin and
keys (`/openai/v1`): a client names `name` (the latest step), `name@latest`, `name@N` or
`name@alias` (`best`, or an alias set on the model), and the gateway forwards the request
to whichever backend serves that step (the cpu backend's server, ART's vLLM on a GPU host)
as `name@N`. Its errors use OpenAI's envelope, which OpenAI clients parse.

Where a step is served: in a process that runs a worker, the worker's own backend says
(so a restarted process never routes to the previous process's port); an API-only
replica reads the endpoint the serving worker recorded on the model's row.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy.ext.asyncio import AsyncSession

from app.backends import SPECS, Backends
from app.backends.admission import Admission, Refused
from app.backends.base import ModelSpec, classify
from app.backends.checkpoints import CheckpointDirs
from app.backends.openai_chat import is_step
from app.backends.serving_pools import PoolRefused, PoolRouter
from app.checkpoints import service as checkpoints
from app.models import ModelRow
from app.schemas.checkpoints import ALIAS_PATTERN

PREFIX = "/openai/v1"
# Backends whose steps a serving pool loads: their checkpoints lie in Trainyard's storage
# (`app.backends.checkpoints`). ART's keep their own serving (an external vLLM included).
POOLED = frozenset({"cpu"})
LATEST = "latest"
MAX_STEP = 2**31 - 1
# Hop-by-hop and length headers are the gateway's own to set.
_DROPPED = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


class GatewayError(Exception):
    """An error in OpenAI's envelope: `{"error": {"message", "type", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        kind: str = "invalid_request_error",
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else None
        body = {"error": {"message": self.message, "type": self.kind, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


@dataclass(frozen=True)
class Route:
    """Where one requested model name is served."""

    base_url: str
    model_name: str  # the name the serving endpoint knows the step by
    api_key: str | None
    step: int
    pool: str | None = None  # the base model whose serving pool serves it
    lora_path: str | None = None  # where the pool loads the step's adapter from
    spec: ModelSpec | None = None
    backend: str | None = None


# A Tinker path (`app.tinker`), which the gateway also takes as `model`.
TINKER_SCHEME = "tinker://"


def gateway_model(path: str) -> tuple[str, str] | None:
    """The gateway's (model, selector) for a Tinker path given as `model`:
    `tinker://<run>/sampler_weights/<name>` is `<run>@<name>`, `tinker://<run>/weights/<name>`
    `<run>@state-<name>`, and an unnamed step as the listing shows it (`<step:06d>`)
    `<run>@<step>`. None: not a tinker:// path; a malformed one gives `(path, "")`, which
    names no model."""
    if not path.startswith(TINKER_SCHEME):
        return None
    parts = path.removeprefix(TINKER_SCHEME).split("/")
    if len(parts) != 3 or parts[1] not in ("sampler_weights", "weights") or not parts[2]:
        return path, ""
    run, kind, label = parts
    if re.fullmatch(r"[0-9]{6}", label):
        return run, str(int(label))
    return run, label if kind == "sampler_weights" else f"state-{label}"


def parse_model(requested: str) -> tuple[str, str]:
    """`name`, `name@latest`, `name@N`, `name@alias` -> (name, selector). `name@` (an
    empty selector) is refused, not read as the latest. A Tinker path
    (`tinker://<run>/sampler_weights/<name>`) names its run's step the same way."""
    tinker = gateway_model(requested)
    if tinker is not None:
        name, selector = tinker
        if not selector:
            raise GatewayError(
                404,
                f"The model `{requested}` does not exist: a Tinker path is "
                "`tinker://<run>/sampler_weights/<name>` or `tinker://<run>/weights/<name>`.",
                "model_not_found",
            )
        return name, selector
    name, at, selector = requested.partition("@")
    if at and not selector:
        raise GatewayError(
            404,
            f"The model `{requested}` does not exist: after `@` give a step number, "
            f"`{LATEST}` or an alias.",
            "model_not_found",
        )
    return name, selector or LATEST


def served_names(row: ModelRow) -> list[str]:
    """The names the gateway accepts for a model now."""
    return [row.name, f"{row.name}@{LATEST}", f"{row.name}@{row.current_step}"]


class Gateway:
    def __init__(
        self,
        backends: Backends,
        *,
        serves_here: bool,
        timeout: float = 600.0,
        admission: Admission | None = None,
    ) -> None:
        """`serves_here`: this process runs a worker, whose backends serve its models.
        `admission`: the bound on work forwarded per model (`app.backends.admission`)."""
        self.backends = backends
        self.serves_here = serves_here
        self._timeout = timeout
        self.admission = admission or Admission()
        self.pools = PoolRouter(backends.settings.serving_pools)

    def admit(self, model: str, tokens: int) -> Any:
        """A ticket for `tokens` of work on `model`, or a 429 `GatewayError`."""
        try:
            ticket = self.admission.admit(model, tokens)
        except Refused as exc:
            raise GatewayError(
                429,
                str(exc),
                "model_saturated",
                kind="rate_limit_error",
                retry_after=exc.retry_after,
            ) from exc
        ticket.start()
        return ticket

    @functools.cached_property
    def client(self) -> httpx.AsyncClient:
        """Made on first use: its TLS context loads the CA bundle, a tenth of a second that
        a process's start need not wait for."""
        return httpx.AsyncClient(
            timeout=httpx.Timeout(self._timeout, connect=10.0),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            follow_redirects=False,
        )

    async def close(self) -> None:
        if "client" in self.__dict__:
            await self.client.aclose()

    async def resolve(self, session: AsyncSession, requested: str) -> Route:
        name, selector = parse_model(requested)
        row = await session.get(ModelRow, name) if name else None
        if row is None:
            raise GatewayError(404, f"The model `{requested}` does not exist.", "model_not_found")
        if not SPECS[row.backend].serves:
            raise GatewayError(
                404,
                f"The model `{name}` is on backend `{row.backend}`, which serves no endpoint.",
                "model_not_served",
            )
        step = await self._step(session, row, selector, requested)
        if row.backend in POOLED and self.pools.pool_of(row.base_model) is not None:
            return self._pool_route(row, step)
        if self.serves_here:
            spec = ModelSpec(row.name, row.project, row.base_model, row.config)
            try:
                adapter = self.backends.get(row.backend)
                inference = await adapter.inference(spec, step=step)
                api_key = (await adapter.model(spec)).inference_api_key
            except Exception as exc:
                error = classify(exc)
                if not error.transient:  # it will not be served here: say why
                    raise GatewayError(
                        404, f"The model `{name}` cannot be served: {error}", "model_not_served"
                    ) from exc
                raise _unavailable(name, str(error)) from exc
            base_url, model_name = inference.base_url, inference.model_name
        else:
            base_url, model_name = row.inference_base_url, f"{name}@{step}"
            api_key = row.inference_api_key  # the worker that serves it wrote both
        if not base_url:
            raise _unavailable(name, "its endpoint is starting")
        return Route(base_url.rstrip("/"), model_name, api_key, step)

    def _pool_route(self, row: ModelRow, step: int) -> Route:
        spec = ModelSpec(row.name, row.project, row.base_model, row.config)
        dirs = self.backends.get(row.backend).backend
        assert isinstance(dirs, CheckpointDirs)  # as every backend in POOLED
        name = f"{row.name}@{step}"
        return Route(
            "", name, None, step, row.base_model, dirs.location(spec, step), spec, row.backend
        )

    async def _gone(self, route: Route, prefix: str) -> set[str]:
        """The names `prefix` + step of the route's model whose steps storage lost."""
        assert route.spec is not None and route.backend is not None
        dirs = self.backends.get(route.backend).backend
        assert isinstance(dirs, CheckpointDirs)  # as `_pool_route` checked
        steps = await asyncio.to_thread(dirs.steps, route.spec)
        loaded = {
            int(n.removeprefix(prefix))
            for held in self.pools.loaded.values()
            for n in held
            if n.startswith(prefix) and is_step(n.removeprefix(prefix))
        }
        return {f"{prefix}{step}" for step in loaded - set(steps)}

    async def _forward_pool(self, route: Route, path: str, body: dict[str, Any]) -> Response:
        """Serve from the route's pool: replicas by affinity, the adapter loaded on a miss,
        an unreachable replica skipped."""
        assert route.pool is not None and route.lora_path is not None
        failures = []
        for replica in self.pools.order(route.pool, route.model_name):
            for attempt in range(2):
                try:
                    await self.pools.ensure(
                        self.client,
                        replica,
                        route.model_name,
                        route.lora_path,
                        gone=functools.partial(self._gone, route),
                    )
                    response = await self.forward(replace(route, base_url=replica), path, body)
                except PoolRefused as exc:
                    status = exc.status if exc.status in (400, 404) else 502
                    raise GatewayError(
                        404 if status == 404 else status,
                        f"The pool of `{route.pool}` cannot load `{route.model_name}`: "
                        f"{exc.message}",
                        "model_not_found" if status == 404 else "upstream_error",
                        kind="invalid_request_error" if status < 500 else "server_error",
                    ) from exc
                except httpx.HTTPError as exc:  # its load: unreachable
                    self.pools.dead(replica)
                    failures.append(f"{replica}: {type(exc).__name__}: {exc}")
                    break
                except GatewayError as exc:
                    if exc.code != "model_unavailable":
                        raise
                    self.pools.dead(replica)  # unreachable for the request itself
                    failures.append(f"{replica}: {exc.message}")
                    break
                self.pools.alive(replica)
                if response.status_code == 404 and attempt == 0:
                    # The replica lost the adapter (it restarted): load it again, once.
                    self.pools.forget(replica, route.model_name)
                    continue
                return response
        raise _unavailable(route.model_name, "; ".join(failures) or "no replica")

    async def _step(
        self, session: AsyncSession, row: ModelRow, selector: str, requested: str
    ) -> int:
        """The step a selector names: `latest`, a step number, or an alias (`best`, or
        one the user set: `app.checkpoints`)."""
        if selector == LATEST:
            return row.current_step
        if is_step(selector) and int(selector) <= MAX_STEP:
            step = int(selector)
            if step > row.current_step:
                raise GatewayError(
                    404,
                    f"The model `{requested}` does not exist: `{row.name}` is at step "
                    f"{row.current_step}.",
                    "model_not_found",
                )
            return step
        aliased = None
        if re.fullmatch(ALIAS_PATTERN, selector):
            aliased = await checkpoints.resolve_alias(session, self.backends, row, selector)
        if aliased is None:
            raise GatewayError(
                404,
                f"The model `{requested}` does not exist: after `@` give a step number, "
                f"`{LATEST}` or an alias of `{row.name}`.",
                "model_not_found",
            )
        return aliased

    async def forward(self, route: Route, path: str, body: dict[str, Any]) -> Response:
        """POST `body` (its `model` replaced by the served name) to the route's endpoint;
        a streamed answer is relayed as it arrives."""
        if route.pool is not None and not route.base_url:
            return await self._forward_pool(route, path, body)
        headers = {"content-type": "application/json"}
        if route.api_key:
            headers["authorization"] = f"Bearer {route.api_key}"
        request = self.client.build_request(
            "POST",
            f"{route.base_url}{path}",
            content=json.dumps({**body, "model": route.model_name}).encode(),
            headers=headers,
        )
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _unavailable(route.model_name, f"{type(exc).__name__}: {exc}") from exc
        relayed = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(
                _relay(upstream), status_code=upstream.status_code, headers=relayed
            )
        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            raise _unavailable(route.model_name, f"{type(exc).__name__}: {exc}") from exc
        finally:
            await upstream.aclose()
        if upstream.status_code >= 400 and not _is_envelope(content):
            raise _upstream_failed(route.model_name, upstream.status_code, content)
        return Response(content, status_code=upstream.status_code, headers=relayed)


def _is_envelope(content: bytes) -> bool:
    try:
        parsed = json.loads(content)
    except (ValueError, RecursionError):
        return False
    return isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)


def _upstream_failed(name: str, status: int, content: bytes) -> GatewayError:
    """An error answer that is not OpenAI's envelope (text, HTML, a traceback): the client
    gets the envelope, with the start of what the endpoint said."""
    text = content[:2000].decode("utf-8", "replace").strip().splitlines()
    said = text[-1][:300] if text else "no detail"
    if status >= 500 or status < 400:
        return GatewayError(
            502,
            f"The endpoint serving `{name}` failed (HTTP {status}: {said}).",
            "upstream_error",
            kind="server_error",
        )
    return GatewayError(
        status, f"The endpoint serving `{name}` refused the request: {said}", "upstream_error"
    )


async def _relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()


def _unavailable(name: str, why: str) -> GatewayError:
    return GatewayError(
        503,
        f"The endpoint serving `{name}` is not reachable right now ({why}); try again.",
        "model_unavailable",
        kind="server_error",
        retry_after=1,
    )
