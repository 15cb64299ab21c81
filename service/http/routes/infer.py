"""POST /v2/models/{name}/infer: decode, queue for the batcher, await, encode."""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from service.http.deps import ensure_serving, get_state, response_budget
from service.http.openapi import INFER_OPENAPI, INFER_RESPONSES
from service.http.routes.common import LeanRoute, PartsResponse, await_queued, observed
from service.oip.codecs import (
    BINARY_HEADER,
    OFFLOAD_BYTES,
    OutputTensor,
    decode_request,
    encode_parts,
    json_length,
)
from service.oip.inputs import OUTPUT_NAME, Payload, prepare, request_timeout_s
from service.pipeline.errors import (
    BadInput,
    ClientDisconnected,
    PayloadTooLarge,
)
from service.runtime.forward import hidden_states
from service.runtime.work import Work

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry, ServiceState

router = APIRouter(tags=["inference"], route_class=LeanRoute)


async def read_body(request: Request, limit: int) -> bytes | bytearray:
    """The (decompressed) request body, refusing anything over `limit` bytes with 413. A body
    that arrives in one piece is used as it is (no copy)."""
    too_large = PayloadTooLarge(
        f"request body is over the limit of {limit} bytes (--max-body-bytes)"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body: bytes | bytearray = b""
    parts: bytearray | None = None
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":  # gone mid-body: 499, not a server error
            raise ClientDisconnected("client disconnected while sending the body")
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if parts is None and not more:
            body = chunk
            break
        parts = bytearray() if parts is None else parts
        parts += chunk
        if len(parts) > limit:
            raise too_large
        if not more:
            body = parts
            break
    if len(body) > limit:
        raise too_large
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding in ("gzip", "deflate"):
        inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        try:
            body = bytearray(inflater.decompress(body, limit + 1))
        except zlib.error as exc:
            raise BadInput(f"body is not valid {encoding} data: {exc}") from None
        if len(body) > limit or inflater.unconsumed_tail:
            raise too_large
    elif encoding != "identity":
        raise BadInput(f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
    return body


async def run_work(
    state: ServiceState, entry: ModelEntry, request: Request, payload: Payload, timeout: float
) -> Any:
    """Queue `payload` and wait for its outputs, honouring the deadline and client disconnects."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    work = Work(payload=payload, runner=hidden_states, deadline=deadline, loop=loop)
    entry.batcher.submit(work)
    return await await_queued(entry.batcher, request, work.future, [work], timeout)


async def _infer(state: ServiceState, request: Request, model_name: str, version: str | None):
    entry = state.find(model_name, version)
    with entry.stats.request():  # Triton's success/fail statistics of this model
        return await _infer_model(state, entry, request, version)


async def _infer_model(
    state: ServiceState, entry: ModelEntry, request: Request, version: str | None
) -> Response:
    ensure_serving(state, entry)
    body = await read_body(request, state.settings.max_body_bytes)
    header_length = request.headers.get(BINARY_HEADER)
    protocol = "json" if header_length is None else "binary"

    started = time.perf_counter()
    if json_length(header_length, len(body)) > OFFLOAD_BYTES:
        decoded = await run_in_threadpool(decode_request, body, header_length)
        payload = await run_in_threadpool(prepare, decoded, entry.limits)
    else:
        decoded = decode_request(body, header_length)
        payload = prepare(decoded, entry.limits)
    seconds = time.perf_counter() - started
    metrics = entry.metrics or state.metrics
    metrics.codec(metrics.decode, protocol, seconds)
    entry.stats.add("compute_input", seconds)
    metrics.sequences_received(payload.lengths)

    timeout = request_timeout_s(state.settings.request_timeout_s, decoded.parameters)
    output = await run_work(state, entry, request, payload, timeout)  # (N, E), batch's slice

    started = time.perf_counter()
    array = payload.dense(output, payload.lengths) if payload.batched else output  # (B, T, E)
    binary = {OUTPUT_NAME: decoded.outputs.get(OUTPUT_NAME, decoded.binary_output_default)}
    args = (
        entry.name,
        version,
        decoded.id or request.state.request_id,  # OIP id, else the X-Request-ID
        [OutputTensor(OUTPUT_NAME, payload.datatype, array)],
        binary,
    )
    # Refuse before encoding what could not be sent now (JSON: ~11 bytes a value, counted at 8).
    response_budget(request).check(array.nbytes if binary[OUTPUT_NAME] else 8 * array.size)
    if not binary[OUTPUT_NAME] and array.nbytes > OFFLOAD_BYTES:
        parts, header_bytes = await run_in_threadpool(encode_parts, *args)
    else:
        parts, header_bytes = encode_parts(*args)
    seconds = time.perf_counter() - started
    metrics.codec(metrics.encode, protocol, seconds)
    entry.stats.add("compute_output", seconds)
    if header_bytes is None:
        return PartsResponse(parts, "application/json", {})
    return PartsResponse(parts, "application/octet-stream", {BINARY_HEADER: str(header_bytes)})


@router.post(
    "/v2/models/{model_name}/infer",
    summary="Inference (JSON or binary tensors)",
    openapi_extra=INFER_OPENAPI,
    responses=INFER_RESPONSES,
    response_class=Response,
)
@router.post(
    "/v2/models/{model_name}/versions/{model_version}/infer",
    summary="Inference (JSON or binary tensors)",
    openapi_extra=INFER_OPENAPI,
    responses=INFER_RESPONSES,
    response_class=Response,
)
async def infer(request: Request, model_name: str, model_version: str | None = None) -> Response:
    state = get_state(request)
    with observed(state, "infer", model=model_name, version=model_version):
        return await _infer(state, request, model_name, model_version or None)
