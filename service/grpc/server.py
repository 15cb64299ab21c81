"""The gRPC listener: a `grpc.aio` server on the lifespan's event loop, beside uvicorn."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from service.grpc import grpc_service_pb2_grpc as pb_grpc
from service.grpc import log_settings
from service.grpc.servicer import InferenceServicer
from service.runtime.startup import EXIT_PORT, GRPC_FLAGS, StartupError, check_grpc_port

if TYPE_CHECKING:
    from service.runtime.model_control import ModelControl
    from service.runtime.state import ServiceState

log = logging.getLogger("service.grpc")


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
    """Undecodable requests end INVALID_ARGUMENT naming the problem; each method's handler is
    wrapped once and reused."""

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
        return handler


class GrpcListener:
    """Started and stopped by the FastAPI lifespan; `port` is the bound port (for --grpc-port 0
    in code paths that pick one, e.g. tests starting the app in-process)."""

    def __init__(
        self, state: ServiceState, control: ModelControl, reuse_port: bool = False
    ) -> None:
        settings = state.settings
        limit = settings.max_body_bytes  # the same bound as an HTTP body, both ways
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                # A port in use is an error, not a shared listener; except between the
                # front-ends of --workers, which all listen on it (the kernel spreads calls).
                ("grpc.so_reuseport", int(reuse_port)),
            ],
            maximum_concurrent_rpcs=settings.max_connections,  # past it: RESOURCE_EXHAUSTED
            interceptors=[DecodeErrors()],
        )
        servicer = InferenceServicer(state, control)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self.server)
        self.server.add_generic_rpc_handlers((log_settings.handler(servicer),))
        host = settings.grpc_host or settings.host
        address = (
            f"[{host}]:{settings.grpc_port}" if ":" in host else f"{host}:{settings.grpc_port}"
        )
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpc says only "Failed to bind"; ask the OS why
            self.port = 0
        if self.port == 0:
            check_grpc_port(settings)  # raises StartupError naming the port and flag
            raise StartupError(f"cannot listen for gRPC on {address} ({GRPC_FLAGS})", EXIT_PORT)
        self.address = address

    async def start(self) -> None:
        await self.server.start()
        log.info("gRPC listening on %s", self.address)

    async def stop(self, grace: float) -> None:
        """Refuse new calls; calls in progress get up to `grace` seconds, then are cancelled."""
        await self.server.stop(grace)
