"""GET /v1/models and /v1/models/{id}: OpenAI's model list and model object for the served models
that /v1/embeddings accepts (text models with an embedding head); tensor-only models and
classifiers are left out, as an OpenAI client could not use them."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel

from service.http.deps import State
from service.http.openapi import OPENAI_ERROR_RESPONSES
from service.pipeline.errors import ModelNotFound
from service.text.kinds import model_kind

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


def _served(state: State) -> list[ModelObject]:
    """The models /v1/embeddings accepts (its embedding_entry's test), in serving order."""
    return [
        ModelObject(id=name, created=int(state.started_at))
        for name, entry in state.models.items()
        if entry.tokenizer is not None and model_kind(entry.model) == "embedding"
    ]


@router.get("/v1/models", summary="Models served (OpenAI-compatible)")
async def list_models(state: State) -> ModelList:
    return ModelList(data=_served(state))


@router.get("/v1/models/{model_id:path}", summary="One served model (OpenAI-compatible)")
async def get_model(model_id: str, state: State) -> ModelObject:
    for served in _served(state):
        if served.id == model_id:
            return served
    names = ", ".join(f"'{m.id}'" for m in _served(state)) or "none"
    raise ModelNotFound(
        f"The model '{model_id}' does not exist; this server's embedding models are {names}",
        param="model",
    )
