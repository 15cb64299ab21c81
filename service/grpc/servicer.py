"""The GRPCInferenceService handlers: the HTTP routes' checks, batcher and codecs behind gRPC.

Every call: the API key from `authorization: Bearer <key>` metadata, a request id (the client's
`x-request-id`, else a new one) sent back in the initial metadata, one access-log line, and the
request metrics with protocol="grpc". A ServiceError ends the call with its status code
(service.grpc.status); a cancelled call leaves the queue like a disconnected HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import grpc
from google.protobuf import json_format

from service import __version__
from service.grpc import grpc_service_pb2 as pb
from service.grpc import grpc_service_pb2_grpc as pb_grpc
from service.grpc.shared_memory import SharedMemoryServicer
from service.grpc.status import CANCELLED_STATUS, grpc_code, trailing_metadata
from service.grpc.streaming import stream_infer
from service.grpc.tensors import (
    decode_infer_request,
    encode_infer_response,
    in_shared_memory,
    shared_inputs,
)
from service.http.middleware import bearer_credential, keeps_access_line, log_safe, request_id
from service.oip.codecs import OFFLOAD_BYTES, OutputTensor
from service.oip.inputs import OUTPUT_NAME
from service.oip.model_config import extensions, model_config, model_metadata
from service.pipeline.errors import ServiceError, Unauthorized
from service.pipeline.models import admit
from service.pipeline.tensors import TensorRequest, TensorResult, infer
from service.runtime.load_config import parse_load_config
from service.runtime.model_control import LOAD_PARAMETERS, UNLOAD_PARAMETERS, check_parameters
from service.runtime.tracing import TRACED
from service.shm.tensors import SharedMemoryIO, write_outputs

if TYPE_CHECKING:
    from service.runtime.model_control import ModelControl
    from service.runtime.state import ModelEntry, ServiceState

access_log = logging.getLogger("service.access")
log = logging.getLogger("service.grpc")

# Open without the API key when --open-health-metrics is on (as /v2/health/* over HTTP).
OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})


class Call:
    """One RPC's bookkeeping: its id and the HTTP-equivalent status the metrics record."""

    def __init__(self, method: str, rid: str) -> None:
        self.method = method
        self.request_id = rid
        self.started = time.perf_counter()
        self.status = 200
        self.reason: str | None = None


async def _encode(raw: bool, shm: SharedMemoryIO, result: TensorResult) -> pb.ModelInferResponse:
    """The result as a ModelInferResponse (raw output contents when the request sent raw), or
    written into the client's shared memory where it asked."""
    parameters = await write_outputs(shm, OUTPUT_NAME, result.array)
    return encode_infer_response(
        result.entry.name,
        result.entry.version,
        result.request_id,
        [OutputTensor(OUTPUT_NAME, result.payload.datatype, result.array, parameters)],
        raw=raw,
    )


class InferenceServicer(SharedMemoryServicer, pb_grpc.GRPCInferenceServiceServicer):
    """Handlers over the lifespan's ServiceState."""

    def __init__(self, state: ServiceState, control: ModelControl) -> None:
        self.state = state
        self.control = control
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
            call.status, call.reason = CANCELLED_STATUS, "client_disconnected"
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
    ) -> AsyncIterator[Call]:
        """Auth, request id, errors to status codes, access log and (for `endpoint`) metrics."""
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        rid = request_id(metadata.get("x-request-id"))
        with self.observed(method, rid, endpoint, model, version) as call:
            try:
                await context.send_initial_metadata((("x-request-id", call.request_id),))
                self._check_key(method, metadata)
                yield call
            except ServiceError as exc:
                call.status, call.reason = exc.status, exc.reason
                await context.abort(grpc_code(exc), exc.message, trailing_metadata(exc))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                call.status, call.reason = 500, "inference_error"
                log.exception("unhandled error in gRPC %s", method)
                await context.abort(grpc.StatusCode.INTERNAL, "internal server error")

    def _ready(self, name: str, version: str) -> bool:
        """Triton's answer: false for a model it knows but cannot serve now (loading, unloading,
        unloaded, or that version not served); NOT_FOUND only for a name it has never heard of."""
        state = self.state
        entry = state.versions.get(name, {}).get(version) if version else state.models.get(name)
        if entry is not None:
            return state.model_ready(entry)
        if name in state.versions or name in self.control.known():
            return False
        state.find(name, version or None)  # raises NOT_FOUND naming what is served
        return False

    def _model(self, name: str, version: str) -> ModelEntry:
        return self.state.find(name, version or None)

    # -- health and metadata ------------------------------------------------------------------
    async def ServerLive(self, request, context):
        async with self._call("ServerLive", context):
            return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        async with self._call("ServerReady", context):
            return pb.ServerReadyResponse(ready=self.state.serving)

    async def ModelReady(self, request, context):
        async with self._call("ModelReady", context):
            return pb.ModelReadyResponse(ready=self._ready(request.name, request.version))

    async def ServerMetadata(self, request, context):
        async with self._call("ServerMetadata", context):
            return pb.ServerMetadataResponse(
                name="mha-serve", version=__version__, extensions=extensions(self.state.settings)
            )

    async def ModelMetadata(self, request, context):
        async with self._call("ModelMetadata", context):
            entry = self._model(request.name, request.version)
            meta = model_metadata(entry, self.state.served_versions(entry.name))
            meta.pop("properties")  # not part of the gRPC message
            return json_format.ParseDict(meta, pb.ModelMetadataResponse())

    async def ModelConfig(self, request, context):
        async with self._call("ModelConfig", context):
            entry = self._model(request.name, request.version)
            config = model_config(entry)
            return json_format.ParseDict({"config": config}, pb.ModelConfigResponse())

    async def ModelStatistics(self, request, context):
        async with self._call("ModelStatistics", context):
            state = self.state
            if request.name:  # one model (unknown: NOT_FOUND); else every model
                entry = self._model(request.name, request.version)
                versions = [request.version] if request.version else None
                entries = [
                    state.versions[entry.name][v]
                    for v in versions or state.served_versions(entry.name)
                ]
            else:
                entries = state.entries()
            stats = [await entry.stats.snapshot() for entry in entries]
            return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    # -- inference ----------------------------------------------------------------------------
    async def ModelInfer(self, request, context):
        name, version = request.model_name, request.model_version
        async with self._call("ModelInfer", context, "infer", name, version) as call:
            return await self.infer(request, call.request_id, context, call.started)

    async def ModelStreamInfer(self, request_iterator, context):
        async with self._call("ModelStreamInfer", context) as call:
            await stream_infer(self, request_iterator, context, call.request_id)

    async def infer(
        self,
        request: pb.ModelInferRequest,
        rid: str,
        context: grpc.aio.ServicerContext,
        received_at: float | None = None,
    ) -> pb.ModelInferResponse:
        """One ModelInferRequest through the OIP core (unary calls and each request of a
        stream), within the call's gRPC deadline if it has one; `received_at`: when the call
        (or the stream's request) arrived, perf_counter. Raises ServiceError."""
        name, version = request.model_name, request.model_version
        admit(self.state, name, version or None)  # 404 / 503 before any work
        shared = in_shared_memory(request)
        # tritonclient reads raw outputs only: raw unless the request sent typed contents
        raw = bool(request.raw_input_contents) or shared
        regions, shared_bytes = shared_inputs(request)
        with SharedMemoryIO(self.state.shared_memory) as shm:
            work = TensorRequest(
                model=name,
                version=version or None,
                protocol="grpc",
                request_id=rid,
                decode=functools.partial(decode_infer_request, request, shm),
                # Raw contents decode to views (no pass over the values); large typed contents
                # and large shared-memory inputs are copied, off the event loop, and so is any
                # read of a CUDA region (its copy waits for the forward queued on the device).
                offload=shared_bytes > OFFLOAD_BYTES
                or self.state.shared_memory.on_device(regions)
                or (not raw and request.ByteSize() > OFFLOAD_BYTES),
                deadline_s=context.time_remaining(),
                output_sink=functools.partial(shm.device_sink, OUTPUT_NAME),
            )
            if self.state.trace_control.active:
                metadata = dict(context.invocation_metadata() or ())
                work.traceparent = metadata.get("traceparent")
                work.tracestate = metadata.get("tracestate")
                work.received_at = received_at
            return await infer(self.state, work, functools.partial(_encode, raw, shm))

    # -- model repository (service/runtime/model_control.py) --------------------------------
    async def RepositoryIndex(self, request, context):
        async with self._call("RepositoryIndex", context):
            rows = self.control.index(ready_only=request.ready)
            return json_format.ParseDict({"models": rows}, pb.RepositoryIndexResponse())

    async def RepositoryModelLoad(self, request, context):
        async with self._call("RepositoryModelLoad", context):
            check_parameters(request.parameters, LOAD_PARAMETERS)
            config = None
            if "config" in request.parameters:
                value = request.parameters["config"]
                text = value.string_param if value.HasField("string_param") else None
                config = parse_load_config(text, request.model_name)
            await self.control.load(request.model_name, config)
            return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        async with self._call("RepositoryModelUnload", context):
            check_parameters(request.parameters, UNLOAD_PARAMETERS)
            await self.control.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()
