"""Requests that are no valid protobuf message: a client's mistake, answered as such (grpc would
end the call UNKNOWN, with a traceback in the log)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc


class Undecodable:
    """What a request that is no valid protobuf message deserializes to (grpc would otherwise
    end the call UNKNOWN, with a traceback in the log, for a client's mistake)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or anything a bad message raises
            return Undecodable(exc)

    return decode


def _refusing(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid protobuf message: {request.error}",
            )
        return await behavior(request, context)

    return call


class DecodeErrors(grpc.aio.ServerInterceptor):
    """Undecodable requests end INVALID_ARGUMENT naming the problem (on a stream: that message's
    answer says so); each method's handler is wrapped once and reused."""

    def __init__(self) -> None:
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is None:
            handler = await continuation(handler_call_details)
            if handler is not None and handler.unary_unary and handler.request_deserializer:
                handler = handler._replace(
                    unary_unary=_refusing(handler.unary_unary),
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
