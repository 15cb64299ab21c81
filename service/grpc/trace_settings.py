"""GRPCInferenceService/TraceSetting (Triton's trace extension over gRPC): the same settings and
validation as GET/POST /v2[/models/{name}]/trace/setting (service/runtime/tracing.py), answered
by the InferenceServicer's TraceSetting with its call plumbing (API key, request id, access
log). A request with no settings reads them; a setting sent with no values clears it
(tritonclient sends a None value so), as Triton does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.grpc import grpc_service_pb2 as pb

if TYPE_CHECKING:
    from service.runtime.state import ServiceState


def _response(values: dict[str, Any]) -> pb.TraceSettingResponse:
    response = pb.TraceSettingResponse()
    for name, value in values.items():
        response.settings[name].value.extend(value if isinstance(value, list) else [value])
    return response


def answer(state: ServiceState, request: pb.TraceSettingRequest) -> pb.TraceSettingResponse:
    """The settings (the model's, for `model_name`) after the request's changes."""
    model = request.model_name or None
    if model is not None:
        state.find(model, None)  # NOT_FOUND naming what is served
    changes = {name: list(v.value) or None for name, v in request.settings.items()}
    return _response(state.trace_control.update(changes, model))
