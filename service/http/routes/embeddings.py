"""POST /v1/embeddings, OpenAI-compatible: strings in, sentence vectors out, via the batcher.

Inputs are bounded in characters before any work (--max-input-chars, --max-request-chars: 413),
then tokenized on worker threads in chunks, inside the request's deadline (504), holding queue
slots meanwhile (429 when full) and stopping when the client leaves (499). Each input is
truncated to the model's max length (the X-Truncated-Inputs header lists which were cut), split
into batcher works that respect --max-batch-size and --max-batch-tokens, run as token ids through
the text model on the engine thread (embeddings, encoder, pooling, normalisation), and answered
as `data[i].embedding` plus `usage`.
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from service.http.body import parse_json, read_body
from service.http.deps import get_state, traced
from service.http.openapi import OPENAI_ERROR_RESPONSES, schema_body
from service.http.routes.common import LeanRoute, Observation, client_gone, observed
from service.pipeline.errors import (
    BadInput,
    ModelNotFound,
)
from service.pipeline.models import ensure_serving
from service.text.kinds import model_kind
from service.text.tei_ops import ROUTES_OF
from service.text.tokenizer import Encoded
from service.text.work import (
    TOKENIZE_CHUNK_CHARS,
    check_chars,
    run_parts,
    tokenize,
    with_default_prompt,
)

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry, ServiceState

router = APIRouter(tags=["embeddings"], route_class=LeanRoute)

MAX_INPUTS = 2048  # OpenAI's limit per request; --max-queue may lower it
FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}

EMBEDDINGS_REQUEST = {
    "type": "object",
    "required": ["input", "model"],
    "properties": {
        "input": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "array", "minItems": 1, "items": {"type": "integer"}},
                },
            ]
        },
        "model": {"type": "string"},
        "encoding_format": {"type": "string", "enum": ["float", "base64"]},
        "dimensions": {"type": "integer", "minimum": 1},
        "user": {"type": "string"},
    },
    "additionalProperties": False,
}
EMBEDDINGS_RESPONSE = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"type": "string", "enum": ["list"]},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"type": "string", "enum": ["embedding"]},
                    "index": {"type": "integer", "minimum": 0},
                    "embedding": {
                        "anyOf": [
                            {"type": "array", "items": {"type": "number"}},
                            {"type": "string", "description": "base64 of float32 LE"},
                        ]
                    },
                },
            },
        },
        "model": {"type": "string"},
        "usage": {
            "type": "object",
            "required": ["prompt_tokens", "total_tokens"],
            "properties": {
                "prompt_tokens": {"type": "integer", "minimum": 0},
                "total_tokens": {"type": "integer", "minimum": 0},
            },
        },
    },
}
OPENAPI = schema_body(EMBEDDINGS_REQUEST)
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "One vector per input, in order (X-Truncated-Inputs lists cut inputs)",
        "content": {"application/json": {"schema": EMBEDDINGS_RESPONSE}},
    },
    **OPENAI_ERROR_RESPONSES,
}


def max_inputs(state: ServiceState) -> int:
    """Texts one request may send (/v1/embeddings, /v1/rerank): OpenAI's limit, or fewer
    when the queue holds fewer (each text takes a queue slot)."""
    return min(MAX_INPUTS, state.settings.max_queue)


def embedding_entry(state: ServiceState, model: str) -> ModelEntry:
    """The served embedding model named `model` (OpenAI's `model` field): 404 naming the served
    text models for an unknown name, 400 for a model without a tokenizer or with a
    classification head."""
    entry = state.models.get(model)
    if entry is None:
        texts = [e for e in state.models.values() if e.tokenizer is not None]
        served = ", ".join(f"'{e.name}' ({model_kind(e.model)})" for e in texts)
        raise ModelNotFound(
            f"unknown model '{model}'; this server's text models are {served}"
            if texts
            else f"unknown model '{model}'; this server serves "
            f"{', '.join(repr(n) for n in state.models)}, none of them a text model",
            param="model",
        )
    if entry.tokenizer is None:
        raise BadInput(
            f"model '{entry.name}' has no tokenizer: /v1/embeddings needs a text model "
            "directory with tokenizer.json (and the tokenizers package); use /v2 for tensors",
            param="model",
        )
    kind = model_kind(entry.model)
    if kind != "embedding":
        raise BadInput(
            f"model '{entry.name}' is a {kind} model, not an embedding model: use "
            f"{ROUTES_OF[kind]}",
            param="model",
        )
    return entry


def parse_request(
    body: bytes, state: ServiceState
) -> tuple[ModelEntry, list[str] | list[np.ndarray], str, int | None]:
    """The model the request names, its texts (or token ids), encoding_format and the
    dimensions to cut vectors to (None: keep all); BadInput names the problem."""
    request = parse_json(body)
    if not isinstance(request, dict):
        raise BadInput("body must be a JSON object with 'input' and 'model'")
    return check_request(request, state)


def check_request(
    request: dict[str, Any], state: ServiceState
) -> tuple[ModelEntry, list[str] | list[np.ndarray], str, int | None]:
    """parse_request's checks on the parsed body (infinity-emb's /embeddings maps its own
    fields onto these first)."""
    unknown = sorted(set(request) - FIELDS)
    if unknown:
        raise BadInput(f"unknown field(s) {unknown}; this endpoint takes {sorted(FIELDS)}")
    model = request.get("model")
    if not isinstance(model, str):
        raise BadInput("'model' is required and must be a string")
    entry = embedding_entry(state, model)
    embed_dim, matryoshka = entry.model.embedding_dim, entry.matryoshka
    if "input" not in request:
        raise BadInput("'input' is required: a string or a list of strings")
    texts = _inputs(request["input"], state, entry)
    fmt = request.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise BadInput(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}")
    dims = request.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise BadInput(f"'dimensions' must be a positive integer, got {dims!r}", param="dimensions")
    if dims is not None and dims > embed_dim:
        raise BadInput(f"'dimensions' is {dims}, over this model's {embed_dim}", param="dimensions")
    if dims is not None and dims < embed_dim and not matryoshka:
        raise BadInput(
            f"'dimensions' must be {embed_dim} for this model: it declares no Matryoshka "
            "training (no truncate_dim in config_sentence_transformers.json, no 'matryoshka' "
            "in its model card), so its vectors cannot be shortened",
            param="dimensions",
        )
    user = request.get("user")
    if user is not None and not isinstance(user, str):
        raise BadInput("'user' must be a string", param="user")
    return entry, texts, fmt, (dims if dims is not None and dims < embed_dim else None)


def _inputs(texts: Any, state: ServiceState, entry: ModelEntry) -> list[str] | list[np.ndarray]:
    """'input' as strings, or as token ids (one list of ints, or a list of such lists) checked
    against the vocabulary and the model's max length (OpenAI rejects over-long ids too)."""
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list):
        raise BadInput(
            f"'input' must be a string, a list of strings or token ids, got {_kind(texts)}",
            param="input",
        )
    if not texts:
        raise BadInput("'input' is an empty list; send at least one string", param="input")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in texts):
        texts = [texts]  # one sequence of token ids
    if len(texts) > max_inputs(state):
        raise BadInput(
            f"'input' has {len(texts)} items; at most {max_inputs(state)} per request",
            param="input",
        )
    if isinstance(texts[0], list):
        return [_token_ids(i, ids, state, entry) for i, ids in enumerate(texts)]
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise BadInput(
                f"input[{i}] is {_kind(text)}; send all strings or all token-id lists",
                param="input",
            )
        if not text:
            raise BadInput(
                f"input[{i}] is an empty string; empty inputs have no embedding", param="input"
            )
    return texts


def _token_ids(i: int, ids: Any, state: ServiceState, entry: ModelEntry) -> np.ndarray:
    """One token-id sequence, bounded by the model's max length and vocabulary."""
    if not isinstance(ids, list) or not ids:
        raise BadInput(
            f"input[{i}] must be a non-empty list of token ids, got {_kind(ids)}", param="input"
        )
    max_len = min(entry.model.max_seq_len, state.settings.max_seq_len)
    if len(ids) > max_len:
        raise BadInput(
            f"input[{i}] has {len(ids)} tokens; this model's maximum context length is "
            f"{max_len} tokens",
            param="input",
        )
    vocab = entry.model.vocab_size
    for j, token in enumerate(ids):
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
            raise BadInput(
                f"input[{i}][{j}] = {token!r} is not a token id: ids are integers in "
                f"[0, {vocab}) for this model's vocabulary",
                param="input",
            )
    return np.asarray(ids, dtype=np.int64)


def _kind(value: Any) -> str:
    """JSON's name for a parsed value, for error messages."""
    names = {dict: "an object", list: "a list", type(None): "null", bool: "a boolean"}
    return names.get(type(value), {int: "an integer", float: "a number"}.get(type(value), "?"))


def shorten(vector: np.ndarray, dims: int) -> np.ndarray:
    """A Matryoshka vector's first `dims` coordinates, re-normalised to unit length."""
    head = np.asarray(vector[:dims], dtype=np.float32)
    norm = float(np.linalg.norm(head))
    return head / norm if norm > 0 else head


def _response(
    vectors: list[np.ndarray], fmt: str, model_name: str, tokens: int
) -> tuple[bytes, float]:
    started = time.perf_counter()
    data = []
    for i, vector in enumerate(vectors):
        v = np.asarray(vector, dtype="<f4")
        embedding: Any = base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    body = {
        "object": "list",
        "data": data,
        "model": model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    content = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return content, time.perf_counter() - started


async def _embeddings(state: ServiceState, request: Request, seen: Observation) -> Response:
    ensure_serving(state)
    body = await read_body(request, state.settings.max_body_bytes)
    started = time.perf_counter()
    deadline = time.monotonic() + state.settings.request_timeout_s
    if len(body) > TOKENIZE_CHUNK_CHARS:
        entry, texts, fmt, dims = await run_in_threadpool(parse_request, bytes(body), state)
    else:
        entry, texts, fmt, dims = parse_request(bytes(body), state)
    del body
    metrics = entry.metrics or state.metrics
    seen.label(metrics)  # counted under the model the body names
    with traced(state, request.scope, entry, "embeddings"):
        return await embed_texts(state, request, entry, texts, fmt, dims, started, deadline)


async def embed_texts(
    state: ServiceState,
    request: Request,
    entry: ModelEntry,
    texts: list[Any],
    fmt: str,
    dims: int | None,
    started: float,
    deadline: float,
) -> Response:
    """Tokenize (or take the token ids), run the parts, answer: the request once its body is
    parsed and its model known."""
    metrics = entry.metrics or state.metrics
    if isinstance(texts[0], np.ndarray):  # token ids, already bounded by parse_request
        encoded = [Encoded(ids, truncated=False) for ids in texts]
    else:
        texts = with_default_prompt(entry, texts)
        check_chars(texts, entry.char_limits)
        async with entry.batcher.reserve(len(texts)):  # tokenizing is queued work: 429 when full
            with client_gone(request) as gone:
                encoded = await tokenize(state, entry, gone, texts, deadline)
    metrics.codec(metrics.decode, "json", time.perf_counter() - started)
    metrics.sequences_received([len(e.ids) for e in encoded])

    with client_gone(request) as gone:
        vectors = await run_parts(state, entry, gone, encoded, deadline)

    tokens = sum(len(e.ids) for e in encoded)
    if dims is not None:  # Matryoshka: keep the first `dims` coordinates, unit length again
        vectors = [shorten(v, dims) for v in vectors]
    if len(vectors) > 64:
        content, seconds = await run_in_threadpool(_response, vectors, fmt, entry.name, tokens)
    else:
        content, seconds = _response(vectors, fmt, entry.name, tokens)
    metrics.codec(metrics.encode, "json", seconds)
    headers = {}
    truncated = [str(i) for i, e in enumerate(encoded) if e.truncated]
    if truncated:
        headers["X-Truncated-Inputs"] = ",".join(truncated)
    return Response(content, media_type="application/json", headers=headers)


@router.post(
    "/v1/embeddings",
    summary="Sentence embeddings (OpenAI-compatible)",
    openapi_extra=OPENAPI,
    responses=RESPONSES,
    response_class=Response,
)
async def embeddings(request: Request) -> Response:
    state = get_state(request)
    with observed(state, "embeddings") as seen:
        return await _embeddings(state, request, seen)
