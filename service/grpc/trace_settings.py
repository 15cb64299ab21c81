"""GRPCInferenceService/TraceSetting (Triton's trace extension over gRPC): the same settings and
validation as GET/POST /v2[/models/{name}]/trace/setting (service/runtime/tracing.py), with the
servicer's call plumbing (API key, request id, access log). Registered beside the generated
service, on its name. A request with no settings reads them; a setting sent with no values
clears it (tritonclient sends a None value so), as Triton does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

from service.grpc import trace_settings_pb2 as trace_pb

if TYPE_CHECKING:
    from service.grpc.servicer import InferenceServicer

SERVICE = "inference.GRPCInferenceService"


def _response(values: dict[str, Any]) -> trace_pb.TraceSettingResponse:
    response = trace_pb.TraceSettingResponse()
    for name, value in values.items():
        response.settings[name].value.extend(value if isinstance(value, list) else [value])
    return response


def handler(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """The TraceSetting method on GRPCInferenceService, answered with `servicer`'s plumbing."""

    async def trace_setting(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with servicer._call("TraceSetting", context):
            control = servicer.state.trace_control
            model = request.model_name or None
            if model is not None:
                servicer.state.find(model, None)  # NOT_FOUND naming what is served
            changes = {name: list(v.value) or None for name, v in request.settings.items()}
            return _response(control.update(changes, model))

    method = grpc.unary_unary_rpc_method_handler(
        trace_setting,
        request_deserializer=trace_pb.TraceSettingRequest.FromString,
        response_serializer=trace_pb.TraceSettingResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"TraceSetting": method})
