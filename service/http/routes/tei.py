"""text-embeddings-inference's routes for embedding models and the model-neutral ones:
/embed, /embed_all, /similarity, /embed_sparse (SPLADE models, BGE-M3's lexical weights), /tokenize,
/decode, /info, and
TEI's POST / (which
huggingface_hub's InferenceClient calls: /embed for an embedding model, /predict otherwise).
/rerank and /predict are in tei_rank.py; /health, /ping, /invocations and the mounts (at the
root and per model) in tei_mount.py.

Same shapes as TEI (`inputs` a string or a list of strings; `/embed` answers a list of vectors);
errors are TEI's `{"error": ..., "error_type": ...}`, 424 for a route the model's head does
not offer. Texts are bounded in characters before tokenizing, tokenized off the loop and run
through the same batcher as /v1/embeddings.
"""

from __future__ import annotations

import time

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from service.http.deps import get_state
from service.http.openapi import TEI_ERROR_RESPONSES, json_body, number_arrays
from service.http.routes.common import client_gone
from service.http.routes.tei_common import parse_body, routed_model, text_route
from service.http.routes.tei_rank import HubPredictRequest, hub_predict
from service.pipeline.errors import BadInput
from service.pipeline.models import ensure_serving
from service.runtime.state import ModelEntry, ServiceState
from service.text.kinds import model_kind, tei_model_type
from service.text.tei_ops import (
    Direction,
    check_batch,
    check_decode,
    check_present,
    encode_texts,
    info_fields,
    normalized,
    text_entry,
    with_prompt,
)
from service.text.tokenizer import raw_embed_runner, sparse_runner, token_runner
from service.text.work import check_chars, run_parts, tokenize, with_default_prompt

router = APIRouter(tags=["text-embeddings-inference"], responses=TEI_ERROR_RESPONSES)


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool | None = None  # None: --auto-truncate decides
    truncation_direction: Direction = "Right"
    prompt_name: str | None = Field(
        None, description="A key of config_sentence_transformers.json's prompts: its text is "
        "prepended to every input"
    )  # fmt: skip
    dimensions: int | None = Field(
        None, ge=1, description="Keep each vector's first `dimensions` values (Matryoshka), "
        "then normalize if asked; at most the model's embedding size"
    )  # fmt: skip


class EmbedAllRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: str | list[str]
    truncate: bool | None = None  # None: --auto-truncate decides
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class DecodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class SimpleToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None = None
    stop: int | None = None


class Info(BaseModel):
    model_id: str
    model_dtype: str
    model_type: dict = Field(
        description='{"embedding": {"pooling": "mean" | "cls" | "last_token" | "splade"}}, or '
        '{"classifier" | "reranker": {"id2label", "label2id", "problem_type"}}'
    )
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int
    max_client_batch_size: int
    max_concurrent_requests: int
    auto_truncate: bool
    prompts: dict[str, str] = Field(default_factory=dict)
    version: str


def _texts(state: ServiceState, inputs: str | list[str]) -> list[str]:
    texts = [inputs] if isinstance(inputs, str) else inputs
    check_batch(state, len(texts))
    return texts


async def _run(
    request: Request,
    entry: ModelEntry,
    texts: list[str],
    truncate: bool | None,
    direction: Direction,
    runner,
) -> list[np.ndarray]:
    """Texts -> one result per text through `entry`'s batcher (413 for over-long texts unless
    truncate)."""
    state = get_state(request)
    deadline = time.monotonic() + state.settings.request_timeout_s
    with client_gone(request) as gone:
        encoded = await encode_texts(gone, state, entry, texts, truncate, direction, deadline)
        return await run_parts(state, entry, gone, encoded, deadline, runner)


class SimilarityInputs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source_sentence: str
    sentences: list[str]


class SimilarityRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: SimilarityInputs
    truncate: bool | None = None  # None: --auto-truncate decides


@router.post(
    "/similarity",
    summary="Cosine similarity of a sentence to others (TEI)",
    openapi_extra=json_body(SimilarityRequest),
)
async def similarity(request: Request) -> list[float]:
    state = get_state(request)
    with text_route(request, state, "similarity", "/similarity", "embedding") as entry:
        body = await parse_body(request, state, SimilarityRequest)
        ensure_serving(state)
        if not body.inputs.sentences:
            raise BadInput("'inputs.sentences' is empty; send at least one sentence")
        texts = _texts(state, [body.inputs.source_sentence, *body.inputs.sentences])
        texts = with_default_prompt(entry, texts)
        vectors = await _run(request, entry, texts, body.truncate, "Right", raw_embed_runner)
        source, *others = normalized(vectors)
        return [float(np.dot(source, v)) for v in others]


async def embed_body(body: EmbedRequest, request: Request) -> Response:
    """One float32 vector per input, written by orjson in float32's shortest form (as TEI's
    serde does): no Python float and no response-model validation per value."""
    state = get_state(request)
    with text_route(request, state, "embed", "/embed", "embedding") as entry:
        ensure_serving(state)
        width = entry.model.embedding_dim
        if body.dimensions is not None and body.dimensions > width:
            raise BadInput(f"'dimensions' {body.dimensions} exceeds the embedding size {width}")
        texts = with_prompt(entry, _texts(state, body.inputs), body.prompt_name)
        vectors = await _run(
            request, entry, texts, body.truncate, body.truncation_direction, raw_embed_runner
        )
        if body.dimensions is not None:  # as TEI: cut the raw vector, then normalize
            vectors = [v[: body.dimensions] for v in vectors]
        if body.normalize:
            vectors = normalized(vectors)
        vectors = [np.asarray(v, dtype=np.float32) for v in vectors]
        content = orjson.dumps(vectors, option=orjson.OPT_SERIALIZE_NUMPY)
        return Response(content, media_type="application/json")


EMBED_RESPONSES = number_arrays("One sentence vector per input (float32 values)", 2)


@router.post(
    "/embed",
    summary="Sentence embeddings (TEI)",
    response_class=Response,
    responses=EMBED_RESPONSES,
    openapi_extra=json_body(EmbedRequest),
)
async def embed(request: Request) -> Response:
    body = await parse_body(request, get_state(request), EmbedRequest)
    return await embed_body(body, request)


class EmbedSparseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: str | list[str]
    truncate: bool | None = None  # None: --auto-truncate decides
    truncation_direction: Direction = "Right"
    prompt_name: str | None = EmbedRequest.model_fields["prompt_name"]


SPARSE_RESPONSES = {
    200: {
        "description": "Per input, its non-zero SPLADE weights by vocabulary index (index order)",
        "content": {
            "application/json": {
                "schema": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["index", "value"],
                            "properties": {
                                "index": {"type": "integer", "minimum": 0},
                                "value": {"type": "number", "exclusiveMinimum": 0},
                            },
                        },
                    },
                }
            }
        },
    }
}


@router.post(
    "/embed_sparse",
    summary="Sparse embeddings: SPLADE, or BGE-M3's lexical weights (TEI)",
    response_class=Response,
    responses=SPARSE_RESPONSES,
    openapi_extra=json_body(EmbedSparseRequest),
)
async def embed_sparse(request: Request) -> Response:
    def encode(weights: list[np.ndarray]) -> bytes:  # float32 values shortest, as TEI's serde
        answer = [
            [{"index": i, "value": v} for i, v in zip(w["index"].tolist(), w["value"], strict=True)]
            for w in weights
        ]
        return orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)

    return await _each_input(request, "embed_sparse", "sparse", EmbedSparseRequest, sparse_runner,
                             encode)  # fmt: skip


async def _each_input(request: Request, endpoint: str, kind: str, model: type, runner, encode):
    """A route answering one result per input text: its metrics and model, the body, the
    prompt, the batcher; `encode` writes the results."""
    state = get_state(request)
    with text_route(request, state, endpoint, f"/{endpoint}", kind) as entry:
        body = await parse_body(request, state, model)
        ensure_serving(state)
        texts = with_prompt(entry, _texts(state, body.inputs), body.prompt_name)
        results = await _run(
            request, entry, texts, body.truncate, body.truncation_direction, runner
        )
        return Response(encode(results), media_type="application/json")


ROOT_OPENAPI = json_body(EmbedRequest, HubPredictRequest, EmbedSparseRequest)
EMBED_ALL_RESPONSES = number_arrays(
    "Per input, every token's hidden state (T_i, D), special tokens included", 3
)


@router.post(
    "/embed_all",
    summary="Every token's embedding, without pooling (TEI)",
    response_class=Response,
    responses=EMBED_ALL_RESPONSES,
    openapi_extra=json_body(EmbedAllRequest),
)
async def embed_all(request: Request) -> Response:
    def encode(states: list[np.ndarray]) -> bytes:
        return orjson.dumps(states, option=orjson.OPT_SERIALIZE_NUMPY)

    return await _each_input(request, "embed_all", "embedding", EmbedAllRequest, token_runner,
                             encode)  # fmt: skip


@router.post(
    "/",
    summary="Hugging Face-compatible route: /embed for an embedding model, /embed_sparse for a "
    "SPLADE model, a text classification (one list of labels per input) for a classifier or "
    "reranker (TEI)",
    openapi_extra=ROOT_OPENAPI,
)
async def root(request: Request):
    state = get_state(request)
    entry = text_entry(state, "/", model=routed_model(request))  # its kind picks the shape
    if model_kind(entry.model) == "sparse":
        return await embed_sparse(request)
    embedding = model_kind(entry.model) == "embedding"
    parsed = await parse_body(request, state, EmbedRequest if embedding else HubPredictRequest)
    if isinstance(parsed, EmbedRequest):
        return await embed_body(parsed, request)
    return await hub_predict(parsed, request)


@router.post("/tokenize", summary="Tokens of texts (TEI)", openapi_extra=json_body(TokenizeRequest))
async def tokenize_route(request: Request) -> list[list[SimpleToken]]:
    state = get_state(request)
    with text_route(request, state, "tokenize", "/tokenize") as entry:
        body = await parse_body(request, state, TokenizeRequest)
        tokenizer = entry.tokenizer
        assert tokenizer is not None  # text_route chose a text model
        texts = _texts(state, body.inputs)
        check_present(texts)
        texts = with_prompt(entry, texts, body.prompt_name)
        check_chars(texts, entry.char_limits)
        deadline = time.monotonic() + state.settings.request_timeout_s
        async with entry.batcher.reserve(len(texts)):  # off the loop, in chunks, like /embed
            with client_gone(request) as gone:
                return await tokenize(
                    state,
                    entry,
                    gone,
                    texts,
                    deadline,
                    lambda part: tokenizer.tokens(part, body.add_special_tokens),
                )


@router.post("/decode", summary="Texts of token ids (TEI)", openapi_extra=json_body(DecodeRequest))
async def decode(request: Request) -> list[str]:
    state = get_state(request)
    with text_route(request, state, "decode", "/decode") as entry:
        body = await parse_body(request, state, DecodeRequest)
        tokenizer = entry.tokenizer
        assert tokenizer is not None  # text_route chose a text model
        ids = body.ids if body.ids and isinstance(body.ids[0], list) else [body.ids]
        check_batch(state, len(ids), "ids")
        check_decode(entry, ids)
        return tokenizer.decode(ids, body.skip_special_tokens)


@router.get("/info", summary="Model facts (TEI)")
async def info(request: Request) -> Info:
    state = get_state(request)
    entry = text_entry(state, "/info", model=routed_model(request))
    return Info(**info_fields(state, entry), model_type=tei_model_type(entry.model))
