"""GET /v1/models and /v1/models/{id}: OpenAI's model list and model object for what is served."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel

from service.errors import ModelNotFound
from service.openapi import OPENAI_ERROR_RESPONSES
from service.routes.common import get_state

router = APIRouter(tags=["embeddings"], responses=OPENAI_ERROR_RESPONSES)

OWNER = "mha-serve"


class ModelObject(BaseModel):
    """OpenAI's model object; `created` is when this server loaded it (Unix seconds)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = OWNER


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


def _served(request: Request) -> ModelObject:
    state = get_state(request)
    return ModelObject(id=state.model_name, created=int(state.started_at))


@router.get("/v1/models", summary="Models served (OpenAI-compatible)")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_served(request)])


@router.get("/v1/models/{model_id:path}", summary="One served model (OpenAI-compatible)")
async def get_model(model_id: str, request: Request) -> ModelObject:
    served = _served(request)
    if model_id != served.id:
        raise ModelNotFound(
            f"The model '{model_id}' does not exist; this server serves '{served.id}'",
            param="model",
        )
    return served
