"""GRPCInferenceService/LogSettings (Triton's logging extension over gRPC): the same settings and
validation as GET/POST /v2/logging (service/runtime/log_settings.py), answered by the
InferenceServicer's LogSettings with its call plumbing (API key, request id, access log).

Values travel as Triton's SettingValue: booleans as bool_param, log_verbose_level as
uint32_param, strings as string_param; access_log_sample_rate goes out as a string_param ("0.25")
and comes in as one, or as bool_param (true: 1.0, every request logged; false: 0.0, failures only:
tritonclient sends every setting it does not know as a bool).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.grpc import grpc_service_pb2 as pb
from service.pipeline.errors import BadInput

if TYPE_CHECKING:
    from service.runtime.state import ServiceState


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


def _response(values: dict[str, Any]) -> pb.LogSettingsResponse:
    response = pb.LogSettingsResponse()
    for name, value in values.items():
        setting = response.settings[name]
        if isinstance(value, bool):
            setting.bool_param = value
        elif isinstance(value, int):
            setting.uint32_param = value
        else:
            setting.string_param = str(value)
    return response


def answer(state: ServiceState, request: pb.LogSettingsRequest) -> pb.LogSettingsResponse:
    """The settings after the request's changes (none: they are only read)."""
    control = state.log_control
    if control is None:
        raise BadInput("log settings are not available in this process")
    changes = {name: _value(name, v) for name, v in request.settings.items()}
    return _response(control.update(changes) if changes else control.snapshot())
