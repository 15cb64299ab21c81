"""infinity-emb's routes at its default (empty) prefix, so its users and its generated client
(`infinity_client`) point at this server unchanged: POST /embeddings (OpenAI's shape, with
infinity's `modality` and `dimensions: 0`), POST /classify, GET /models, and infinity's body
on POST /rerank (`documents`; TEI's `texts` body keeps TEI's answer there). GET /health answers
infinity's `{"unix": ...}` body (service/http/routes/tei_mount.py).

As infinity does: a `model` that names no served model is the one model that can answer, when
only one can (its clients send "default/not-specified"); with several, 400 naming them.
Errors are OpenAI's shape, as infinity's are.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from service.http.body import parse_json, read_body
from service.http.deps import get_state, traced
from service.http.openapi import OPENAI_ERROR_RESPONSES, json_body
from service.http.routes import embeddings, rerank_api
from service.http.routes.common import client_gone, json_response, observed
from service.http.routes.tei_common import validate
from service.pipeline.errors import BadInput
from service.pipeline.models import ensure_serving
from service.text.tei_ops import check_batch, encode_texts, predictions
from service.text.tokenizer import Text, classify_runner, model_kind, offers, typed_payload
from service.text.work import run_parts

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry, ServiceState

router = APIRouter(tags=["infinity-emb"], responses=OPENAI_ERROR_RESPONSES)

STARTED = time.time()  # infinity's `created`: when the server started
CAPABILITIES = {  # infinity's names for what a model answers
    "embedding": ["embed"],
    "sparse": [],
    "classifier": ["classify"],
    "reranker": ["rerank", "classify"],
}


def infinity_entry(state: ServiceState, name: str | None, *kinds: str) -> ModelEntry:
    """The served text model `name` names if it is of one of `kinds`; else (infinity's rule)
    the one served text model of the first of `kinds` any model is, when there is exactly one
    (/classify: a classifier, else a reranker); 400 naming the candidates otherwise."""
    texts = [e for e in state.models.values() if e.tokenizer is not None]
    fits = {k: [e for e in texts if offers(e.model, k)] for k in kinds}
    entry = state.models.get(name) if name else None
    if entry is not None and any(entry in fit for fit in fits.values()):
        return entry
    first = next((fit for fit in fits.values() if fit), [])
    if entry is None and len(first) == 1:
        return first[0]
    what = " or ".join(kinds)
    names = ", ".join(repr(e.name) for e in first) or f"none (no {what} model is served)"
    if entry is not None:
        raise BadInput(
            f"model '{name}' is not a {what} model ({model_kind(entry.model)}); the models "
            f"it could be are {names}",
            param="model",
        )
    raise BadInput(f"unknown model '{name}': name one of the {what} models: {names}", param="model")


def _ids() -> dict[str, Any]:
    return {"id": f"infinity-{uuid.uuid4()}", "created": int(time.time())}


@router.post(
    "/embeddings",
    summary="Sentence embeddings (infinity-emb's route: OpenAI's shape, text modality)",
    openapi_extra=embeddings.OPENAPI,
    response_class=Response,
)
async def infinity_embeddings(request: Request) -> Response:
    """/v1/embeddings with infinity's fields: `modality` must be "text" (no image or audio
    models here), `dimensions` 0 is the full vector, `model` as infinity_entry resolves it."""
    state = get_state(request)
    with observed(state, "embeddings") as seen:
        ensure_serving(state)
        body = await read_body(request, state.settings.max_body_bytes)
        started = time.perf_counter()
        deadline = time.monotonic() + state.settings.request_timeout_s
        fields = parse_json(bytes(body))
        if not isinstance(fields, dict):
            raise BadInput("body must be a JSON object with 'input'")
        modality = fields.pop("modality", "text")
        if modality != "text":
            raise BadInput(
                f"modality {modality!r} is not served: only text models here", param="modality"
            )
        if fields.get("dimensions") == 0:
            del fields["dimensions"]  # infinity's "the whole vector"
        model = fields.get("model")
        fields["model"] = infinity_entry(
            state, model if isinstance(model, str) else None, "embedding"
        ).name
        entry, texts, fmt, dims = embeddings.check_request(fields, state)
        seen.label(entry.metrics or state.metrics)
        with traced(state, request.scope, entry, "embeddings"):
            return await embeddings.embed_texts(state, request, entry, texts, fmt, dims, started,
                                          deadline)  # fmt: skip


async def infinity_rerank(request: Request, raw: dict[str, Any], default: ModelEntry) -> Response:
    """POST /rerank with infinity's body (query, documents, return_documents, raw_scores,
    top_n, model): Cohere's scoring (service/http/routes/rerank_api.py), infinity's answer:
    results best first, each `document` the text itself (or null)."""
    state = get_state(request)
    body = validate(rerank_api.RerankApiRequest, raw)
    entry = default
    if body.model is not None and body.model != default.name:
        entry = infinity_entry(state, body.model, "reranker")
    values, order, tokens = await rerank_api.score(request, state, entry, body)
    results = []
    for i in order[: body.top_n or None]:
        document = body.documents[i] if body.return_documents else None
        if isinstance(document, dict):
            document = document.get("text")
        results.append({"relevance_score": values[i], "index": i, "document": document})
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    answer = {"object": "rerank", "results": results, "model": entry.name, "usage": usage}
    return json_response({**answer, **_ids()})


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: list[str] = Field(description="Texts to classify (a list, as infinity takes it)")
    model: str | None = Field(None, description="A served classifier; one served: any name")
    raw_scores: bool = Field(False, description="The logits themselves (infinity ignores it)")


@router.post(
    "/classify",
    summary="Label scores of texts (infinity-emb)",
    openapi_extra=json_body(ClassifyRequest),
)
async def classify(request: Request) -> Response:
    """Every label with its score per text, best first (the /predict scores)."""
    state = get_state(request)
    with observed(state, "classify") as seen:
        ensure_serving(state)
        raw = parse_json(bytes(await read_body(request, state.settings.max_body_bytes)))
        if not isinstance(raw, dict):
            raise BadInput("body must be a JSON object with 'input'")
        body = validate(ClassifyRequest, raw)
        entry = infinity_entry(state, body.model, "classifier", "reranker")
        seen.label(entry.metrics or state.metrics)
        check_batch(state, len(body.input), "input")
        texts: list[Text] = list(body.input)
        deadline = time.monotonic() + state.settings.request_timeout_s
        with traced(state, request.scope, entry, "classify"), client_gone(request) as gone:
            encoded = await encode_texts(gone, state, entry, texts, None, "Right", deadline,
                                         "input")  # fmt: skip
            logits = await run_parts(state, entry, gone, encoded, deadline, classify_runner,
                                     typed_payload)  # fmt: skip
        how = "none" if body.raw_scores else None
        tokens = sum(len(e.ids) for e in encoded)
        answer = {
            "object": "classify",
            "data": [predictions(entry, x, how) for x in logits],
            "model": entry.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return json_response({**answer, **_ids()})


@router.get("/models", summary="The served text models and what each answers (infinity-emb)")
async def models(request: Request) -> Response:
    """infinity's model list: per served text model its id, what it answers (`capabilities`:
    embed, rerank, classify) and its queue."""
    state = get_state(request)
    started = int(STARTED)
    data = []
    for entry in state.models.values():
        if entry.tokenizer is None:
            continue
        batcher = entry.batcher
        waiting = batcher.queued_sequences
        capabilities = list(CAPABILITIES[model_kind(entry.model)])
        if offers(entry.model, "sparse"):
            capabilities.append("sparse")  # /embed_sparse (SPLADE, BGE-M3); not infinity's
        stats = {
            "queue_absolute": waiting,
            "queue_fraction": waiting / batcher.max_queue,
            "batch_size": batcher.max_batch_size,
        }
        data.append(
            {
                "id": entry.name,
                "object": "model",
                "created": started,
                "backend": "mha-serve",
                "capabilities": capabilities,
                "stats": stats,
            }
        )
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")
