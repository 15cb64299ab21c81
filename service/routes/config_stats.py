"""Triton's model configuration and statistics extensions over HTTP."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service.model_config import MODEL_VERSION, model_config
from service.openapi import ERROR_RESPONSES
from service.routes.common import check_model, get_state

router = APIRouter(tags=["model configuration and statistics"])
MODEL_ERRORS = {code: ERROR_RESPONSES[code] for code in (404, 503)}


@router.get(
    "/v2/models/{model_name}/config",
    summary="Model configuration (Triton's model_config.proto as JSON)",
    responses=MODEL_ERRORS,
)
@router.get(
    "/v2/models/{model_name}/versions/{model_version}/config",
    summary="Model configuration (Triton's model_config.proto as JSON)",
    responses=MODEL_ERRORS,
)
async def config(
    request: Request, model_name: str, model_version: str | None = None
) -> dict[str, Any]:
    state = get_state(request)
    check_model(state, model_name, model_version)
    return model_config(state)


@router.get(
    "/v2/models/stats",
    summary="Statistics of every model (Triton's statistics extension)",
    responses={503: ERROR_RESPONSES[503]},
)
@router.get(
    "/v2/models/{model_name}/stats",
    summary="Statistics of a model (Triton's statistics extension)",
    responses=MODEL_ERRORS,
)
@router.get(
    "/v2/models/{model_name}/versions/{model_version}/stats",
    summary="Statistics of a model version (Triton's statistics extension)",
    responses=MODEL_ERRORS,
)
async def stats(
    request: Request, model_name: str | None = None, model_version: str | None = None
) -> dict[str, Any]:
    state = get_state(request)
    if model_name is not None:
        check_model(state, model_name, model_version)
    if model_version not in (None, MODEL_VERSION):
        return {"model_stats": []}
    return {"model_stats": [state.stats.as_dict()]}
