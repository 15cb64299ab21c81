"""Triton's shared-memory extensions over HTTP: register, unregister and list system
shared-memory regions (service.shm.regions) and CUDA ones (service.shm.cuda_regions). Where the
engine is not on a GPU, a CUDA registration answers 400 "GPUs not supported", as Triton's CPU
builds do (status lists none, unregistering has nothing to remove)."""

from __future__ import annotations

import base64
from typing import Any

from fastapi import APIRouter, Request

from service.http.body import read_json
from service.http.deps import get_state
from service.http.openapi import ERROR_RESPONSES, schema_body
from service.http.routes.repository import BODY_LIMIT
from service.pipeline.errors import BadInput
from service.shm.cuda_regions import not_supported, register_cuda

router = APIRouter(tags=["shared memory"])
SYSTEM = "/v2/systemsharedmemory"
CUDA = "/v2/cudasharedmemory"
REGION_STATUS = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "key": {"type": "string"},
        "offset": {"type": "integer"},
        "byte_size": {"type": "integer"},
    },
    "required": ["name", "key", "offset", "byte_size"],
}
STATUS_RESPONSES = {
    200: {
        "description": "The registered regions",
        "content": {"application/json": {"schema": {"type": "array", "items": REGION_STATUS}}},
    },
    **{code: ERROR_RESPONSES[code] for code in (404, 503)},
}
CUDA_REGION_STATUS = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "device_id": {"type": "integer"},
        "byte_size": {"type": "integer"},
    },
    "required": ["name", "device_id", "byte_size"],
}
CUDA_STATUS = {
    **STATUS_RESPONSES,
    200: {
        "description": "The registered regions",
        "content": {"application/json": {"schema": {"type": "array", "items": CUDA_REGION_STATUS}}},
    },
}
DONE = {
    200: {"description": "Done", "content": {"application/json": {"schema": {}}}},
    503: ERROR_RESPONSES[503],
}
CONTROL_RESPONSES = {**DONE, **{code: ERROR_RESPONSES[code] for code in (400, 413, 429)}}


REGISTER_BODY = schema_body(
    {
        "type": "object",
        "properties": {
            "key": {"type": "string", "description": "shm_open name, e.g. /input0"},
            "offset": {"type": "integer", "minimum": 0, "default": 0},
            "byte_size": {"type": "integer", "minimum": 1},
        },
        "required": ["key", "byte_size"],
    }
)
CUDA_REGISTER_BODY = schema_body(
    {
        "type": "object",
        "properties": {
            "raw_handle": {
                "type": "object",
                "properties": {"b64": {"type": "string", "format": "byte"}},
                "required": ["b64"],
                "description": "the 64-byte cudaIpcMemHandle_t, base64",
            },
            "device_id": {"type": "integer", "minimum": 0},
            "byte_size": {"type": "integer", "minimum": 1},
        },
        "required": ["raw_handle", "device_id", "byte_size"],
    }
)


@router.get(
    f"{SYSTEM}/status", summary="Every system shared-memory region", responses=STATUS_RESPONSES
)
@router.get(
    f"{SYSTEM}/region/{{region_name}}/status",
    summary="One system shared-memory region",
    responses=STATUS_RESPONSES,
)
async def system_status(request: Request, region_name: str | None = None) -> list[dict[str, Any]]:
    return get_state(request).shared_memory.status(region_name)


@router.post(
    f"{SYSTEM}/region/{{region_name}}/register",
    summary="Register a system shared-memory region: {key, offset, byte_size}",
    responses=CONTROL_RESPONSES,
    openapi_extra=REGISTER_BODY,
)
async def system_register(request: Request, region_name: str) -> dict[str, Any]:
    state = get_state(request)
    body = await read_json(request, BODY_LIMIT)
    if not isinstance(body, dict) or not isinstance(body.get("key"), str):
        raise BadInput("body must be a JSON object with a string 'key'")
    offset, byte_size = body.get("offset", 0), body.get("byte_size")
    state.shared_memory.register(region_name, body["key"], offset, byte_size)
    return {}


@router.post(f"{SYSTEM}/unregister", summary="Unregister every system region", responses=DONE)
@router.post(
    f"{SYSTEM}/region/{{region_name}}/unregister",
    summary="Unregister a system shared-memory region (in use: freed after its last request)",
    responses=DONE,
)
async def system_unregister(request: Request, region_name: str | None = None) -> dict[str, Any]:
    get_state(request).shared_memory.unregister(region_name)
    return {}


@router.get(f"{CUDA}/status", summary="Every CUDA shared-memory region", responses=CUDA_STATUS)
@router.get(
    f"{CUDA}/region/{{region_name}}/status",
    summary="One CUDA shared-memory region",
    responses=CUDA_STATUS,
)
async def cuda_status(request: Request, region_name: str | None = None) -> list[dict[str, Any]]:
    return get_state(request).shared_memory.status(region_name, kind="cuda")


@router.post(
    f"{CUDA}/region/{{region_name}}/register",
    summary="Register a CUDA shared-memory region: {raw_handle: {b64}, device_id, byte_size} "
    "(400 where the engine is not on a GPU)",
    responses=CONTROL_RESPONSES,
    openapi_extra=CUDA_REGISTER_BODY,
)
async def cuda_register(request: Request, region_name: str) -> dict[str, Any]:
    state = get_state(request)
    if state.shared_memory.cuda_disabled:  # Triton's CPU builds: refused whatever the body
        raise not_supported(region_name, state.shared_memory.cuda_disabled)
    body = await read_json(request, BODY_LIMIT)
    handle = body.get("raw_handle") if isinstance(body, dict) else None
    encoded = handle.get("b64") if isinstance(handle, dict) else None
    if not isinstance(encoded, str):
        raise BadInput("body must be a JSON object with 'raw_handle': {'b64': <base64 string>}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except ValueError:
        raise BadInput("'raw_handle.b64' is not valid base64") from None
    register_cuda(
        state.shared_memory, region_name, raw, body.get("device_id"), body.get("byte_size")
    )
    return {}


@router.post(f"{CUDA}/unregister", summary="Unregister every CUDA region", responses=DONE)
@router.post(
    f"{CUDA}/region/{{region_name}}/unregister",
    summary="Unregister a CUDA shared-memory region (in use: closed after its last request)",
    responses=DONE,
)
async def cuda_unregister(request: Request, region_name: str | None = None) -> dict[str, Any]:
    get_state(request).shared_memory.unregister(region_name, kind="cuda")
    return {}
