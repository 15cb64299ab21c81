"""Debug routes, off by default: attention weights through the slow path, and head importance.

POST /v2/models/{name}/attention takes the /infer body and answers outputs `output` and
`attention_weights` (or, with ?format=png or Accept: image/png, a heatmap grid of the first
sequence). GET /v2/models/{name}/heads answers each head's share of out_proj (JSON or PNG).
A text model also takes a sentence (service.debug.text_attention) and answers its tokens with the
weights. GET /debug is a page for people that calls these routes (service.debug.page).
The routes exist only with --debug-endpoint. --api-key guards them like every route; --debug-token
adds a second secret: `Authorization: Bearer <token>`, or `X-Debug-Token: <token>` when the
Authorization header carries the API key.
Weights are computed on the engine thread, alone between batches, never on the event loop.
"""

from __future__ import annotations

import hmac
import logging
import operator
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from service.debug import heatmap, text_attention
from service.debug import page as debug_page
from service.debug.attention_weights import (
    CROSS_WEIGHTS_NAME,
    ENCODER_WEIGHTS_NAME,
    WEIGHTS_NAME,
    WeightsResult,
    compute,
    first_sequence,
    panels,
    parse_options,
    weight_layers,
)
from service.http.body import read_body
from service.http.deps import get_state
from service.http.middleware import bearer_credential
from service.http.routes.common import await_queued, observed
from service.oip.codecs import (
    BINARY_HEADER,
    InferRequest,
    OutputTensor,
    decode_request,
    encode_response,
)
from service.oip.decoder_inputs import DECODER_ARCHITECTURES, TRANSFORMER
from service.oip.inputs import OUTPUT_NAME, check_finite, prepare
from service.pipeline.errors import (
    BadInput,
    Forbidden,
    Overloaded,
    Unauthorized,
)
from service.pipeline.models import ensure_serving
from service.runtime.settings import Settings

if TYPE_CHECKING:
    from service.runtime.state import ServiceState

log = logging.getLogger(__name__)
router = APIRouter(tags=["debug"])
HEAD_IMPORTANCE = operator.methodcaller(
    "head_importance"
)  # picklable: crosses to an engine process


class Gate:
    """At most `limit` debug requests at once. Handlers run on the one event loop, so a plain
    counter is race-free; a request over the limit is refused at once (429), never queued."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    @contextmanager
    def slot(self) -> Iterator[None]:
        if self.active >= self.limit:
            raise Overloaded(
                f"{self.active} debug requests are running; at most {self.limit} at once "
                "(--debug-max-concurrency); retry later",
                headers={"Retry-After": "1"},
            )
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1


def install(app: FastAPI, settings: Settings) -> None:
    """Add the debug routes when --debug-endpoint is on; otherwise they do not exist (404)."""
    if not settings.debug_endpoint:
        return
    if settings.debug_token is None and settings.api_key is None:
        log.warning(
            "debug endpoint is on without --debug-token: anyone who reaches this port can read "
            "attention weights; set MHA_DEBUG_TOKEN or keep the port private"
        )
    app.state.debug_gate = Gate(settings.debug_max_concurrency)
    app.state.debug_heads = None  # head-importance report, computed on first use
    app.state.debug_assets = debug_page.load_assets()  # the page's files, read once
    app.include_router(router)


DEBUG_TOKEN_HEADER = "x-debug-token"


def check_token(request: Request, settings: Settings) -> None:
    """The debug token, on top of the API key (ApiKeyAuth has already checked that): 401
    without it, 403 wrong (constant-time compare). It comes in X-Debug-Token, or as the
    Authorization Bearer credential when no --api-key takes that header."""
    if settings.debug_token is None:
        return
    challenge = {"WWW-Authenticate": 'Bearer realm="mha-serve debug"'}
    given = request.headers.get(DEBUG_TOKEN_HEADER)
    if given is None and settings.api_key is None:
        given = bearer_credential(request.headers.get("authorization"))
    if not given or not given.strip():
        where = (
            "'X-Debug-Token: <token>' (Authorization carries the API key)"
            if settings.api_key is not None
            else "'Authorization: Bearer <token>' or 'X-Debug-Token: <token>'"
        )
        raise Unauthorized(f"the debug endpoints need {where} (--debug-token)", challenge)
    expected = settings.debug_token.get_secret_value().encode()
    if not hmac.compare_digest(given.strip().encode(), expected):
        raise Forbidden("wrong debug token", challenge)


def wants_png(request: Request) -> bool:
    """?format=png|json wins; otherwise PNG when the Accept header names image/png."""
    fmt = request.query_params.get("format")
    if fmt is not None:
        if fmt not in ("json", "png"):
            raise BadInput(f"query parameter 'format' must be json or png, got {fmt!r}")
        return fmt == "png"
    return "image/png" in request.headers.get("accept", "").lower()


async def _guarded(
    request: Request, endpoint: str, handler: Callable[[ServiceState], Awaitable[Response]]
) -> Response:
    """Auth, the concurrency gate and request metrics around a debug handler."""
    state = get_state(request)
    with observed(state, endpoint, in_flight=False):
        check_token(request, state.settings)
        with request.app.state.debug_gate.slot():
            return await handler(state)


def _max_len(settings: Settings) -> tuple[int, str]:
    """The longest sequence the debug routes take, and the flag that sets it."""
    if settings.max_seq_len < settings.debug_max_seq_len:
        return settings.max_seq_len, "--max-seq-len"
    return settings.debug_max_seq_len, "--debug-max-seq-len"


def _check_sizes(request: InferRequest, settings: Settings) -> None:
    """The debug limits, named by their flags (the weights are O(B·H·T·S) memory)."""
    max_len, flag = _max_len(settings)
    for name in ("input", "key", "tgt", "memory", "src"):
        tensor = request.inputs.get(name)
        if tensor is None or len(tensor.shape) not in (2, 3):
            continue  # prepare() names the problem
        if tensor.shape[-2] > max_len:
            raise BadInput(
                f"input '{name}' has sequence length {tensor.shape[-2]}, over the debug limit "
                f"of {max_len} ({flag})"
            )
        if len(tensor.shape) == 3 and tensor.shape[0] > settings.debug_max_batch_size:
            raise BadInput(
                f"input '{name}' has {tensor.shape[0]} sequences; the debug endpoint takes at "
                f"most {settings.debug_max_batch_size} (--debug-max-batch-size)"
            )


async def _on_engine(
    state: ServiceState, request: Request, fn: Callable[..., Any], args: tuple, sequences: int
) -> Any:
    """Run `fn(model, *args)` on the engine thread, alone between batches (FIFO with the fast
    path's batches); 504 if it never got its turn, and it leaves the queue if the client goes
    away. `fn` is module-level: a worker front-end sends it to the engine process by name."""
    timeout = state.settings.request_timeout_s
    deadline = time.monotonic() + timeout
    item = state.batcher.run_exclusive(fn, args, sequences=sequences, deadline=deadline)
    return await await_queued(state.batcher, request, item.future, [item], timeout)


def _check_default(state: ServiceState, model_name: str, version: str | None) -> None:
    """The debug routes compute with the default model; another model or version: 400, never
    another model's numbers."""
    entry = state.find(model_name, version)
    default = state.default
    if entry is not default:
        raise BadInput(
            f"the debug routes serve only model '{default.name}' version {default.version} "
            f"(the first model at its highest version), not '{entry.name}' version "
            f"{entry.version}"
        )


async def _attention(
    state: ServiceState, request: Request, model_name: str, version: str | None
) -> Response:
    _check_default(state, model_name, version)
    ensure_serving(state)
    png = wants_png(request)
    settings, model = state.settings, state.model
    body = await read_body(request, settings.max_body_bytes)
    binary_header = request.headers.get(BINARY_HEADER)
    text_header = await run_in_threadpool(text_attention.is_text_body, body, binary_header)
    if text_header is not None:
        return await _text_attention(state, request, text_header, png, version)
    decoded = await run_in_threadpool(decode_request, body, binary_header)
    asked = dict(decoded.outputs)
    names = [OUTPUT_NAME, WEIGHTS_NAME]
    if model.architecture in DECODER_ARCHITECTURES:
        names.append(CROSS_WEIGHTS_NAME)
    if model.architecture == TRANSFORMER:
        names.append(ENCODER_WEIGHTS_NAME)
    unknown = sorted(set(asked) - set(names))
    if unknown:
        raise BadInput(f"unknown output(s) {unknown}; this endpoint has {names}")
    _check_sizes(decoded, settings)
    limits = replace(
        state.limits,
        max_seq_len=min(settings.debug_max_seq_len, settings.max_seq_len),
        max_sequences=settings.debug_max_batch_size,
    )
    payload = await run_in_threadpool(prepare, replace(decoded, outputs={}), limits)
    await run_in_threadpool(check_finite, payload)  # weights of NaN inputs would be NaN
    options = parse_options(decoded.parameters, model.architecture, weight_layers(model))

    if png:
        first = first_sequence(payload)
        result = await _on_engine(state, request, compute, (first, options, "FP32"), 1)
        weights = panels(result, options)  # (L, H, T, S)
        layer_ids = list(range(weights.shape[0])) if result.has_layer_axis else [options.layer or 0]
        mask = first.key_padding_mask  # (S,) or None
        image = await run_in_threadpool(
            heatmap.attention_png,
            weights,
            layer_ids,
            averaged=options.average,
            key_padding_mask=mask,
            causal=first.is_causal,
            title=f"{state.model_name}: attention weights, sequence 0",
        )
        rows, cols = heatmap.grid_shape(weights.shape[0], weights.shape[1])
        return Response(image, media_type="image/png", headers={"X-Heatmap-Grid": f"{rows}x{cols}"})

    result = await _on_engine(state, request, compute, (payload, options), payload.num_sequences)
    tensors = [
        OutputTensor(OUTPUT_NAME, payload.datatype, result.output),
        OutputTensor(WEIGHTS_NAME, payload.datatype, result.weights),
        *(OutputTensor(name, payload.datatype, w) for name, w in result.extra.items()),
    ]
    if asked:
        tensors = [t for t in tensors if t.name in asked]
    binary = {t.name: asked.get(t.name, decoded.binary_output_default) for t in tensors}
    content, json_length = await run_in_threadpool(
        encode_response, state.model_name, version, decoded.id, tensors, binary
    )
    if json_length is None:
        return Response(content, media_type="application/json")
    return Response(
        content, media_type="application/octet-stream", headers={BINARY_HEADER: str(json_length)}
    )


async def _text_attention(
    state: ServiceState, request: Request, header: dict, png: bool, version: str | None
) -> Response:
    """A sentence in: its tokens (as /v1/embeddings makes them) with the weights, or a PNG."""
    tokenizer = state.tokenizer
    model = state.model
    if tokenizer is None:
        raise BadInput(
            f"model '{state.model_name}' takes no text: a BYTES 'text' input needs a text model "
            "directory with tokenizer.json (and the tokenizers package); send hidden states as "
            "input 'input' instead"
        )
    max_tokens, flag = _max_len(state.settings)
    parsed = text_attention.parse_text_request(
        header, model.architecture, model.num_layers, min(max_tokens, tokenizer.max_length)
    )  # the text's length is bounded before tokenizing
    labelled = await run_in_threadpool(
        text_attention.tokenize, tokenizer, parsed.text, max_tokens, flag
    )
    ids, options = labelled.encoded.ids, parsed.options
    if png:  # bound the picture before computing anything
        layers = model.num_layers if options.layer is None else 1
        try:
            heatmap.labelled_size(layers, 1 if options.average else model.num_heads, len(ids))
        except ValueError as exc:
            raise BadInput(
                f"{exc}: ask for one layer ('layer'), averaged heads ('average_attn_weights') "
                "or a shorter text"
            ) from None
    output, weights = await _on_engine(state, request, text_attention.compute, (ids, options), 1)
    if png:
        has_layer_axis = options.layer is None
        grid = panels(WeightsResult(output, weights, has_layer_axis), options)  # (L, H, T, T)
        layer_ids = list(range(grid.shape[0])) if has_layer_axis else [options.layer]
        image = await run_in_threadpool(
            heatmap.attention_png,
            grid,
            layer_ids,
            averaged=options.average,
            key_padding_mask=None,
            causal=False,
            title=f"{state.model_name}: attention weights",
            tokens=labelled.tokens,
            special=labelled.special,
        )
        rows, cols = heatmap.grid_shape(grid.shape[0], grid.shape[1])
        return Response(image, media_type="image/png", headers={"X-Heatmap-Grid": f"{rows}x{cols}"})
    content = await run_in_threadpool(
        text_attention.response,
        state.model_name,
        version,
        parsed,
        labelled,
        output,
        weights,
        model.num_layers,
    )
    return Response(content, media_type="application/json")


async def _heads(
    state: ServiceState, request: Request, model_name: str, version: str | None
) -> Response:
    _check_default(state, model_name, version)
    png = wants_png(request)
    report = request.app.state.debug_heads
    if report is None:  # computed once from the weights, on the engine thread
        report = await _on_engine(state, request, HEAD_IMPORTANCE, (), 1)
        request.app.state.debug_heads = report
    if png:
        title = f"{state.model_name}: head importance (W^O blocks)"
        image = await run_in_threadpool(heatmap.heads_png, report, title)
        return Response(image, media_type="image/png")
    return JSONResponse(
        {
            "model_name": state.model_name,
            "architecture": state.model.architecture,
            "layers": report,
        }
    )


@router.post("/v2/models/{model_name}/attention", summary="Attention weights (debug, slow path)")
@router.post("/v2/models/{model_name}/versions/{model_version}/attention", summary="Weights")
async def attention(request: Request, model_name: str, model_version: str | None = None):
    version = model_version or None
    return await _guarded(
        request, "attention", lambda state: _attention(state, request, model_name, version)
    )


@router.get("/v2/models/{model_name}/heads", summary="Head importance from W^O (debug)")
@router.get("/v2/models/{model_name}/versions/{model_version}/heads", summary="Head importance")
async def heads(request: Request, model_name: str, model_version: str | None = None):
    version = model_version or None
    return await _guarded(
        request, "heads", lambda state: _heads(state, request, model_name, version)
    )


@router.get("/debug", include_in_schema=False)
async def page(request: Request) -> Response:
    """The debug page: static files only; its scripts send the token on every data request."""
    return debug_page.asset_response(request.app.state.debug_assets, debug_page.INDEX)


@router.get("/debug/assets/{name}", include_in_schema=False)
async def page_asset(request: Request, name: str) -> Response:
    return debug_page.asset_response(request.app.state.debug_assets, name)


@router.get("/debug/info", summary="What the debug page needs to know about the model (debug)")
async def info(request: Request) -> JSONResponse:
    async def handler(state: ServiceState) -> JSONResponse:
        tokenizer = state.tokenizer
        max_len, flag = _max_len(state.settings)
        return JSONResponse(debug_page.model_info(state, tokenizer, max_len, flag))

    return await _guarded(request, "debug_info", handler)
