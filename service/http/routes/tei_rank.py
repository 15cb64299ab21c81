"""text-embeddings-inference's routes for sequence-classification models: /rerank (a reranker,
i.e. one label: a query scored against each text) and /predict (single texts or pairs, one
score per label), plus the Hugging Face text-classification shape that POST / answers.

Scores follow transformers' text-classification pipeline: sigmoid for one label or a
multi-label problem, softmax otherwise, the logits themselves for regression or `raw_scores`.
Pairs are tokenized as the model's tokenizer pairs them ([CLS] a [SEP] b [SEP], b of token
type 1 for BERT) and every request goes through the batcher's classify runner.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from service.http.body import read_object
from service.http.deps import get_state, traced
from service.http.openapi import TEI_ERROR_RESPONSES, json_body
from service.http.routes import infinity
from service.http.routes.common import client_gone, json_response, observed
from service.http.routes.rerank_api import RerankApiRequest
from service.http.routes.tei_common import parse_body, routed_model, text_route, validate
from service.pipeline.errors import BadInput
from service.pipeline.models import ensure_serving
from service.text.tei_ops import (
    Direction,
    check_batch,
    check_query,
    encode_texts,
    instruction,
    predictions,
    ranked,
    text_entry,
)
from service.text.tokenizer import Text, classify_runner, typed_payload
from service.text.work import run_parts

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry, ServiceState

router = APIRouter(tags=["text-embeddings-inference"], responses=TEI_ERROR_RESPONSES)


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None  # None: --auto-truncate decides
    truncation_direction: Direction = "Right"
    instruction: str | None = Field(
        None,
        description="The task, for rerankers that read one (Qwen3-Reranker: the system "
        "message; others: prepended to the query); absent: the model's default prompt",
    )


class Rank(BaseModel):
    index: int
    score: float
    text: str | None = None


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: str | list[str] | list[list[str]] = Field(
        description="A text, a pair [a, b], or a batch of [text] and [a, b] items"
    )
    raw_scores: bool = False
    truncate: bool | None = None  # None: --auto-truncate decides
    truncation_direction: Direction = "Right"


class Prediction(BaseModel):
    label: str
    score: float


class HubParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    top_k: int | None = Field(None, ge=1)
    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None


class HubPredictRequest(BaseModel):
    """huggingface_hub's text_classification body: {"inputs": text, "parameters": {...}}."""

    model_config = ConfigDict(extra="forbid")
    inputs: str | list[str]
    parameters: HubParameters | None = None


async def _logits(
    request: Request,
    state: ServiceState,
    entry: ModelEntry,
    texts: list[Text],
    truncate: bool | None,
    direction: Direction,
    field: str,
    given: str | None = None,
) -> list[np.ndarray]:
    """Texts or pairs -> logits (num_labels,) each, through `entry`'s batcher; `given`: the
    request's instruction (tei_ops.instruction)."""
    deadline = time.monotonic() + state.settings.request_timeout_s
    prompt = instruction(entry, given)
    with client_gone(request) as gone:
        encoded = await encode_texts(
            gone, state, entry, texts, truncate, direction, deadline, field, prompt
        )
        return await run_parts(
            state, entry, gone, encoded, deadline, classify_runner, typed_payload
        )


def _predict_inputs(
    state: ServiceState, inputs: str | list[str] | list[list[str]]
) -> tuple[list[Text], bool]:
    """TEI's three input forms -> (texts or pairs, whether it was a batch)."""
    if isinstance(inputs, str):
        return [inputs], False
    if inputs and all(isinstance(x, str) for x in inputs):
        if len(inputs) != 2:
            raise BadInput(
                f"'inputs' is a list of {len(inputs)} strings; a list of strings must be one "
                'pair ["a", "b"]; send a batch as [["text"], ["a", "b"], ...]'
            )
        return [(inputs[0], inputs[1])], False
    check_batch(state, len(inputs))
    items: list[Text] = []
    for i, item in enumerate(inputs):
        if not isinstance(item, list) or len(item) not in (1, 2):
            raise BadInput(f"inputs[{i}] must be [text] or [a, b], got {len(item)} strings")
        items.append(item[0] if len(item) == 1 else (item[0], item[1]))
    return items, True


@router.post(
    "/rerank",
    summary="Texts ranked by relevance to a query (TEI)",
    response_model=list[Rank],
    response_model_exclude_none=True,
    openapi_extra=json_body(RerankRequest, RerankApiRequest),
)
async def rerank(request: Request) -> Response:
    state = get_state(request)
    mount = routed_model(request)
    with observed(state, "rerank") as seen:  # labelled once the model is known
        raw = await read_object(request, state.settings.max_body_bytes)
        infinity_body = "documents" in raw and "texts" not in raw  # infinity-emb's: its answer
        if infinity_body:
            entry = infinity.rerank_entry(state, raw.get("model"), mount)
        else:
            entry = text_entry(state, "/rerank", "reranker", model=mount)
        seen.label(entry.metrics or state.metrics)
        with traced(state, request.scope, entry, "rerank"):
            if infinity_body:
                return await infinity.infinity_rerank(request, raw, entry)
            return await _tei_rerank(request, state, entry, raw)


async def _tei_rerank(
    request: Request, state: ServiceState, entry: ModelEntry, raw: dict
) -> Response:
    """TEI's /rerank once its reranker is chosen."""
    body = validate(RerankRequest, raw)
    ensure_serving(state)
    check_query(body.query)
    check_batch(state, len(body.texts), "texts")
    pairs: list[Text] = [(body.query, text) for text in body.texts]
    logits = await _logits(
        request,
        state,
        entry,
        pairs,
        body.truncate,
        body.truncation_direction,
        "texts",
        body.instruction,
    )
    values, order = ranked(logits, body.raw_scores)
    ranks = [{"index": i, "score": values[i]} for i in order]  # Rank, without a None text
    if body.return_text:
        for rank in ranks:
            rank["text"] = body.texts[rank["index"]]
    return json_response(ranks)


@router.post(
    "/predict",
    summary="Label scores of texts or text pairs (TEI)",
    response_model=list[Prediction] | list[list[Prediction]],
    openapi_extra=json_body(PredictRequest),
)
async def predict(request: Request) -> Response:
    state = get_state(request)
    with text_route(request, state, "predict", "/predict", "classifier", "reranker") as entry:
        body = await parse_body(request, state, PredictRequest)
        ensure_serving(state)
        texts, batch = _predict_inputs(state, body.inputs)
        logits = await _logits(
            request, state, entry, texts, body.truncate, body.truncation_direction, "inputs"
        )
        how = "none" if body.raw_scores else None
        results = [predictions(entry, x, how) for x in logits]
        return json_response(results if batch else results[0])


async def hub_predict(body: HubPredictRequest, request: Request) -> Response:
    """POST / for a classifier: one list of label scores per input (top_k best, if given)."""
    state = get_state(request)
    with text_route(request, state, "predict", "/", "classifier", "reranker") as entry:
        ensure_serving(state)
        texts: list[Text] = [body.inputs] if isinstance(body.inputs, str) else list(body.inputs)
        check_batch(state, len(texts))
        params = body.parameters or HubParameters()
        logits = await _logits(request, state, entry, texts, None, "Right", "inputs")
        return json_response(
            [predictions(entry, x, params.function_to_apply)[: params.top_k] for x in logits]
        )
