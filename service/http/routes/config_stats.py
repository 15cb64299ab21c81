"""Triton's model configuration and statistics extensions over HTTP."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.http.deps import PathModel, State
from service.http.openapi import ERROR_RESPONSES
from service.http.openapi_extensions import MODEL_CONFIG, STATISTICS, ok
from service.oip.model_config import model_config

router = APIRouter(tags=["model configuration and statistics"])
MODEL_ERRORS = {code: ERROR_RESPONSES[code] for code in (404, 503)}
CONFIG_RESPONSES = {**ok(MODEL_CONFIG, "Triton's model configuration"), **MODEL_ERRORS}
STATS_RESPONSES = {**ok(STATISTICS, "Triton's model statistics"), **MODEL_ERRORS}


@router.get(
    "/v2/models/{model_name}/config",
    summary="Model configuration (Triton's model_config.proto as JSON)",
    responses=CONFIG_RESPONSES,
)
@router.get(
    "/v2/models/{model_name}/versions/{model_version}/config",
    summary="Model configuration (Triton's model_config.proto as JSON)",
    responses=CONFIG_RESPONSES,
)
async def config(entry: PathModel) -> dict[str, Any]:
    return model_config(entry)


@router.get(
    "/v2/models/stats",
    summary="Statistics of every model (Triton's statistics extension)",
    responses={**ok(STATISTICS, "Triton's model statistics"), 503: ERROR_RESPONSES[503]},
)
async def all_stats(state: State) -> dict[str, Any]:
    return {"model_stats": [await entry.stats.snapshot() for entry in state.entries()]}


@router.get(
    "/v2/models/{model_name}/stats",
    summary="Statistics of a model (Triton's statistics extension)",
    responses=STATS_RESPONSES,
)
@router.get(
    "/v2/models/{model_name}/versions/{model_version}/stats",
    summary="Statistics of a model version (Triton's statistics extension)",
    responses=STATS_RESPONSES,
)
async def stats(state: State, entry: PathModel, model_version: str = "") -> dict[str, Any]:
    """One model version's statistics, or with no version every served version's (Triton's
    answer); an unknown model or version: 404."""
    if model_version:
        return {"model_stats": [await entry.stats.snapshot()]}
    versions = state.versions[entry.name]
    return {
        "model_stats": [
            await versions[v].stats.snapshot() for v in state.served_versions(entry.name)
        ]
    }
