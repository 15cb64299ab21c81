"""In-process ASGI client for protocol and validation tests: the real app, lifespan included."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from service.app import create_app
from service.runtime.settings import Settings


@contextlib.asynccontextmanager
async def asgi_client(**settings: object) -> AsyncIterator[httpx.AsyncClient]:
    """The app of `Settings(**settings)` with its lifespan run, ready, behind an httpx client."""
    app = create_app(Settings(**settings))
    async with app.router.lifespan_context(app):
        state = app.state.service
        for _ in range(600):  # warm-up runs real batches; ready in well under a second
            if state.ready:
                break
            await asyncio.sleep(0.01)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client
