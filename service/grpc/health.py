"""The standard gRPC health service (grpc.health.v1) on --grpc-port: what Kubernetes' gRPC
probes, grpc_health_probe and load balancers ask. "" and Triton's service name answer as
ServerReady does (serving: ready and not draining); each of TEI's services answers SERVING
while a ready text model of a kind it serves is served (TEI's own rule: Info and Tokenize need
any text model, Embed an embedding or SPLADE model, Predict a classifier or reranker, Rerank a
reranker). Open without the API key unless --no-open-health-metrics, as /v2/health/*."""

from __future__ import annotations

import asyncio

from service.grpc import health_pb2 as pb
from service.grpc import health_pb2_grpc as pb_grpc
from service.grpc.calls import Calls
from service.pipeline.errors import Overloaded, ServiceError
from service.text.kinds import offers

SERVING = pb.HealthCheckResponse.SERVING
NOT_SERVING = pb.HealthCheckResponse.NOT_SERVING
WATCH_PERIOD_S = 1.0  # how often Watch looks for a change
SERVER = ("", "inference.GRPCInferenceService")
TEI_KINDS: dict[str, tuple[str, ...]] = {  # () : any text model
    "tei.v1.Info": (),
    "tei.v1.Tokenize": (),
    "tei.v1.Embed": ("embedding", "sparse"),
    "tei.v1.Predict": ("classifier", "reranker"),
    "tei.v1.Rerank": ("reranker",),
}


class UnknownService(ServiceError):
    status = 404
    reason = "unknown_service"


class HealthServicer(Calls, pb_grpc.HealthServicer):
    """Check and Watch over the lifespan's ServiceState. A Watch holds one of the listener's
    --max-connections calls for as long as it lasts, and needs no key: at most a quarter of
    them watch at once (past that RESOURCE_EXHAUSTED), so watchers never crowd out calls."""

    watching = 0

    def status(self, service: str) -> int | None:
        """SERVING or NOT_SERVING; None for a service this server does not offer."""
        state = self.state
        if service not in SERVER and service not in TEI_KINDS:
            return None
        if not state.serving:
            return NOT_SERVING
        if service in SERVER:
            return SERVING
        kinds = TEI_KINDS[service]
        for entry in state.models.values():
            fits = not kinds or any(offers(entry.model, k) for k in kinds)
            if entry.tokenizer is not None and fits and state.model_ready(entry):
                return SERVING
        return NOT_SERVING

    async def Check(self, request, context):
        async with self._call("grpc.health.v1.Health/Check", context):
            status = self.status(request.service)
            if status is None:
                known = ", ".join(repr(s) for s in (*SERVER, *TEI_KINDS))
                raise UnknownService(f"unknown service {request.service!r}; known: {known}")
            return pb.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        """The status now and on each change (SERVICE_UNKNOWN for an unknown service, as the
        protocol says), until the client cancels; once draining, NOT_SERVING and the end (a
        watch never holds the drain up)."""
        async with self._call("grpc.health.v1.Health/Watch", context):
            limit = max(1, self.state.settings.max_connections // 4)
            if self.watching >= limit:
                raise Overloaded(f"{limit} health watches are open, the most at once; use Check")
            self.watching += 1
            try:
                await self._watch(request, context)
            finally:
                self.watching -= 1

    async def _watch(self, request, context) -> None:
        last = None
        while True:
            status = self.status(request.service)
            if status is None:
                status = pb.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                await context.write(pb.HealthCheckResponse(status=status))
                last = status
            if self.state.draining:
                return
            await asyncio.sleep(WATCH_PERIOD_S)
