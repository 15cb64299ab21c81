"""Triton's trace extension over HTTP: GET /v2[/models/{name}]/trace/setting shows the trace
settings in force, POST changes them (service/runtime/tracing.py; one validator for HTTP and
gRPC). A model's settings override the global ones one by one; null clears an override."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service.http.body import read_object
from service.http.deps import State
from service.http.openapi import ERROR_RESPONSES
from service.http.openapi_extensions import ok
from service.runtime.tracing import LEVELS, TraceControl

router = APIRouter(tags=["tracing"])
BODY_LIMIT = 64 * 1024  # a handful of settings; nothing bigger is read
_VALUE = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_NULLABLE = {"anyOf": [*_VALUE["anyOf"], {"type": "integer"}, {"type": "null"}]}
TRACE_SETTINGS = {
    "type": "object",
    "properties": {
        "trace_level": {"type": "array", "items": {"type": "string", "enum": list(LEVELS)}},
        "trace_rate": {"type": "string"},
        "trace_count": {"type": "string"},
        "log_frequency": {"type": "string"},
        "trace_file": {"type": "string"},
        "trace_mode": {"type": "string"},
    },
}
TRACE_UPDATE = {
    "type": "object",
    "description": "Settings to change; null clears one (a model's follows the global again)",
    "additionalProperties": _NULLABLE,
}
RESPONSES = {
    **ok(TRACE_SETTINGS, "The trace settings in force (after the update)"),
    400: ERROR_RESPONSES[400],
}
MODEL_RESPONSES = {**RESPONSES, 404: ERROR_RESPONSES[404]}
UPDATE_BODY = {"requestBody": {"content": {"application/json": {"schema": TRACE_UPDATE}}}}


def trace_control(request: Request) -> TraceControl:
    return request.app.state.trace_control


@router.get("/v2/trace/setting", summary="Trace settings (Triton's trace extension)",
            responses=RESPONSES)  # fmt: skip
async def get_trace_settings(request: Request) -> dict[str, Any]:
    return trace_control(request).snapshot()


@router.post("/v2/trace/setting", summary="Change the global trace settings; unknown: 400",
             responses=RESPONSES, openapi_extra=UPDATE_BODY)  # fmt: skip
async def update_trace_settings(request: Request) -> dict[str, Any]:
    changes = await read_object(request, BODY_LIMIT)
    return trace_control(request).update(changes)


@router.get("/v2/models/{model_name}/trace/setting", summary="A model's trace settings",
            responses=MODEL_RESPONSES)  # fmt: skip
async def get_model_trace_settings(state: State, request: Request, model_name: str) -> Any:
    state.find(model_name, None)  # 404 naming what is served
    return trace_control(request).snapshot(model_name)


@router.post("/v2/models/{model_name}/trace/setting", summary="Change a model's trace settings",
             responses=MODEL_RESPONSES, openapi_extra=UPDATE_BODY)  # fmt: skip
async def update_model_trace_settings(state: State, request: Request, model_name: str) -> Any:
    state.find(model_name, None)
    changes = await read_object(request, BODY_LIMIT)
    return trace_control(request).update(changes, model_name)
