"""The interactive API docs (Swagger UI at /docs, ReDoc at /redoc), served with their
scripts, styles and icon from this process: no page of the service loads anything from a
CDN. The assets are the ones the `fastapi-offline` package ships (Swagger UI 5, which reads
OpenAPI 3.1, and ReDoc)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import FileResponse, HTMLResponse

DOCS = "/docs"
REDOC = "/redoc"
OAUTH2_REDIRECT = "/docs/oauth2-redirect"
ASSETS = {
    "swagger-ui-bundle.js": "/docs/swagger-ui-bundle.js",
    "swagger-ui.css": "/docs/swagger-ui.css",
    "redoc.standalone.js": "/docs/redoc.standalone.js",
    "favicon.png": "/docs/favicon.png",
}
PATHS = frozenset({DOCS, REDOC, OAUTH2_REDIRECT, *ASSETS.values()})
"""Every path this router serves: open without an API key, like the OpenAPI document."""

_STATIC = Path(str(files("fastapi_offline") / "static"))


def router(app: FastAPI) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    openapi_url = app.openapi_url or "/openapi.json"

    @router.get(DOCS)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=OAUTH2_REDIRECT,
            swagger_js_url=ASSETS["swagger-ui-bundle.js"],
            swagger_css_url=ASSETS["swagger-ui.css"],
            swagger_favicon_url=ASSETS["favicon.png"],
            # No badge from the online validator: the page talks to this service only.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @router.get(OAUTH2_REDIRECT)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @router.get(REDOC)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=ASSETS["redoc.standalone.js"],
            redoc_favicon_url=ASSETS["favicon.png"],
            with_google_fonts=False,
        )

    for name, path in ASSETS.items():
        router.add_api_route(path, _asset(_STATIC / name), methods=["GET"], name=f"docs-{name}")
    return router


def _asset(file: Path) -> Callable[[], Awaitable[FileResponse]]:
    async def asset() -> FileResponse:
        return FileResponse(file)

    return asset
