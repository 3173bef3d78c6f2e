"""The dashboard: a static page and a few small scripts, served by the API itself at
/dashboard/ (see docs/dashboard.md). The files hold no data: every figure they show comes
from the `/v1` JSON API, fetched by the page with the key the person enters. So they are
open without a key, like the API docs, and are never listed in the OpenAPI document."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from importlib.resources import files

from fastapi import APIRouter, Request, Response

PREFIX = "/dashboard"
TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "base.js": "text/javascript; charset=utf-8",
    "compare.js": "text/javascript; charset=utf-8",
    "chart.js": "text/javascript; charset=utf-8",
    "usage.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
PATHS = frozenset({PREFIX, f"{PREFIX}/", *(f"{PREFIX}/{name}" for name in TYPES)})
"""Every path this router serves: open without an API key."""

# Scripts and styles from this origin only: no inline script or style (a job's metadata,
# which the page shows, is attacker-controlled), no frames, no plugins, no <base>.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    # Revalidated on every load (a 304 by ETag): an upgrade never leaves a stale script
    # beside a new page.
    "Cache-Control": "no-cache",
}


def _read(name: str) -> tuple[bytes, str]:
    content = (files(__package__) / "static" / name).read_bytes()
    return content, '"' + hashlib.sha256(content).hexdigest()[:32] + '"'


def router() -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get(PREFIX, name="dashboard-redirect")
    async def redirect() -> Response:
        # Relative, so it holds behind a proxy's path prefix and never names a Host.
        return Response(status_code=308, headers={**HEADERS, "Location": "dashboard/"})

    router.add_api_route(f"{PREFIX}/", _file("index.html"), methods=["GET"], name="dashboard")
    for name in TYPES:
        router.add_api_route(
            f"{PREFIX}/{name}", _file(name), methods=["GET"], name=f"dashboard-{name}"
        )
    return router


def _file(name: str) -> Callable[[Request], Awaitable[Response]]:
    content, etag = _read(name)
    headers = {**HEADERS, "ETag": etag}

    async def serve(request: Request) -> Response:
        if etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers=headers)
        return Response(content, media_type=TYPES[name], headers=headers)

    return serve
