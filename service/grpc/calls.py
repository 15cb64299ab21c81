"""What every gRPC call of the server does around its handler, for each service on the port
(Triton's, TEI's, health): the API key from `authorization: Bearer <key>` metadata, a request
id (the client's `x-request-id`, else a new one) sent back in the initial metadata, one
access-log line, the request metrics with protocol="grpc", and a ServiceError as the call's
status code (service.grpc.status)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import TYPE_CHECKING, Any

import grpc

from service.grpc.status import CANCELLED_STATUS, grpc_code, trailing_metadata
from service.http.middleware import bearer_credential, keeps_access_line, log_safe, request_id
from service.pipeline.errors import BadInput, ServiceError, Unauthorized
from service.runtime.tracing import TRACED

if TYPE_CHECKING:
    from service.runtime.state import ServiceState

access_log = logging.getLogger("service.access")
log = logging.getLogger("service.grpc")

# Open without the API key when --open-health-metrics is on (as /v2/health/* over HTTP).
OPEN_METHODS = frozenset(
    {"ServerLive", "ServerReady", "grpc.health.v1.Health/Check", "grpc.health.v1.Health/Watch"}
)


def call_metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The call's text metadata (binary `-bin` values left out)."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def cancel_with_call(context: grpc.aio.ServicerContext) -> None:
    """For a call whose client streams: grpc ends the request iterator, without cancelling the
    handler, when the client cancels or the deadline passes; cancel the handler's task then, so
    that nothing of the call runs on."""
    handler = asyncio.current_task()

    def ended(_: object) -> None:
        if context.cancelled() and handler is not None:
            handler.cancel()

    context.add_done_callback(ended)


# How a stream the client still had open ends when the server drains (UNAVAILABLE: retried).
STREAM_DRAINED = (
    "the server is shutting down: this stream ends here, every request read from it answered; "
    "send the rest on a new stream"
)


async def read_until_drain(reading: Coroutine[Any, Any, None], state: ServiceState) -> bool:
    """Run `reading`, a stream handler's loop over its client's messages, until it ends (False:
    the client closed its side) or this server starts draining (True: `reading` is cancelled, so
    an open stream never holds the drain up; what it had read is the handler's to finish)."""
    reader = asyncio.ensure_future(reading)
    drain = asyncio.ensure_future(state.drain_started.wait())
    try:
        await asyncio.wait((reader, drain), return_when=asyncio.FIRST_COMPLETED)
        if reader.done():
            reader.result()  # the reading's own error, if it failed
            return False
        return True
    finally:
        drain.cancel()
        if not reader.done():
            reader.cancel()
            await asyncio.wait((reader,))


class Call:
    """One RPC's bookkeeping: its id and the HTTP-equivalent status the metrics record."""

    def __init__(self, method: str, rid: str) -> None:
        self.method = method
        self.request_id = rid
        self.started = time.perf_counter()
        self.status = 200
        self.reason: str | None = None
        self.headers: list[tuple[str, str]] = []  # sent with the answer (Calls._call(headers=))


class Calls:
    """The per-call plumbing of a servicer over the lifespan's ServiceState."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        key = state.settings.api_key
        self.api_key = None if key is None else key.get_secret_value().encode()

    # -- per-call plumbing --------------------------------------------------------------------
    def _check_key(self, method: str, metadata: dict[str, str]) -> None:
        if self.api_key is None:
            return
        if method in OPEN_METHODS and self.state.settings.open_health_metrics:
            return
        given = metadata.get("authorization")
        credential = bearer_credential(given)
        if given is None:
            raise Unauthorized("missing 'authorization: Bearer <api key>' call metadata")
        if credential is None:
            raise Unauthorized("the authorization metadata must be 'Bearer <api key>'")
        if not secrets.compare_digest(credential.encode(), self.api_key):
            raise Unauthorized("wrong API key")

    @contextlib.contextmanager
    def observed(
        self,
        method: str,
        rid: str,
        endpoint: str | None = None,
        model: str | None = None,
        version: str = "",
    ) -> Iterator[Call]:
        """One request's access-log line and (for `endpoint`) in-flight gauge and metrics, with
        the status the caller sets on the Call (a cancelled one records 499)."""
        call = Call(method, rid)
        metrics = self.state.metrics_for(model, version)
        gauge = metrics.in_flight_child if endpoint else None
        TRACED.set(None)  # a trace begun for this request (tracing.begin) sets it
        if gauge is not None:
            gauge.inc()
        try:
            yield call
        except asyncio.CancelledError:
            call.status = CANCELLED_STATUS  # the caller may have said why
            call.reason = call.reason or "client_disconnected"
            raise
        finally:
            seconds = time.perf_counter() - call.started
            trace = TRACED.get()
            trace_id = None if trace is None else trace.hex_id
            if gauge is not None:
                gauge.dec()
                metrics.request_done(endpoint, call.status, seconds, call.reason, "grpc", trace_id)
            self._access_line(call, seconds, trace_id)

    def _access_line(self, call: Call, seconds: float, trace_id: str | None) -> None:
        """As over HTTP: every failed or traced call's line, successful ones at the live
        --access-log-sample-rate."""
        control = self.state.log_control
        rate = 1.0 if control is None else control.access_log_sample_rate
        if not keeps_access_line(call.status, trace_id is not None, rate):
            return
        extra = {
            "request_id": call.request_id,
            "status": call.status,
            "duration_ms": round(seconds * 1000, 3),
            "method": "GRPC",
            "path": log_safe(call.method),
        }
        if trace_id is not None:
            extra["trace_id"] = trace_id
        access_log.info("GRPC %s %d", call.method, call.status, extra=extra)

    @contextlib.asynccontextmanager
    async def _call(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        endpoint: str | None = None,
        model: str | None = None,
        version: str = "",
        headers: bool = False,
    ) -> AsyncIterator[Call]:
        """Auth, request id, errors to status codes, access log and (for `endpoint`) metrics.
        The request id goes out in the initial metadata at once, or with `headers` (a unary
        call's) together with the handler's `call.headers` when it answers."""
        metadata = call_metadata(context)
        rid = request_id(metadata.get("x-request-id"))
        with self.observed(method, rid, endpoint, model, version) as call:
            first = (("x-request-id", call.request_id),)
            try:
                if not headers:
                    await context.send_initial_metadata(first)
                self._check_key(method, metadata)
                yield call
                if headers:
                    headers = False  # sent (or failed): never twice
                    await context.send_initial_metadata(first + tuple(call.headers))
            except ServiceError as exc:
                call.status, call.reason = exc.status, exc.reason
                if headers:
                    await context.send_initial_metadata(first)
                await context.abort(grpc_code(exc), exc.message, trailing_metadata(exc))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                call.status, call.reason = 500, "inference_error"
                log.exception("unhandled error in gRPC %s", method)
                if headers:
                    await context.send_initial_metadata(first)
                await context.abort(grpc.StatusCode.INTERNAL, "internal server error")

    async def refuse_undecodable(
        self, method: str, context: grpc.aio.ServicerContext, error: Exception
    ) -> None:
        """A unary request that is no valid protobuf message (service.grpc.decode_errors):
        INVALID_ARGUMENT naming the problem, with the plumbing of any refused call."""
        async with self._call(method, context):
            raise BadInput(f"the request is not a valid protobuf message: {error}")
