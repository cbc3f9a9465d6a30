"""The API's pages, served with no network beyond this server: Swagger UI at ``/docs`` and
ReDoc at ``/redoc``, their JavaScript, CSS and favicon read from the ``fastapi-offline``
package (which ships Swagger UI 5 and ReDoc 2 dist files) and served under ``/docs/assets``.
FastAPI's own pages load them from a CDN, so on a closed network they stay blank."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS_URL = "/docs/assets"
ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"
SWAGGER_JS, SWAGGER_CSS, REDOC_JS, FAVICON = (
    "swagger-ui-bundle.js",
    "swagger-ui.css",
    "redoc.standalone.js",
    "favicon.png",
)
# What a browser fetches for /docs: the API key middleware exempts these with /docs.
SWAGGER_ASSET_PATHS = tuple(f"{ASSETS_URL}/{name}" for name in (SWAGGER_JS, SWAGGER_CSS, FAVICON))

router = APIRouter(include_in_schema=False)


def _urls(request: Request) -> tuple[str, str]:
    """(the OpenAPI schema's URL, the assets' URL prefix), behind any proxy ``root_path``."""
    root = request.scope.get("root_path", "").rstrip("/")
    return f"{root}{request.app.openapi_url}", f"{root}{ASSETS_URL}"


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI over ``/openapi.json``, from local assets."""
    openapi, assets = _urls(request)
    return get_swagger_ui_html(
        openapi_url=openapi,
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=f"{assets}/{SWAGGER_JS}",
        swagger_css_url=f"{assets}/{SWAGGER_CSS}",
        swagger_favicon_url=f"{assets}/{FAVICON}",
        oauth2_redirect_url=None,
    )


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    """ReDoc over ``/openapi.json``, from local assets (no web fonts)."""
    openapi, assets = _urls(request)
    return get_redoc_html(
        openapi_url=openapi,
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{assets}/{REDOC_JS}",
        redoc_favicon_url=f"{assets}/{FAVICON}",
        with_google_fonts=False,
    )


def install_docs(app: FastAPI) -> None:
    """Serve the pages and their assets; build ``app`` with ``docs_url=None, redoc_url=None``."""
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS_DIR), name="docs-assets")
    app.include_router(router)
