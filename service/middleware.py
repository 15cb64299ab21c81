"""Pure-ASGI middleware: request ids with one access-log line per request, and the API key.

Pure ASGI (not BaseHTTPMiddleware) so binary bodies stream through untouched and the per-request
cost stays a few microseconds.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
import uuid
from typing import Any

import orjson

access_log = logging.getLogger("service.access")

Scope = dict[str, Any]
ASGIApp = Any

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class RequestContext:
    """Gives each request an id (the client's `X-Request-ID` when sane, else a new one), echoes
    it in the response, and logs method, path, status and duration under it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        request_id = given if given and _SAFE_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            access_log.info(
                "%s %s %d",
                scope["method"],
                scope["path"],
                status,
                extra={
                    "request_id": request_id,
                    "status": status,
                    "duration_ms": round((time.perf_counter() - started) * 1000, 3),
                    "method": scope["method"],
                    "path": scope["path"],
                },
            )


class HeaderLimit:
    """431 for a request whose header block is over `limit` bytes. uvicorn's httptools parser
    has no limit of its own, so this bounds what reaches the app (a proxy in front, e.g. nginx's
    large_client_header_buffers, bounds it before parsing)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
            if size > self.limit:
                message = f"request headers are {size} bytes, over the limit of {self.limit}"
                await _reject(send, 431, message + " (--max-header-bytes)")
                return
        await self.app(scope, receive, send)


class ApiKeyAuth:
    """`Authorization: Bearer <key>` on every route except the open ones (constant-time compare).

    Debug routes are left to their own token (--debug-token), so one header never has to carry
    two secrets.
    """

    def __init__(self, app: ASGIApp, api_key: str, open_health_metrics: bool) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_prefixes = ("/docs", "/openapi.json") + (
            ("/v2/health/", "/metrics") if open_health_metrics else ()
        )

    def _is_open(self, path: str) -> bool:
        if path.startswith(self.open_prefixes):
            return True
        if path == "/debug" or path.startswith("/debug/assets/"):
            return True  # the debug page: static files a browser loads without a header
        if path == "/debug/info":
            return True  # the page's model facts: a debug route, behind --debug-token
        return path.startswith("/v2/models/") and path.endswith(("/attention", "/heads"))

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self._is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization")
        if given is None:
            await _reject(send, 401, "missing 'Authorization: Bearer <api key>' header")
        elif not secrets.compare_digest(given.encode(), self.expected):
            await _reject(send, 403, "wrong API key")
        else:
            await self.app(scope, receive, send)


async def _reject(send: Any, status: int, message: str) -> None:
    body = orjson.dumps({"error": message})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="mha-serve"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
