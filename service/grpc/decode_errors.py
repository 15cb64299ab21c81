"""Requests that are no valid protobuf message: a client's mistake, answered as such (grpc would
end the call UNKNOWN, with a traceback in the log)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from service.pipeline.errors import BadInput


class Undecodable:
    """What a request that is no valid protobuf message deserializes to (grpc would otherwise
    end the call UNKNOWN, with a traceback in the log, for a client's mistake)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def decoded(request: Any) -> Any:
    """A request as decoded, or 400 for one that is no valid protobuf message."""
    if isinstance(request, Undecodable):
        raise BadInput(f"the request is not a valid protobuf message: {request.error}")
    return request


def answers_undecodable(handler: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a unary handler that refuses an Undecodable request itself (with `decoded`, inside
    its own call: counted under its endpoint's metrics), so DecodeErrors passes it on."""
    handler.answers_undecodable = True  # type: ignore[attr-defined]
    return handler


def _lenient(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or anything a bad message raises
            return Undecodable(exc)

    return decode


# (method, context, error): ends the call INVALID_ARGUMENT with the servicers' call plumbing
Refuse = Callable[[str, grpc.aio.ServicerContext, Exception], Awaitable[None]]


def method_name(path: str) -> str:
    """A call's name as the access log gives it: Triton's RPCs by their short name (as their
    handlers log them), others as `package.Service/Method`."""
    service, _, method = path.lstrip("/").rpartition("/")
    return method if service == "inference.GRPCInferenceService" else f"{service}/{method}"


def _refusing(behavior: Callable[..., Any], name: str, refuse: Refuse) -> Callable[..., Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            return await refuse(name, context, request.error)
        return await behavior(request, context)

    return call


class DecodeErrors(grpc.aio.ServerInterceptor):
    """Undecodable requests end INVALID_ARGUMENT naming the problem, through `refuse` (the API
    key checked first, a request id, an access-log line, as any refused call) or through the
    handler itself where it `answers_undecodable`; on a stream that message's answer says so.
    Each method's handler is wrapped once and reused."""

    def __init__(self, refuse: Refuse) -> None:
        self._refuse = refuse
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is None:
            handler = await continuation(handler_call_details)
            # one request in: a unary call, or one answered with context.write (health's Watch)
            single = None
            if handler is not None and handler.unary_unary:
                single = "unary_unary"
            elif handler is not None and inspect.iscoroutinefunction(handler.unary_stream):
                single = "unary_stream"
            if single and handler.request_deserializer:
                behavior = getattr(handler, single)
                if not getattr(behavior, "answers_undecodable", False):
                    behavior = _refusing(behavior, method_name(method), self._refuse)
                handler = handler._replace(
                    **{single: behavior},
                    request_deserializer=_lenient(handler.request_deserializer),
                )
                self._handlers[method] = handler
            elif (
                handler is not None
                and (handler.stream_stream or handler.stream_unary)
                and handler.request_deserializer
            ):
                # a stream's handler answers an undecodable message with its error
                # (service.grpc.streaming, service.grpc.tei_servicer)
                handler = handler._replace(
                    request_deserializer=_lenient(handler.request_deserializer)
                )
                self._handlers[method] = handler
        return handler
