"""POST /v1/embeddings, OpenAI-compatible: strings in, sentence vectors out, via the batcher.

Each input is tokenized (truncated to the model's max length; the X-Truncated-Inputs header lists
which inputs were cut), split into batcher works that respect --max-batch-size and
--max-batch-tokens, run as token ids through the text model on the engine thread (embeddings,
encoder, pooling, normalisation), and answered as `data[i].embedding` plus `usage`.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from service.batcher import Work
from service.errors import (
    BadInput,
    ModelNotFound,
)
from service.openapi import ERROR_RESPONSES
from service.routes.common import await_queued, ensure_serving, get_state, observed
from service.routes.infer import read_body
from service.text import Encoded, embed_runner, token_payload

if TYPE_CHECKING:
    from service.app import ServiceState

router = APIRouter(tags=["embeddings"])

MAX_INPUTS = 2048  # OpenAI's limit per request; --max-queue may lower it
FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
OFFLOAD_CHARS = 16 * 1024  # tokenize bigger requests off the event loop

EMBEDDINGS_REQUEST = {
    "type": "object",
    "required": ["input", "model"],
    "properties": {
        "input": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
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
OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": EMBEDDINGS_REQUEST}},
    }
}
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "One vector per input, in order (X-Truncated-Inputs lists cut inputs)",
        "content": {"application/json": {"schema": EMBEDDINGS_RESPONSE}},
    },
    **ERROR_RESPONSES,
}


def _max_inputs(state: ServiceState) -> int:
    return min(MAX_INPUTS, state.settings.max_queue)


def parse_request(body: bytes, state: ServiceState, embed_dim: int) -> tuple[list[str], str]:
    """The request's texts and encoding_format; BadInput names the first problem."""
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadInput(f"body is not valid JSON: {exc}") from None
    if not isinstance(request, dict):
        raise BadInput("body must be a JSON object with 'input' and 'model'")
    unknown = sorted(set(request) - FIELDS)
    if unknown:
        raise BadInput(f"unknown field(s) {unknown}; this endpoint takes {sorted(FIELDS)}")
    model = request.get("model")
    if not isinstance(model, str):
        raise BadInput("'model' is required and must be a string")
    if model != state.model_name:
        raise ModelNotFound(f"unknown model '{model}'; this server serves '{state.model_name}'")
    if "input" not in request:
        raise BadInput("'input' is required: a string or a list of strings")
    texts = request["input"]
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list):
        raise BadInput(f"'input' must be a string or a list of strings, got {_kind(texts)}")
    if not texts:
        raise BadInput("'input' is an empty list; send at least one string")
    if len(texts) > _max_inputs(state):
        raise BadInput(f"'input' has {len(texts)} items; at most {_max_inputs(state)} per request")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise BadInput(
                f"input[{i}] is {_kind(text)}; every item must be a string "
                "(token-id arrays are not accepted)"
            )
        if not text:
            raise BadInput(f"input[{i}] is an empty string; empty inputs have no embedding")
    fmt = request.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise BadInput(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}")
    dims = request.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or dims != embed_dim):
        raise BadInput(f"'dimensions' must be {embed_dim} for this model (no shortening)")
    user = request.get("user")
    if user is not None and not isinstance(user, str):
        raise BadInput("'user' must be a string")
    return texts, fmt


def _kind(value: Any) -> str:
    """JSON's name for a parsed value, for error messages."""
    names = {dict: "an object", list: "a list", type(None): "null", bool: "a boolean"}
    return names.get(type(value), {int: "an integer", float: "a number"}.get(type(value), "?"))


def chunk(encoded: list[Encoded], max_sequences: int, max_tokens: int) -> list[list[int]]:
    """Input indices in order, cut so each part fits one batch (sequences and tokens)."""
    parts: list[list[int]] = [[]]
    tokens = 0
    for i, enc in enumerate(encoded):
        n = len(enc.ids)
        if parts[-1] and (len(parts[-1]) >= max_sequences or tokens + n > max_tokens):
            parts.append([])
            tokens = 0
        parts[-1].append(i)
        tokens += n
    return parts


def _retrieve(future: asyncio.Future) -> None:
    """Mark a part's error as seen: after a failed sibling, nobody awaits the others."""
    if not future.cancelled():
        future.exception()


async def run_parts(
    state: ServiceState, request: Request, encoded: list[Encoded], timeout: float
) -> list[np.ndarray]:
    """Queue every part, await all; on timeout or disconnect drop the parts not yet started."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    settings = state.settings
    works: list[Work] = []
    try:
        for part in chunk(encoded, settings.max_batch_size, settings.max_batch_tokens):
            payload = token_payload([encoded[i].ids for i in part])
            work = Work(payload, deadline=deadline, loop=loop, runner=embed_runner)
            work.future.add_done_callback(_retrieve)
            state.batcher.submit(work)  # 429 when the queue is full
            works.append(work)
        gathered = asyncio.gather(*(w.future for w in works))
        results = await await_queued(state, request, gathered, works, timeout)
    except BaseException:
        for work in works:
            state.batcher.cancel(work)
        raise
    return [vector for part in results for vector in part]


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


async def _embeddings(state: ServiceState, request: Request) -> Response:
    tokenizer = getattr(request.app.state, "tokenizer", None)
    ensure_serving(state)
    if tokenizer is None:
        raise BadInput(
            f"model '{state.model_name}' has no tokenizer: /v1/embeddings needs a text model "
            "directory with tokenizer.json (and the tokenizers package); use /v2 for tensors"
        )
    body = await read_body(request, state.settings.max_body_bytes)
    started = time.perf_counter()
    texts, fmt = parse_request(bytes(body), state, state.model.embed_dim)
    if sum(len(t) for t in texts) > OFFLOAD_CHARS:
        encoded = await run_in_threadpool(tokenizer.encode, texts)
    else:
        encoded = tokenizer.encode(texts)
    state.metrics.decode.labels(state.model_name, "json").observe(time.perf_counter() - started)
    state.metrics.sequences_received([len(e.ids) for e in encoded])

    vectors = await run_parts(state, request, encoded, state.settings.request_timeout_s)

    tokens = sum(len(e.ids) for e in encoded)
    if len(vectors) > 64:
        content, seconds = await run_in_threadpool(
            _response, vectors, fmt, state.model_name, tokens
        )
    else:
        content, seconds = _response(vectors, fmt, state.model_name, tokens)
    state.metrics.encode.labels(state.model_name, "json").observe(seconds)
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
    with observed(state, "embeddings"):
        return await _embeddings(state, request)
