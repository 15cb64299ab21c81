"""Health and metadata routes of the Open Inference Protocol."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service import __version__
from service.datatypes import of_torch
from service.deps import PathModel, State, loaded_state
from service.openapi import ERROR_RESPONSES
from service.text import text_properties

router = APIRouter(tags=["health and metadata"])
MODEL_ERRORS = {code: ERROR_RESPONSES[code] for code in (404, 503)}


@router.get("/v2/health/live", summary="Server live")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get(
    "/v2/health/ready",
    summary="Server ready (all models loaded and warmed up)",
    responses={503: {"description": "Loading, warming up or draining"}},
)
async def ready(request: Request) -> JSONResponse:
    state = loaded_state(request)
    is_ready = bool(state and state.serving)
    return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)


@router.get("/v2", summary="Server metadata")
async def server_metadata() -> dict[str, Any]:
    return {"name": "mha-serve", "version": __version__, "extensions": ["binary_tensor_data"]}


def _tensor(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape}


@router.get("/v2/models/{model_name}", summary="Model metadata", responses=MODEL_ERRORS)
@router.get(
    "/v2/models/{model_name}/versions/{model_version}",
    summary="Model metadata",
    responses=MODEL_ERRORS,
)
async def model_metadata(entry: PathModel) -> dict[str, Any]:
    model = entry.model
    datatype = of_torch(model.dtype)
    inputs = [_tensor("input", datatype, [-1, -1, model.embed_dim])]
    if model.is_cross_attention_capable:
        inputs.append(_tensor("key", datatype, [-1, -1, model.kdim]))
        inputs.append(_tensor("value", datatype, [-1, -1, model.vdim]))
    inputs.append(_tensor("key_padding_mask", "BOOL", [-1, -1]))
    return {
        "name": entry.name,
        "versions": [entry.version],
        "platform": "mha_engine",
        "inputs": inputs,
        "outputs": [_tensor("output", datatype, [-1, -1, model.embed_dim])],
        "properties": {**{k: str(v) for k, v in entry.info.items()}, **text_properties(model)},
    }


@router.get("/v2/models/{model_name}/ready", summary="Model ready", responses=MODEL_ERRORS)
@router.get(
    "/v2/models/{model_name}/versions/{model_version}/ready",
    summary="Model ready",
    responses=MODEL_ERRORS,
)
async def model_ready(state: State, entry: PathModel) -> JSONResponse:
    is_ready = state.serving
    return JSONResponse(
        {"name": entry.name, "ready": is_ready}, status_code=200 if is_ready else 503
    )
