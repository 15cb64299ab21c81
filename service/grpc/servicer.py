"""The GRPCInferenceService handlers: the HTTP routes' checks, batcher and codecs behind gRPC.

Every call goes through service.grpc.calls (API key, request id, access log, metrics, status
codes); a cancelled call leaves the queue like a disconnected HTTP client.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import grpc
from google.protobuf import json_format

from service import __version__
from service.grpc import grpc_service_pb2 as pb
from service.grpc import grpc_service_pb2_grpc as pb_grpc
from service.grpc import log_settings, trace_settings
from service.grpc.calls import Calls
from service.grpc.decode_errors import Undecodable, answers_undecodable, decoded
from service.grpc.shared_memory import SharedMemoryServicer
from service.grpc.streaming import stream_infer
from service.grpc.tensors import (
    decode_infer_request,
    encode_infer_response,
    in_shared_memory,
    shared_inputs,
)
from service.oip.codecs import OFFLOAD_BYTES, OutputTensor
from service.oip.inputs import OUTPUT_NAME
from service.oip.model_config import extensions, model_config, model_metadata
from service.pipeline.models import admit
from service.pipeline.tensors import TensorRequest, TensorResult, infer
from service.runtime.load_config import parse_load_config
from service.runtime.model_control import LOAD_PARAMETERS, UNLOAD_PARAMETERS, check_parameters
from service.shm.tensors import SharedMemoryIO, write_outputs

if TYPE_CHECKING:
    from service.runtime.model_control import ModelControl
    from service.runtime.state import ModelEntry, ServiceState


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


class InferenceServicer(Calls, SharedMemoryServicer, pb_grpc.GRPCInferenceServiceServicer):
    """Handlers over the lifespan's ServiceState."""

    def __init__(self, state: ServiceState, control: ModelControl) -> None:
        super().__init__(state)
        self.control = control

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
    @answers_undecodable
    async def ModelInfer(self, request, context):
        # an undecodable request names no model: counted under the default model's labels
        name, version = (None, "") if isinstance(request, Undecodable) else (
            request.model_name, request.model_version)  # fmt: skip
        async with self._call("ModelInfer", context, "infer", name, version) as call:
            return await self.infer(decoded(request), call.request_id, context, call.started)

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

    # -- Triton's logging and trace extensions -------------------------------------------------
    async def LogSettings(self, request, context):
        async with self._call("LogSettings", context):
            return log_settings.answer(self.state, request)

    async def TraceSetting(self, request, context):
        async with self._call("TraceSetting", context):
            return trace_settings.answer(self.state, request)
