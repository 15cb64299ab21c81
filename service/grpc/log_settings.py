"""GRPCInferenceService/LogSettings (Triton's logging extension over gRPC): the same settings and
validation as GET/POST /v2/logging (service/runtime/log_settings.py), with the servicer's call
plumbing (API key, request id, access log). Registered beside the generated service, on its name.

Values travel as Triton's SettingValue: booleans as bool_param, log_verbose_level as
uint32_param, strings as string_param; access_log_sample_rate goes out as a string_param ("0.25")
and comes in as one, or as bool_param (true: 1.0, every request logged; false: 0.0, failures only:
tritonclient sends every setting it does not know as a bool).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

from service.grpc import log_settings_pb2 as log_pb
from service.pipeline.errors import BadInput

if TYPE_CHECKING:
    from service.grpc.servicer import InferenceServicer

SERVICE = "inference.GRPCInferenceService"


def _value(name: str, setting: Any) -> Any:
    """A SettingValue as the Python value the shared validator checks."""
    kind = setting.WhichOneof("parameter_choice")
    if kind is None:
        raise BadInput(f"log setting '{name}' has no value")
    value = getattr(setting, kind)
    if name == "access_log_sample_rate":
        if kind == "bool_param":
            return 1.0 if value else 0.0
        if kind == "string_param":
            try:
                return float(value)
            except ValueError:
                raise BadInput(
                    f"'access_log_sample_rate' must be a number in [0, 1], got {value!r}"
                ) from None
    return value


def _response(values: dict[str, Any]) -> log_pb.LogSettingsResponse:
    response = log_pb.LogSettingsResponse()
    for name, value in values.items():
        setting = response.settings[name]
        if isinstance(value, bool):
            setting.bool_param = value
        elif isinstance(value, int):
            setting.uint32_param = value
        else:
            setting.string_param = str(value)
    return response


def handler(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """The LogSettings method on GRPCInferenceService, answered with `servicer`'s plumbing."""

    async def log_settings(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with servicer._call("LogSettings", context):
            control = servicer.state.log_control
            if control is None:
                raise BadInput("log settings are not available in this process")
            changes = {name: _value(name, v) for name, v in request.settings.items()}
            values = control.update(changes) if changes else control.snapshot()
            return _response(values)

    method = grpc.unary_unary_rpc_method_handler(
        log_settings,
        request_deserializer=log_pb.LogSettingsRequest.FromString,
        response_serializer=log_pb.LogSettingsResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"LogSettings": method})
