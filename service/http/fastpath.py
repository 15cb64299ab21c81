"""The fast path: `POST /v2/models/{m}[/versions/{v}]/infer` and `/v1/embeddings` answered by a
raw-ASGI handler ahead of FastAPI, its middleware stack and its router, calling the same
endpoints.

Per request it skips the router's matching, FastAPI's and Starlette's per-request wrappers and
the middleware layers' closures, and does their work inline: the request id and its access-log
line (RequestContext), the header limit, the API key, the body-rate rule (BodyRate), slicing and
budgeting of large responses (ResponseBackpressure), ServiceError -> the protocol's error body.
Anything it does not answer itself goes the regular way, unchanged: another route or method, a
refused header block or API key (the regular path answers 401/403/431), a CORS request, an app
still loading. An unexpected exception is logged and answered 500 with the app's own handler
code, then re-raised, as Starlette's ServerErrorMiddleware does. `--no-fast-path` turns it off
(the benchmarks compare both).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request

from service.http.flow import (
    SLICE_BYTES,
    BodyRate,
    ResponseBackpressure,
    ResponseBudget,
    TimedReceive,
)
from service.http.middleware import ApiKeyAuth, RequestContext, first_header, request_id
from service.http.routes import embeddings, infer
from service.http.routes.common import error_response, internal_error_response
from service.pipeline.errors import ServiceError
from service.runtime.settings import Settings

Scope = dict[str, Any]
ASGIApp = Any

EMBEDDINGS = "/v1/embeddings"


def infer_route(path: str) -> tuple[str, str | None] | None:
    """(model, version or None) when `path` is exactly an infer route, as the router matches
    it (`{model_name}` and `{model_version}` are one non-empty path segment each)."""
    if not path.startswith("/v2/models/") or not path.endswith("/infer"):
        return None
    parts = path.split("/")  # "", "v2", "models", m, ["versions", v,] "infer"
    if len(parts) == 5 and parts[3]:
        return parts[3], None
    if len(parts) == 7 and parts[3] and parts[4] == "versions" and parts[5]:
        return parts[3], parts[5]
    return None


class FastPathApp(FastAPI):
    """The app with its fast path ahead of everything FastAPI and Starlette do per request
    (scope set-up, the error and telemetry middlewares, the body limit): with `fast_path` set
    every request goes to it first, and what it does not take to `regular`."""

    fast_path: FastPath | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if self.fast_path is None:
            await super().__call__(scope, receive, send)
        else:
            scope["app"] = self  # as Starlette sets it: routes find the state through it
            await self.fast_path(scope, receive, send)

    async def regular(self, scope: Scope, receive: Any, send: Any) -> None:
        """The regular path: FastAPI's own handling, middleware stack and router."""
        await super().__call__(scope, receive, send)


class FastPath:
    """Answers the hot routes itself and passes the rest to `app` (the regular path)."""

    def __init__(
        self, app: ASGIApp, settings: Settings, budget: ResponseBudget, sampling: Any
    ) -> None:
        self.app = app
        self.header_limit = settings.max_header_bytes
        self.cors = bool(settings.cors_origins)
        key = settings.api_key
        self.auth = None if key is None else ApiKeyAuth(None, key.get_secret_value(), False)
        self.body_rate = BodyRate(None, settings.body_timeout_s, settings.body_min_rate)
        self.context = RequestContext(None, sampling)  # the live access-log sample rate
        self.budget = budget
        self.answered = 0  # requests this path answered itself (the parity tests check it)

    def _takes(self, scope: Scope) -> bool:
        """Whether this request is the fast path's: the rest (refusals included) goes on."""
        size = 0
        for key, value in scope["headers"]:
            size += len(key) + len(value) + 4
            if key == b"origin" and self.cors:
                return False  # CORSMiddleware's headers: the regular path
        if size > self.header_limit or scope.get("root_path"):
            return False
        if self.auth is not None and self.auth.refusal(scope) is not None:
            return False
        return getattr(scope["app"].state, "service", None) is not None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = None if path == EMBEDDINGS else infer_route(path)
        if (route is None and path != EMBEDDINGS) or not self._takes(scope):
            await self.app(scope, receive, send)
            return
        self.answered += 1
        rid = request_id(first_header(scope, b"x-request-id"))
        scope.setdefault("state", {})["request_id"] = rid
        started = time.perf_counter()
        status = 500
        timed = None
        if self.body_rate.applies(scope):
            timed = receive = TimedReceive(receive, self.body_rate.grace_s, self.body_rate.min_rate)
        try:
            request = Request(scope, receive)
            try:
                if route is None:
                    response = await embeddings.embeddings(request)
                else:
                    response = await infer.infer(request, *route)
            except ServiceError as exc:
                response = error_response(path, exc)
            except Exception:  # as Starlette's ServerErrorMiddleware: log, answer 500, re-raise
                await self._send(internal_error_response(path), scope, receive, send, rid)
                raise
            status = await self._send(response, scope, receive, send, rid)
        finally:
            if timed is not None:
                timed.stop()
            self.context.done(scope, rid, status, started)

    async def _send(self, response: Any, scope: Scope, receive: Any, send: Any, rid: str) -> int:
        """Send `response` with the request id (as RequestContext adds it); returns the status
        that went out."""
        rid_header = (b"x-request-id", rid.encode())
        if int(_length(response)) > SLICE_BYTES:
            return await self._send_large(response, scope, receive, send, rid_header)
        response.raw_headers.append(rid_header)
        await response(scope, receive, send)
        return response.status_code

    async def _send_large(
        self, response: Any, scope: Scope, receive: Any, send: Any, rid_header: tuple
    ) -> int:
        """A large response through ResponseBackpressure (sliced, or 503 past the budget);
        returns the status that went out."""
        status = 500

        async def seen(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message["headers"], rid_header]}
            await send(message)

        await ResponseBackpressure(response, self.budget)(scope, receive, seen)
        return status


def _length(response: Any) -> bytes:
    for key, value in response.raw_headers:
        if key == b"content-length":
            return value
    return b"0"
