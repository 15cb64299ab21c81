"""TEI's /health, SageMaker's /ping and /invocations (as TEI serves them), and where every TEI
route is mounted: at the root, where a route uses the first served text model that fits, and
under /models/{model_name}, where it uses that model (huggingface_hub's own layout, so
InferenceClient(base_url=".../models/NAME") reaches it; POST /models/NAME is its POST /)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, FastAPI, Path, Request
from fastapi.responses import Response

from service.http.deps import get_state, loaded_state
from service.http.openapi import TEI_ERROR_RESPONSES, json_body
from service.http.routes import tei, tei_rank
from service.http.routes.common import json_response
from service.http.routes.tei import (
    ROOT_OPENAPI,
    EmbedRequest,
    EmbedSparseRequest,
    embed_body,
    embed_sparse,
    root,
)
from service.http.routes.tei_common import parse_body, routed_model
from service.http.routes.tei_rank import PredictRequest, RerankRequest, predict, rerank
from service.pipeline.errors import NotReady
from service.text.kinds import model_kind
from service.text.tei_ops import text_entry

router = APIRouter(tags=["text-embeddings-inference"], responses=TEI_ERROR_RESPONSES)

HEALTH_RESPONSES = {
    200: {
        "description": 'Ready: every model warmed up, not draining ({"unix": <time>}, the body '
        "infinity-emb's /health answers; TEI's is empty and its clients read the status only)"
    },
    503: TEI_ERROR_RESPONSES[503],
}


@router.get("/health", summary="Health (TEI)", response_class=Response, responses=HEALTH_RESPONSES)
@router.get(
    "/ping",
    summary="Health (SageMaker, as TEI serves it)",
    response_class=Response,
    responses=HEALTH_RESPONSES,
)
async def health(request: Request) -> Response:
    """200 with {"unix": <time>} (infinity-emb's body; TEI's clients read only the status) while
    ready (under /models/{name}: that model ready), else 503 in TEI's error shape; probes use
    it, so it never runs the model."""
    state = loaded_state(request)
    if state is None:
        raise NotReady("model is still loading")
    name = routed_model(request)
    ready = state.model_ready(state.find(name)) if name is not None else state.serving
    if not ready:
        raise NotReady("not ready: warming up, unloading or draining")
    return json_response({"unix": time.time()})


@router.post(
    "/invocations",
    summary="SageMaker's inference route, as TEI answers it: /embed for an embedding model, "
    "/embed_sparse for a SPLADE model, /predict for a classifier, /rerank for a reranker (the "
    "first text model, or the one the path names)",
    openapi_extra=json_body(EmbedRequest, PredictRequest, RerankRequest, EmbedSparseRequest),
)
async def invocations(request: Request):
    state = get_state(request)
    kind = model_kind(text_entry(state, "/invocations", model=routed_model(request)).model)
    if kind == "embedding":
        return await embed_body(await parse_body(request, state, EmbedRequest), request)
    if kind == "sparse":
        return await embed_sparse(request)
    if kind == "classifier":
        return await predict(request)
    return await rerank(request)


MODEL_MOUNT = "/models/{model_name}"  # huggingface_hub's layout: InferenceClient(base_url=...)


async def _model_name(
    model_name: str = Path(description="A served text model: these routes use it"),
) -> None:
    """Declares the mount's path parameter; the handlers read it through routed_model()."""


def install(app: FastAPI) -> None:
    """The TEI and SageMaker routes at the root (the first text model that fits) and under
    /models/{model_name} (that model), where POST /models/{model_name} is that model's POST /."""
    per_model = [Depends(_model_name)]
    for routes in (tei.router, tei_rank.router, router):
        app.include_router(routes)
        app.include_router(routes, prefix=MODEL_MOUNT, dependencies=per_model)
    app.add_api_route(
        MODEL_MOUNT,
        root,
        methods=["POST"],
        summary="One model's POST / (huggingface_hub's InferenceClient(base_url=.../models/NAME))",
        openapi_extra=ROOT_OPENAPI,
        dependencies=per_model,
        tags=["text-embeddings-inference"],
        responses=TEI_ERROR_RESPONSES,
    )
