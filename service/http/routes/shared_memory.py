"""Triton's shared-memory extension over HTTP: register, unregister and list system
shared-memory regions (service.shm.regions); CUDA shared memory answers 400 "GPUs not supported"
on registration, as Triton's CPU builds do (status lists none, unregistering has nothing to
remove)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service.http.body import read_json
from service.http.deps import get_state
from service.http.openapi import ERROR_RESPONSES
from service.http.routes.repository import BODY_LIMIT
from service.pipeline.errors import BadInput
from service.shm.regions import cuda_unsupported

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
DONE = {
    200: {"description": "Done", "content": {"application/json": {"schema": {}}}},
    503: ERROR_RESPONSES[503],
}
CONTROL_RESPONSES = {**DONE, **{code: ERROR_RESPONSES[code] for code in (400, 413, 429)}}
REGISTER_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "key": {"type": "string", "description": "shm_open name, e.g. /input0"},
                        "offset": {"type": "integer", "minimum": 0, "default": 0},
                        "byte_size": {"type": "integer", "minimum": 1},
                    },
                    "required": ["key", "byte_size"],
                }
            }
        },
    }
}


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


@router.get(f"{CUDA}/status", summary="CUDA shared memory: none on a CPU build", responses=DONE)
async def cuda_status(request: Request) -> list[dict[str, Any]]:
    return []


@router.get(f"{CUDA}/region/{{region_name}}/status", include_in_schema=False)
@router.post(
    f"{CUDA}/region/{{region_name}}/register",
    summary="CUDA shared memory: not supported on a CPU build (400)",
    responses=CONTROL_RESPONSES,
    openapi_extra={"requestBody": {"content": {"application/json": {"schema": {}}}}},
)
async def cuda_register(request: Request, region_name: str) -> dict[str, Any]:
    raise cuda_unsupported(region_name)


@router.post(
    f"{CUDA}/unregister", summary="CUDA shared memory: nothing to unregister", responses=DONE
)
@router.post(f"{CUDA}/region/{{region_name}}/unregister", include_in_schema=False)
async def cuda_unregister(request: Request, region_name: str | None = None) -> dict[str, Any]:
    return {}
