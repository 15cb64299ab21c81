"""The rerank API that RAG stacks call: Cohere's `POST /v1/rerank` and `POST /v2/rerank`, which
Jina, vLLM and infinity-emb also serve (Open WebUI, LangChain and LlamaIndex rerankers post to
it). One reranker (a cross-encoder with one label) scores the query against each document,
through the same pair tokenizing and batcher as TEI's /rerank; relevance_score is the sigmoid of
the logit, best first.

Where it differs from TEI's /rerank: the model is named in the body (optional: the first
reranker otherwise), documents may be objects (Cohere v1: `text`, or the `rank_fields` named, as
"field: value" lines; the object comes back whole), each document is first cut to
`max_tokens_per_doc` tokens where the request says so, a pair longer than the model's maximum
is truncated as Cohere's API does (the longer side first), `top_n` cuts the list, and the batch
bound is /v1/embeddings' (--max-queue, at most 2048), not TEI's 32.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from service.http.deps import get_state, traced
from service.http.openapi import ERROR_RESPONSES, OPENAI_ERROR_RESPONSES, json_body
from service.http.routes.common import client_gone, json_response, observed
from service.http.routes.embeddings import max_inputs
from service.http.routes.tei_common import parse_body
from service.pipeline.errors import BadInput, PayloadTooLarge, WrongModelKind
from service.pipeline.models import ensure_serving
from service.text.tei_ops import check_query, encode_texts, instruction, ranked, text_entry
from service.text.tokenizer import Text, classify_runner, typed_payload
from service.text.work import run_parts

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry, ServiceState

router = APIRouter(tags=["rerank (Cohere, Jina)"])


class RerankApiRequest(BaseModel):
    """Cohere v1 and v2's fields (Jina's are a subset), infinity-emb's raw_scores and vLLM's
    truncate_prompt_tokens; an option that would change the answer and is not computed here
    is refused by _check, saying so."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="A served reranker; absent: the first one")
    query: str
    documents: list[str | dict[str, Any]] = Field(
        description='Texts, or objects with "text" (or the fields rank_fields names)'
    )
    top_n: int | None = Field(None, ge=0, description="The best n only; 0 or absent: all")
    raw_scores: bool = Field(False, description="relevance_score is the logit (infinity-emb)")
    return_documents: bool = Field(False, description="Each result carries its document")
    rank_fields: list[str] | None = Field(None, description="Object fields ranked (Cohere v1)")
    max_chunks_per_doc: int | None = Field(None, ge=1, description="Only 1 (no chunking)")
    max_tokens_per_doc: int | None = Field(
        None, ge=1, description="Each document cut to this many tokens first (Cohere's)"
    )
    priority: int | None = Field(None, description="Accepted; requests run in arrival order")
    relevant_spans: dict[str, Any] | None = Field(
        None, description='Cohere v2: only {"mode": "disabled"} (no spans are computed)'
    )
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="vLLM: -1 or at least the model's maximum length"
    )
    instruction: str | None = Field(
        None,
        description="The task, for rerankers that read one (Qwen3-Reranker; TEI's /rerank "
        "field); absent: the model's default prompt",
    )


class RankedDocument(BaseModel):
    index: int
    relevance_score: float
    document: dict[str, Any] | None = None


class RerankApiResponse(BaseModel):
    id: str
    model: str
    results: list[RankedDocument]
    usage: dict[str, int]
    meta: dict[str, Any]


def _ranked_text(i: int, document: str | dict[str, Any], fields: list[str]) -> str:
    """The text scored for documents[i]: a string itself, an object's fields as YAML-like
    "field: value" lines (Cohere's advice for structured data), or its "text" alone."""
    if isinstance(document, str):
        text = document
    elif fields == ["text"]:
        text = document.get("text")  # type: ignore[assignment]
        if not isinstance(text, str):
            raise BadInput(f"documents[{i}] is an object without a string 'text'")
    else:
        missing = [f for f in fields if not isinstance(document.get(f), str)]
        if missing:
            raise BadInput(f"documents[{i}] has no string field(s) {missing} (rank_fields)")
        text = "\n".join(f"{f}: {document[f]}" for f in fields)
    if not text:
        raise BadInput(f"documents[{i}] is an empty text; empty documents have no score")
    return text


def _reranker(state: ServiceState, path: str, name: str | None) -> ModelEntry:
    """The reranker the body names (404 for an unknown name), or the first one served. A model
    of another kind is a bad request (400, as /v1/embeddings answers), not TEI's 424: here the
    client chose it."""
    try:
        return text_entry(state, path, "reranker", model=name)
    except WrongModelKind as exc:
        raise BadInput(exc.message, param="model") from None


def _check(body: RerankApiRequest, state: ServiceState, entry: ModelEntry) -> list[str]:
    """The bounds and the options this server cannot honour, before any work; the texts."""
    check_query(body.query)
    if not body.documents:
        raise BadInput("'documents' is an empty list; send at least one document")
    limit = max_inputs(state)
    if len(body.documents) > limit:
        raise PayloadTooLarge(
            f"'documents' has {len(body.documents)} items; at most {limit} per request"
        )
    if body.max_chunks_per_doc not in (None, 1):
        raise BadInput(
            "'max_chunks_per_doc' must be 1 here: a long document is not chunked, its pair "
            "with the query is truncated to the model's maximum length"
        )
    max_length = entry.tokenizer.max_length  # type: ignore[union-attr]
    cut = body.truncate_prompt_tokens
    if cut is not None and cut != -1 and cut < max_length:
        raise BadInput(
            f"'truncate_prompt_tokens' must be at least this model's {max_length} tokens (or "
            "-1, or absent): pairs are truncated to the model's maximum, not shorter"
        )
    spans = body.relevant_spans
    if spans is not None and spans.get("mode") != "disabled":
        raise BadInput(
            '\'relevant_spans\' must be absent or {"mode": "disabled"}: this server does '
            "not compute spans"
        )
    fields = ["text"] if body.rank_fields is None else body.rank_fields
    if not fields or len(set(fields)) != len(fields):
        raise BadInput("'rank_fields' must name distinct fields")
    return [_ranked_text(i, d, fields) for i, d in enumerate(body.documents)]


async def _rerank(request: Request, version: str) -> Response:
    state = get_state(request)
    with observed(state, "rerank_api") as seen:
        body = await parse_body(request, state, RerankApiRequest)
        entry = _reranker(state, request.url.path, body.model)
        seen.label(entry.metrics or state.metrics)
        with traced(state, request.scope, entry, "rerank_api"):
            return await _answer(request, state, entry, body, version)


async def _answer(
    request: Request, state: ServiceState, entry: ModelEntry, body: RerankApiRequest, version: str
) -> Response:
    """The request once its body is parsed and its reranker chosen: Cohere's answer."""
    values, order, tokens = await score(request, state, entry, body)
    results = []
    for i in order[: body.top_n or None]:  # 0: all (vLLM's default)
        result: dict[str, Any] = {"index": i, "relevance_score": values[i]}
        if body.return_documents:
            document = body.documents[i]
            result["document"] = {"text": document} if isinstance(document, str) else document
        results.append(result)
    return json_response(
        {
            "id": request.scope["state"]["request_id"],
            "model": entry.name,
            "results": results,
            "usage": {"total_tokens": tokens},
            "meta": {"api_version": {"version": version}, "billed_units": {"search_units": 1}},
        }
    )


async def score(
    request: Request, state: ServiceState, entry: ModelEntry, body: RerankApiRequest
) -> tuple[list[float], list[int], int]:
    """Tokenize and score every (query, document) pair: (scores, indices best first, tokens)."""
    ensure_serving(state)
    texts = _check(body, state, entry)
    pairs: list[Text] = [(body.query, text) for text in texts]
    deadline = time.monotonic() + state.settings.request_timeout_s
    with client_gone(request) as gone:
        prompt = instruction(entry, body.instruction)
        encoded = await encode_texts(
            gone, state, entry, pairs, True, "Right", deadline, "documents", prompt,
            body.max_tokens_per_doc,
        )  # fmt: skip
        logits = await run_parts(
            state, entry, gone, encoded, deadline, classify_runner, typed_payload
        )
    values, order = ranked(logits, body.raw_scores)
    return values, order, sum(len(e.ids) for e in encoded)


@router.post(
    "/v1/rerank",
    summary="Documents ranked by relevance to a query (Cohere v1, Jina)",
    response_model=RerankApiResponse,
    responses=OPENAI_ERROR_RESPONSES,
    openapi_extra=json_body(RerankApiRequest),
)
async def rerank_v1(request: Request) -> Response:
    return await _rerank(request, "1")


@router.post(
    "/v2/rerank",
    summary="Documents ranked by relevance to a query (Cohere v2)",
    response_model=RerankApiResponse,
    responses=ERROR_RESPONSES,  # OIP's {"error": message}, as every /v2 route answers
    openapi_extra=json_body(RerankApiRequest),
)
async def rerank_v2(request: Request) -> Response:
    return await _rerank(request, "2")
