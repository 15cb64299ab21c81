"""POST /v2/models/{name}/infer: decode, queue for the batcher, await, encode."""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from service.codecs import (
    BINARY_HEADER,
    OutputTensor,
    decode_request,
    encode_response,
    json_length,
)
from service.deps import State, ensure_serving, response_budget
from service.errors import (
    BadInput,
    ClientDisconnected,
    PayloadTooLarge,
)
from service.forward import hidden_states
from service.inputs import OUTPUT_NAME, Payload, prepare
from service.openapi import INFER_OPENAPI, INFER_RESPONSES
from service.routes.common import await_queued, observed
from service.work import Work

if TYPE_CHECKING:
    from service.state import ModelEntry, ServiceState

router = APIRouter(tags=["inference"])

# JSON parts larger than this are parsed/serialised off the event loop; so are binary bodies
# over OFFLOAD_BINARY_BYTES (their finiteness check is a pass over every value).
OFFLOAD_BYTES = 64 * 1024
OFFLOAD_BINARY_BYTES = 1024 * 1024


async def read_body(request: Request, limit: int) -> bytearray:
    """The (decompressed) request body, refusing anything over `limit` bytes with 413."""
    too_large = PayloadTooLarge(
        f"request body is over the limit of {limit} bytes (--max-body-bytes)"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # the client went away mid-body: 499, not a server error
        raise ClientDisconnected("client disconnected while sending the body") from None
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


def _deadline_s(state: ServiceState, parameters: dict[str, Any]) -> float:
    """Seconds the request may wait: --request-timeout-s, or less if the client asks."""
    timeout = state.settings.request_timeout_s
    asked = parameters.get("timeout")  # tritonclient sends microseconds
    if asked is not None:
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 0:
            raise BadInput(
                f"parameter 'timeout' must be a non-negative integer (µs), got {asked!r}"
            )
        if asked > 0:
            timeout = min(timeout, asked / 1e6)
    return timeout


async def run_work(
    state: ServiceState, entry: ModelEntry, request: Request, payload: Payload, timeout: float
) -> Any:
    """Queue `payload` and wait for its outputs, honouring the deadline and client disconnects."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    work = Work(payload=payload, runner=hidden_states, deadline=deadline, loop=loop)
    entry.batcher.submit(work)
    return await await_queued(state, request, work.future, [work], timeout)


async def _infer(state: ServiceState, request: Request, model_name: str, version: str | None):
    entry = state.find(model_name, version)
    ensure_serving(state)
    body = await read_body(request, state.settings.max_body_bytes)
    header_length = request.headers.get(BINARY_HEADER)
    protocol = "json" if header_length is None else "binary"

    started = time.perf_counter()
    json_bytes = json_length(header_length, len(body))
    if json_bytes > OFFLOAD_BYTES or len(body) > OFFLOAD_BINARY_BYTES:
        decoded = await run_in_threadpool(decode_request, body, header_length)
        payload = await run_in_threadpool(prepare, decoded, entry.limits)
    else:
        decoded = decode_request(body, header_length)
        payload = prepare(decoded, entry.limits)
    state.metrics.decode.labels(entry.name, protocol).observe(time.perf_counter() - started)
    state.metrics.sequences_received([q.shape[0] for q in payload.query])

    timeout = _deadline_s(state, decoded.parameters)
    outputs = await run_work(state, entry, request, payload, timeout)

    started = time.perf_counter()
    array = np.stack(outputs) if payload.batched else outputs[0]  # (B, T, E) or (T, E)
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
        content, header_bytes = await run_in_threadpool(encode_response, *args)
    else:
        content, header_bytes = encode_response(*args)
    state.metrics.encode.labels(entry.name, protocol).observe(time.perf_counter() - started)
    if header_bytes is None:
        return Response(content, media_type="application/json")
    return Response(
        content,
        media_type="application/octet-stream",
        headers={BINARY_HEADER: str(header_bytes)},
    )


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
async def infer(
    request: Request, state: State, model_name: str, model_version: str | None = None
) -> Response:
    with observed(state, "infer"):
        return await _infer(state, request, model_name, model_version or None)
