"""/docs: Swagger UI from files shipped in the `swagger-ui-bundle-v2` wheel, so it works offline.

FastAPI's default /docs page loads Swagger UI from a CDN (blank on an air-gapped cluster); this
serves the same page with the JS, CSS and icon under /docs/assets. (ReDoc, also CDN-only, is off.)
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

ASSETS = "/docs/assets"


def install(app: FastAPI) -> None:
    """Serve GET /docs and its assets; the app must be created with docs_url=None."""
    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - API docs",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
        )
