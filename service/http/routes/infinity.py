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
from starlette.concurrency import run_in_threadpool

from service.http.body import parse_json, read_body
from service.http.deps import get_state, traced
from service.http.openapi import OPENAI_ERROR_RESPONSES, json_body
from service.http.routes import embeddings, rerank_api
from service.http.routes.common import client_gone, json_response, observed
from service.http.routes.tei_common import validate
from service.pipeline.errors import BadInput
from service.pipeline.models import ensure_serving
from service.text.kinds import model_kind, offers
from service.text.tei_ops import encode_texts, instruction, predictions, text_entry
from service.text.tokenizer import Text, classify_runner, typed_payload
from service.text.work import TOKENIZE_CHUNK_CHARS, run_parts

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry, ServiceState

router = APIRouter(tags=["infinity-emb"], responses=OPENAI_ERROR_RESPONSES)

STARTED = time.time()  # infinity's `created`: when this process loaded its routes
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
    what = f"{'an' if what[0] in 'aeiou' else 'a'} {what}"
    if entry is not None:
        raise BadInput(
            f"model '{name}' is not {what} model ({model_kind(entry.model)}); the models "
            f"it could be are {names}",
            param="model",
        )
    raise BadInput(f"unknown model '{name}': name {what} model: {names}", param="model")


def _ids() -> dict[str, Any]:
    return {"id": f"infinity-{uuid.uuid4()}", "created": int(time.time())}


def _embeddings_request(body: bytes, state: ServiceState) -> tuple:
    """infinity's fields mapped onto /v1/embeddings' (embeddings.check_request)."""
    fields = parse_json(body)
    if not isinstance(fields, dict):
        raise BadInput("body must be a JSON object with 'input'")
    modality = fields.pop("modality", "text")
    if modality != "text":
        raise BadInput(
            f"modality {modality!r} is not served: only text models here", param="modality"
        )
    zero = fields.get("dimensions")
    if type(zero) is int and zero == 0:
        del fields["dimensions"]  # infinity's "the whole vector"
    model = fields.get("model")
    name = infinity_entry(state, model if isinstance(model, str) else None, "embedding").name
    return embeddings.check_request({**fields, "model": name}, state)


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
        if len(body) > TOKENIZE_CHUNK_CHARS:  # as /v1/embeddings: big bodies off the loop
            parsed = await run_in_threadpool(_embeddings_request, bytes(body), state)
        else:
            parsed = _embeddings_request(bytes(body), state)
        del body
        entry, texts, fmt, dims = parsed
        seen.label(entry.metrics or state.metrics)
        with traced(state, request.scope, entry, "embeddings"):
            return await embeddings.embed_texts(state, request, entry, texts, fmt, dims, started,
                                          deadline)  # fmt: skip


def rerank_entry(state: ServiceState, name: Any, mount: str | None) -> ModelEntry:
    """The reranker of an infinity body on /rerank: the mount's (a body naming another served
    model is refused), else as infinity_entry resolves the body's `model`."""
    if mount is None:
        if not any(e.tokenizer is not None and offers(e.model, "reranker")
                   for e in state.models.values()):  # fmt: skip
            return text_entry(state, "/rerank", "reranker")  # 424 naming what is served
        return infinity_entry(state, name if isinstance(name, str) else None, "reranker")
    entry = text_entry(state, "/rerank", "reranker", model=mount)
    if isinstance(name, str) and name != mount and name in state.models:
        raise BadInput(f"the path names model '{mount}' and the body '{name}'", param="model")
    return entry


async def infinity_rerank(request: Request, raw: dict[str, Any], entry: ModelEntry) -> Response:
    """POST /rerank with infinity's body (query, documents, return_documents, raw_scores,
    top_n, model) for `entry` (rerank_entry's): Cohere's scoring and limits
    (service/http/routes/rerank_api.py), infinity's answer: results best first, each
    `document` the text itself (or null)."""
    state = get_state(request)
    body = validate(rerank_api.RerankApiRequest, raw)
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
    """Every label with its score per text, best first: /predict's scores (the model's default
    prompt included), counted as /predict (endpoint "predict"); up to /v1/rerank's batch
    bound, every text truncated to the model's length, as infinity does."""
    state = get_state(request)
    with observed(state, "predict") as seen:
        ensure_serving(state)
        raw = parse_json(bytes(await read_body(request, state.settings.max_body_bytes)))
        if not isinstance(raw, dict):
            raise BadInput("body must be a JSON object with 'input'")
        body = validate(ClassifyRequest, raw)
        entry = infinity_entry(state, body.model, "classifier", "reranker")
        seen.label(entry.metrics or state.metrics)
        limit = embeddings.max_inputs(state)
        if not body.input or len(body.input) > limit:
            raise BadInput(f"'input' has {len(body.input)} texts; send 1 to {limit}", param="input")
        texts: list[Text] = list(body.input)
        deadline = time.monotonic() + state.settings.request_timeout_s
        prompt = instruction(entry, None)
        with traced(state, request.scope, entry, "predict"), client_gone(request) as gone:
            encoded = await encode_texts(gone, state, entry, texts, True, "Right", deadline,
                                         "input", prompt)  # fmt: skip
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
