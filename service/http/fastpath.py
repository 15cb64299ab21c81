"""The fast path: `POST /v2/models/{m}[/versions/{v}]/infer`, `/v1/embeddings` and TEI's
`/embed`, `/rerank`, `/predict` and `/` answered by a raw-ASGI handler ahead of FastAPI, its
middleware stack and its router, calling the same endpoints.

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
from service.http.middleware import ApiKeyAuth, RequestContext, request_id
from service.http.routes import embeddings, infer, tei, tei_rank
from service.http.routes.common import error_response, internal_error_response
from service.pipeline.errors import ServiceError
from service.runtime.settings import Settings
from service.runtime.tracing import TRACED

Scope = dict[str, Any]
ASGIApp = Any

EMBEDDINGS = "/v1/embeddings"
ENDPOINTS = {  # path -> endpoint (Request -> Response); TEI's routes at the root only
    EMBEDDINGS: embeddings.embeddings,
    "/embed": tei.embed,
    "/rerank": tei_rank.rerank,
    "/predict": tei_rank.predict,
    "/": tei.root,
}


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

    def _takes(self, scope: Scope) -> tuple[bytes | None, bool] | None:
        """Whether this request is the fast path's (None: the rest, refusals included, go on);
        if it is, its X-Request-ID and whether a body follows, from the same pass over its
        headers (what first_header and BodyRate.applies would find)."""
        size = 0
        given = None
        body = False
        for key, value in scope["headers"]:
            size += len(key) + len(value) + 4
            if key == b"x-request-id":
                if given is None:
                    given = value
            elif key == b"content-length":
                body = body or value != b"0"
            elif key == b"transfer-encoding":
                body = True
            elif key == b"origin" and self.cors:
                return None  # CORSMiddleware's headers: the regular path
        if size > self.header_limit or scope.get("root_path"):
            return None
        if self.auth is not None and self.auth.refusal(scope) is not None:
            return None
        if getattr(scope["app"].state, "service", None) is None:
            return None
        return given, body

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        TRACED.set(None)  # as RequestContext: not the trace of the request before on the socket
        path = scope["path"]
        endpoint = ENDPOINTS.get(path)
        route = None if endpoint is not None else infer_route(path)
        taken = None if route is None and endpoint is None else self._takes(scope)
        if taken is None:
            await self.app(scope, receive, send)
            return
        self.answered += 1
        given, has_body = taken
        rid = request_id(None if given is None else given.decode("latin-1"))
        started = time.perf_counter()
        values = scope.setdefault("state", {})
        values["request_id"], values["started"] = rid, started
        status = 500
        timed = None
        if has_body and self.body_rate.min_rate > 0:  # BodyRate.applies
            timed = receive = TimedReceive(receive, self.body_rate.grace_s, self.body_rate.min_rate)
        try:
            request = Request(scope, receive)
            try:
                if route is None:
                    response = await endpoint(request)
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
        size = getattr(response, "size", None)  # PartsResponse knows its length
        if (int(_length(response)) if size is None else size) > SLICE_BYTES:
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
