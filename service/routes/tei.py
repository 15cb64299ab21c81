"""text-embeddings-inference's routes for embedding models: /embed (and TEI's POST / alias,
which huggingface_hub's InferenceClient calls), /tokenize, /decode, /info.

Same shapes as TEI (`inputs` a string or a list of strings; `/embed` answers a list of vectors);
errors are TEI's `{"error": ..., "error_type": ...}`. Texts are bounded in characters before
tokenizing, tokenized off the loop and run through the same batcher as /v1/embeddings.
"""

from __future__ import annotations

import time
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from service.deps import ensure_serving, get_state
from service.errors import BadInput, DeadlineExceeded, PayloadTooLarge
from service.openapi import TEI_ERROR_RESPONSES
from service.routes.common import observed
from service.routes.embeddings import check_chars, run_parts, tokenize
from service.text import TextTokenizer, raw_embed_runner

router = APIRouter(tags=["text-embeddings-inference"], responses=TEI_ERROR_RESPONSES)

MAX_CLIENT_BATCH = 32  # TEI's default --max-client-batch-size


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool = False
    truncation_direction: Literal["Right", "Left"] = "Right"


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: str | list[str]
    add_special_tokens: bool = True


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
    model_type: dict = Field(description='{"embedding": {"pooling": "mean"}}')
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int
    max_client_batch_size: int
    version: str


def _tokenizer(request: Request) -> TextTokenizer:
    state = get_state(request)
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise BadInput(
            f"model '{state.model_name}' has no tokenizer.json: the text routes need a text "
            "model directory; use /v2 for tensors"
        )
    return tokenizer


def _texts(inputs: str | list[str]) -> list[str]:
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not texts:
        raise BadInput("'inputs' is an empty list; send at least one string")
    if len(texts) > MAX_CLIENT_BATCH:
        raise BadInput(f"'inputs' has {len(texts)} items; at most {MAX_CLIENT_BATCH}")
    for i, text in enumerate(texts):
        if not text:
            raise BadInput(f"inputs[{i}] is an empty string; empty inputs have no embedding")
    return texts


async def _vectors(
    request: Request, texts: list[str], truncate: bool, normalize: bool
) -> list[np.ndarray]:
    """Texts -> sentence vectors through the batcher; 413 for over-long texts unless truncate."""
    state, tokenizer = get_state(request), _tokenizer(request)
    check_chars(texts, state.char_limits)
    deadline = time.monotonic() + state.settings.request_timeout_s
    with state.batcher.reserve(len(texts)):
        encoded = await tokenize(state, request, tokenizer, texts, deadline)
    cut = [i for i, e in enumerate(encoded) if e.truncated]
    if cut and not truncate:
        raise PayloadTooLarge(
            f"Input validation error: inputs[{cut[0]}] is longer than the model's "
            f"{tokenizer.max_length} tokens; send less text or set 'truncate': true"
        )
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded("tokenizing used up the request's deadline")
    vectors = await run_parts(state, request, encoded, remaining, raw_embed_runner)
    if normalize:
        vectors = [v / max(float(np.linalg.norm(v)), 1e-12) for v in vectors]
    return vectors


class SimilarityInputs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source_sentence: str
    sentences: list[str]


class SimilarityRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: SimilarityInputs
    truncate: bool = False


@router.post("/similarity", summary="Cosine similarity of a sentence to others (TEI)")
async def similarity(body: SimilarityRequest, request: Request) -> list[float]:
    state = get_state(request)
    with observed(state, "similarity"):
        _tokenizer(request)
        ensure_serving(state)
        texts = _texts([body.inputs.source_sentence, *body.inputs.sentences])
        if len(texts) < 2:
            raise BadInput("'inputs.sentences' is empty; send at least one sentence")
        source, *others = await _vectors(request, texts, body.truncate, normalize=True)
        return [float(np.dot(source, v)) for v in others]


@router.post("/", summary="Hugging Face-compatible route: /embed for an embedding model (TEI)")
@router.post("/embed", summary="Sentence embeddings (TEI)")
async def embed(body: EmbedRequest, request: Request) -> list[list[float]]:
    state = get_state(request)
    with observed(state, "embed"):
        _tokenizer(request)
        ensure_serving(state)
        if body.truncation_direction == "Left":
            raise BadInput("'truncation_direction' Left is not supported yet; use Right")
        vectors = await _vectors(request, _texts(body.inputs), body.truncate, body.normalize)
        return [np.asarray(v, dtype=np.float32).tolist() for v in vectors]


@router.post("/tokenize", summary="Tokens of texts (TEI)")
async def tokenize_route(body: TokenizeRequest, request: Request) -> list[list[SimpleToken]]:
    state = get_state(request)
    with observed(state, "tokenize"):
        tokenizer = _tokenizer(request)
        texts = _texts(body.inputs)
        check_chars(texts, state.char_limits)
        return tokenizer.tokens(texts, body.add_special_tokens)


@router.post("/decode", summary="Texts of token ids (TEI)")
async def decode(body: DecodeRequest, request: Request) -> list[str]:
    state = get_state(request)
    with observed(state, "decode"):
        tokenizer = _tokenizer(request)
        ids = body.ids if body.ids and isinstance(body.ids[0], list) else [body.ids]
        vocab = state.model.vocab_size
        for i, seq in enumerate(ids):
            if len(seq) > tokenizer.max_length or any(not 0 <= t < vocab for t in seq):
                raise BadInput(
                    f"ids[{i}] must hold at most {tokenizer.max_length} ids in [0, {vocab})"
                )
        return tokenizer.decode(ids, body.skip_special_tokens)


@router.get("/info", summary="Model facts (TEI)")
async def info(request: Request) -> Info:
    state = get_state(request)
    tokenizer = _tokenizer(request)
    from service import __version__

    return Info(
        model_id=state.model_name,
        model_dtype=str(state.model.dtype).removeprefix("torch."),
        model_type={"embedding": {"pooling": state.model.pooling}},
        max_input_length=tokenizer.max_length,
        max_batch_tokens=state.settings.max_batch_tokens,
        max_batch_requests=state.settings.max_batch_size,
        max_client_batch_size=MAX_CLIENT_BATCH,
        version=__version__,
    )
