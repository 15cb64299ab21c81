"""POST /v2/models/{name}/infer: the OIP core (service.pipeline.tensors) behind HTTP, JSON or
Triton's binary tensors: read the body (bounded), hand it over, encode the answer."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from service.http.body import read_body
from service.http.deps import get_state, response_budget, trace_context
from service.http.openapi import INFER_OPENAPI, INFER_RESPONSES
from service.http.routes.common import LeanRoute, PartsResponse, client_gone, observed
from service.oip.codecs import (
    BINARY_HEADER,
    OFFLOAD_BYTES,
    OutputTensor,
    decode_request,
    encode_parts,
    json_length,
)
from service.oip.inputs import OUTPUT_NAME
from service.pipeline.models import admit
from service.pipeline.tensors import TensorRequest, TensorResult
from service.pipeline.tensors import infer as run_infer
from service.runtime.state import ServiceState
from service.shm import REGION
from service.shm.tensors import SharedMemoryIO, write_outputs

router = APIRouter(tags=["inference"], route_class=LeanRoute)
REGION_MARK = REGION.encode()


async def _infer(
    state: ServiceState, request: Request, model_name: str, version: str | None
) -> Response:
    admit(state, model_name, version)  # 404 / 503 before the body is read
    body = await read_body(request, state.settings.max_body_bytes)
    header_length = _binary_header(request.scope["headers"])
    json_end = json_length(header_length, len(body))
    # Large JSON is parsed off the event loop, and so are requests naming shared memory (their
    # inputs are copied out of the regions): looked for in the JSON part only, never in tensors
    offload = json_end > OFFLOAD_BYTES or body.find(REGION_MARK, 0, json_end) >= 0
    with client_gone(request) as gone, SharedMemoryIO(state.shared_memory) as shm:
        work = TensorRequest(
            model=model_name,
            version=version,
            protocol="json" if header_length is None else "binary",
            request_id=request.scope["state"]["request_id"],  # RequestContext or the fast path
            decode=functools.partial(decode_request, body, header_length, shm),
            offload=offload,
            gone=gone,
            output_sink=functools.partial(shm.device_sink, OUTPUT_NAME),
        )
        if state.trace_control.active:
            work.traceparent, work.tracestate, work.received_at = trace_context(request.scope)
        return await run_infer(state, work, functools.partial(_encode, request, version, shm))


BINARY_KEY = BINARY_HEADER.lower().encode("latin-1")


def _binary_header(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The first Inference-Header-Content-Length value, as `request.headers.get` would give it,
    without building a Headers object per request."""
    for key, value in headers:
        if key == BINARY_KEY:
            return value.decode("latin-1")
    return None


async def _encode(
    request: Request, version: str | None, shm: SharedMemoryIO, result: TensorResult
) -> Response:
    """The result as OIP JSON, or Triton's binary extension where the request asks for it, or
    written into the client's shared memory."""
    array, decoded = result.array, result.request
    parameters = await write_outputs(shm, OUTPUT_NAME, array)
    binary = {OUTPUT_NAME: decoded.outputs.get(OUTPUT_NAME, decoded.binary_output_default)}
    if parameters is not None:
        binary[OUTPUT_NAME] = False  # nothing of it in the body
    args = (
        result.entry.name,
        version,
        result.request_id,  # OIP id, else the X-Request-ID
        [OutputTensor(OUTPUT_NAME, result.payload.datatype, array, parameters)],
        binary,
    )
    # Refuse before encoding what could not be sent now (JSON: ~11 bytes a value, counted at 8).
    if parameters is None:
        response_budget(request).check(array.nbytes if binary[OUTPUT_NAME] else 8 * array.size)
    if parameters is None and not binary[OUTPUT_NAME] and array.nbytes > OFFLOAD_BYTES:
        parts, header_bytes = await run_in_threadpool(encode_parts, *args)
    else:
        parts, header_bytes = encode_parts(*args)
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
