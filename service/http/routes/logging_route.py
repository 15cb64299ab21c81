"""Triton's logging extension over HTTP: GET /v2/logging shows this process's log settings,
POST /v2/logging changes some of them (service/runtime/log_settings.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service.http.body import read_object
from service.http.openapi import ERROR_RESPONSES
from service.http.openapi_extensions import ok
from service.runtime.log_settings import BOOLEANS, LogControl

router = APIRouter(tags=["logging"])
BODY_LIMIT = 64 * 1024  # a handful of settings; nothing bigger is read
LOG_SETTINGS = {
    "type": "object",
    "properties": {
        **{name: {"type": "boolean"} for name in BOOLEANS},
        "log_verbose_level": {"type": "integer", "minimum": 0},
        "log_format": {"type": "string", "enum": ["text", "json"]},
        "log_file": {"type": "string", "enum": [""]},
        "access_log_sample_rate": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "additionalProperties": False,
}
RESPONSES = {**ok(LOG_SETTINGS, "The log settings (after the update)"), 400: ERROR_RESPONSES[400]}


def log_control(request: Request) -> LogControl:
    return request.app.state.log_control


@router.get("/v2/logging", summary="Log settings (Triton's logging extension)", responses=RESPONSES)
async def get_log_settings(request: Request) -> dict[str, Any]:
    return log_control(request).snapshot()


@router.post(
    "/v2/logging",
    summary="Change log settings (Triton's logging extension); unknown settings: 400",
    responses=RESPONSES,
    openapi_extra={"requestBody": {"content": {"application/json": {"schema": LOG_SETTINGS}}}},
)
async def update_log_settings(request: Request) -> dict[str, Any]:
    changes = await read_object(request, BODY_LIMIT)
    return log_control(request).update(changes)
