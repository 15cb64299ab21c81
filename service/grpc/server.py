"""The gRPC listener: a `grpc.aio` server on the lifespan's event loop, beside uvicorn."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from service.grpc import grpc_service_pb2_grpc as pb_grpc
from service.grpc import health_pb2_grpc as health_grpc
from service.grpc import reflection, tei_pb2
from service.grpc import tei_pb2_grpc as tei_grpc
from service.grpc.decode_errors import DecodeErrors
from service.grpc.health import HealthServicer
from service.grpc.reflection import ReflectionServicer
from service.grpc.servicer import InferenceServicer
from service.grpc.tei_servicer import TeiServicer
from service.runtime.startup import EXIT_PORT, GRPC_FLAGS, StartupError, check_grpc_port

if TYPE_CHECKING:
    from service.runtime.model_control import ModelControl
    from service.runtime.state import ServiceState

log = logging.getLogger("service.grpc")


class GrpcListener:
    """Started and stopped by the FastAPI lifespan; `port` is the bound port (for --grpc-port 0
    in code paths that pick one, e.g. tests starting the app in-process)."""

    def __init__(
        self, state: ServiceState, control: ModelControl, reuse_port: bool = False
    ) -> None:
        settings = state.settings
        limit = settings.max_body_bytes  # the same bound as an HTTP body, both ways
        servicer = InferenceServicer(state, control)
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                # A port in use is an error, not a shared listener; except between the
                # front-ends of --workers, which all listen on it (the kernel spreads calls).
                ("grpc.so_reuseport", int(reuse_port)),
            ],
            maximum_concurrent_rpcs=settings.max_connections,  # past it: RESOURCE_EXHAUSTED
            interceptors=[DecodeErrors(servicer.refuse_undecodable)],
        )
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self.server)
        tei = TeiServicer(state)  # TEI's gRPC API (tei.v1), for text models
        for service in tei_pb2.DESCRIPTOR.services_by_name:  # Info, Embed, Predict, ...
            getattr(tei_grpc, f"add_{service}Servicer_to_server")(tei, self.server)
        health_grpc.add_HealthServicer_to_server(HealthServicer(state), self.server)
        reflection.add_to_server(ReflectionServicer(state), self.server)
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
