"""Pure-ASGI middleware: request ids with an access-log line per request (sampled if asked), the
header limit, HEAD on GET routes, and the API key.

Pure ASGI (not BaseHTTPMiddleware) so binary bodies stream through untouched and the per-request
cost stays a few microseconds.
"""

from __future__ import annotations

import itertools
import logging
import random
import re
import secrets
import time
from typing import Any

import orjson

from service.pipeline.errors import error_body
from service.runtime.tracing import TRACED, Trace

access_log = logging.getLogger("service.access")

Scope = dict[str, Any]
ASGIApp = Any

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\\]")


def log_safe(text: str) -> str:
    """`text` with control characters (and backslashes) escaped, so a client-supplied value
    (a path with %0A in it) cannot start a new log line or forge one."""
    if text.isprintable() and "\\" not in text:  # the usual case, without the regex
        return text  # (isprintable() is False for every character _UNPRINTABLE matches)
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def first_header(scope: Scope, name: bytes) -> str | None:
    """The first value of request header `name` (lower-case bytes), or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class RequestIds:
    """New request ids: a random per-process prefix and a counter (unique across replicas and
    restarts with overwhelming odds, and far cheaper than a uuid4 per request)."""

    def __init__(self) -> None:
        self.prefix = secrets.token_hex(6)
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self.prefix}-{next(self._counter):012x}"  # fixed width: 25 characters


_IDS = RequestIds()  # one per process: HTTP and gRPC requests draw from the same sequence


def request_id(given: str | None) -> str:
    """The client's request id when it is sane (1-128 of [A-Za-z0-9._:-]), else a new one."""
    return given if given and _SAFE_ID.match(given) else _IDS.next()


class RequestContext:
    """Gives each request an id (the client's `X-Request-ID` when sane, else a new one), echoes
    it in the response, and logs method, path, status and duration under it: every failed
    request (status >= 400), and successful ones at `sampling.access_log_sample_rate` (1.0:
    all; read per request, so the logging extension can change it)."""

    def __init__(self, app: ASGIApp, sampling: Any) -> None:
        self.app = app
        self.sampling = sampling

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # uvicorn starts a pipelined request's task from the one before it: its context (a
        # trace id that request set) must not name this one
        TRACED.set(None)
        rid = request_id(first_header(scope, b"x-request-id"))
        started = time.perf_counter()
        values = scope.setdefault("state", {})
        values["request_id"], values["started"] = rid, started
        status = 500

        async def send_with_id(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.done(scope, rid, status, started)

    def done(self, scope: Scope, request_id: str, status: int, started: float) -> None:
        """The request's access-log line: always for a failure, else at the sample rate."""
        trace = TRACED.get()
        if keeps_access_line(status, trace is not None, self.sampling.access_log_sample_rate):
            self._log(scope, request_id, status, started, trace)

    @staticmethod
    def _log(
        scope: Scope, request_id: str, status: int, started: float, trace: Trace | None
    ) -> None:
        if access_log.isEnabledFor(logging.INFO):
            method, path = log_safe(scope["method"]), log_safe(scope["path"])
            extra = {
                "request_id": request_id,
                "status": status,
                "duration_ms": round((time.perf_counter() - started) * 1000, 3),
                "method": method,
                "path": path,
            }
            if trace is not None:
                extra["trace_id"] = trace.hex_id
            # access_log.info("%s %s %d", ...) without its walk up the stack for the caller's
            # file and line (findCaller), which no formatter of ours prints: one line per
            # request at the default sample rate. Same record otherwise, same handlers.
            access_log.handle(
                access_log.makeRecord(
                    access_log.name, logging.INFO, "(unknown file)", 0, "%s %s %d",
                    (method, path, status), None, "(unknown function)", extra,
                )
            )  # fmt: skip


def keeps_access_line(status: int, traced: bool, rate: float) -> bool:
    """Whether a request (HTTP or gRPC) gets its access-log line: always when it failed or was
    traced (its JSON line names the trace), else at --access-log-sample-rate `rate`."""
    return status >= 400 or traced or rate >= 1.0 or random.random() < rate


def header_bytes(scope: Scope) -> int:
    """The size of the request's header block as HeaderLimit counts it."""
    return sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))


class HeaderLimit:
    """431 for a request whose header block is over `limit` bytes. uvicorn's httptools parser
    has no limit of its own, so this bounds what reaches the app (a proxy in front, e.g. nginx's
    large_client_header_buffers, bounds it before parsing)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = header_bytes(scope)
            if size > self.limit:
                message = f"request headers are {size} bytes, over the limit of {self.limit}"
                await _reject(send, 431, message + " (--max-header-bytes)", scope["path"])
                return
        await self.app(scope, receive, send)


class HeadAsGet:
    """HEAD wherever GET exists: the GET route runs and its body is dropped (headers, including
    Content-Length, are kept). Routes without GET answer HEAD as they answer GET (405/404)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_headers_only(message: dict) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_headers_only)


def bearer_credential(value: str | None) -> str | None:
    """The credential of an `Authorization: Bearer <credential>` header, or None. The scheme
    is matched case-insensitively (RFC 7235 §2.1)."""
    if value is None:
        return None
    scheme, _, credential = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        return None
    return credential.strip()


class ApiKeyAuth:
    """`Authorization: Bearer <key>` on every route (debug routes and the docs included) except
    the open health/metrics set when --open-health-metrics is on; constant-time compare. The
    debug token (--debug-token) is checked on top of it by the debug routes."""

    # /health (TEI) and /ping (SageMaker) are probes too: orchestrators call them without keys.
    OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/health", "/ping", "/metrics"})
    # The debug page's static files (no data, no secrets): a browser loads them without headers;
    # every call the page makes for data goes through this guard like any script's.
    PAGE_PATHS = ("/debug/assets/",)

    def _is_open(self, path: str) -> bool:
        return path in self.open_paths or path == "/debug" or path.startswith(self.PAGE_PATHS)

    def __init__(self, app: ASGIApp, api_key: str, open_health_metrics: bool) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = self.OPEN_PATHS if open_health_metrics else frozenset()

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """Why the request may not pass (status, message), or None when it may."""
        if self._is_open(scope["path"]):
            return None
        given = first_header(scope, b"authorization")
        credential = bearer_credential(given)
        if given is None:
            return 401, "missing 'Authorization: Bearer <api key>' header"
        if credential is None:
            return 401, "the Authorization header must be 'Bearer <api key>'"
        if not secrets.compare_digest(credential.encode(), self.expected):
            return 403, "wrong API key"
        return None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        refused = self.refusal(scope) if scope["type"] == "http" else None
        if refused is None:
            await self.app(scope, receive, send)
        else:
            await _reject(send, *refused, scope["path"])


async def _reject(send: Any, status: int, message: str, path: str) -> None:
    """An error answered before the app runs, in the route's error shape (OIP or OpenAI)."""
    code = {401: "invalid_api_key", 403: "invalid_api_key"}.get(status)
    body = orjson.dumps(error_body(path, status, message, code))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="mha-serve"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
