"""The Open Inference Protocol's inference core, once for every front (HTTP JSON, HTTP binary,
gRPC): decode and validate (compute_input), queue on the model's current copy, wait with the
deadline / client gone / drain, encode (compute_output), and record Triton's statistics and the
metrics once, when the request completes.

A front only turns its wire format into a TensorRequest (its `decode` parses bytes it has already
read, bounded) and its answer from a TensorResult (`encode`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from service.oip.inputs import Payload, prepare, request_timeout_s
from service.pipeline.models import submit
from service.pipeline.waiting import Gone, await_queued
from service.runtime.forward import hidden_states
from service.runtime.response_cache import Key, ResponseCache, payload_key
from service.runtime.statistics import Timing
from service.runtime.tracing import describe, queue_and_compute
from service.runtime.work import Work

if TYPE_CHECKING:
    import numpy as np

    from service.oip.codecs import InferRequest
    from service.runtime.state import ModelEntry, ServiceState
    from service.runtime.tracing import Trace

R = TypeVar("R")
OFF_LOOP_BYTES = 1 << 20  # response cache: larger inputs are hashed, outputs copied, off the loop


@dataclass(kw_only=True, slots=True)
class TensorRequest:
    """One OIP inference request as a front hands it over."""

    model: str
    version: str | None  # None: the model's highest served version
    protocol: str  # the codec metrics' label: "json", "binary" or "grpc"
    request_id: str  # the response's id when the request sends none
    decode: Callable[[], InferRequest]  # the wire bytes (already read, bounded) -> tensors
    offload: bool = False  # decode and validate on a worker thread (a large request)
    deadline_s: float | None = None  # the transport's own deadline (gRPC's), seconds from now
    gone: Gone | None = None  # fires when the client leaves (None: cancellation tells)
    # after decoding: where the engine writes the output from the device (Payload.output_sink)
    output_sink: Callable[[], Callable[[Any], None] | None] | None = None
    traceparent: str | None = None  # W3C Trace Context from the caller (service.runtime.tracing)
    tracestate: str | None = None
    received_at: float | None = None  # time.perf_counter() when the front got the request


@dataclass(slots=True)
class TensorResult:
    """What the model made of a request, for the front to encode."""

    entry: ModelEntry
    request: InferRequest
    payload: Payload
    array: np.ndarray  # (B, T, E): the request's rows of the batch output
    request_id: str


async def infer(
    state: ServiceState, request: TensorRequest, encode: Callable[[TensorResult], Awaitable[R]]
) -> R:
    """Run `request` through the model; `encode` turns the result into the front's answer.
    The front has admitted it (pipeline.models.admit) before reading its body. Raises
    ServiceError (the one vocabulary every front maps to its wire shape)."""
    started = time.perf_counter()
    # The current copy, looked up after the front read the body (unknown: 404, not counted).
    entry = state.find(request.model, request.version)
    tracing, trace = state.trace_control, None
    if tracing.active:  # one check per request when tracing is off
        trace = tracing.begin(
            entry.name, "infer", request.traceparent, request.tracestate, request.received_at
        )
    decoded: InferRequest | None = None  # for the trace of a request that fails
    work: Work | None = None
    try:
        decoded, payload, input_s = await _decode(entry, request)
        if trace is not None:
            decoded_at = time.perf_counter()
            trace.step("decode", decoded_at - input_s, decoded_at)
        if request.output_sink is not None:
            payload.output_sink = request.output_sink()
        metrics = entry.metrics or state.metrics
        metrics.codec(metrics.decode, request.protocol, input_s)
        metrics.sequences_received(payload.lengths)

        timeout = request_timeout_s(state.settings.request_timeout_s, decoded.parameters)
        if request.deadline_s is not None:
            timeout = min(timeout, max(request.deadline_s, 0.0))
        cache = key = output = None
        cache_s = 0.0
        if state.response_cache is not None:  # a hit is answered as the current copy would be
            entry = state.find(request.model, request.version)
            cache, key, output, cache_s = await _cache_lookup(state, entry, payload)
        if output is None:
            loop = asyncio.get_running_loop()
            deadline = time.monotonic() + timeout
            work = Work(payload=payload, runner=hidden_states, deadline=deadline, loop=loop)
            entry = submit(state, request.model, request.version, work)
            output = await await_queued(entry.batcher, work.future, [work], timeout, request.gone)
            if cache is not None and key is not None and entry.cache_token is not None:
                # under the copy that computed it (a reload may have come between)
                output, stored_s = await _cache_store(cache, (entry.cache_token, key[1]), output)
                cache_s += stored_s
        if trace is not None and cache is not None:
            trace.attributes["mha.response_cache"] = "miss" if work is not None else "hit"

        encoding = time.perf_counter()
        array = payload.dense(output, payload.lengths) if payload.batched else output  # (B, T, E)
        rid = decoded.id or request.request_id
        answer = await encode(TensorResult(entry, decoded, payload, array, rid))
        output_s = time.perf_counter() - encoding
    except BaseException as exc:
        entry.stats.failed(time.perf_counter() - started)
        if trace is not None:
            rid = decoded.id if decoded is not None and decoded.id else None
            _trace_end(trace, entry, request, work, exc, rid)
        raise
    metrics.codec(metrics.encode, request.protocol, output_s)
    total_s = time.perf_counter() - started
    if work is None:  # answered from the response cache: no queue, no compute_*
        timing = Timing(input_s, 0.0, 0.0, output_s, total_s, cache_hit_s=cache_s + output_s)
    else:
        miss_s = cache_s if key is not None else None
        timing = Timing(input_s, work.queue_s, work.infer_s, output_s, total_s, cache_miss_s=miss_s)
    entry.stats.executed(timing)
    if trace is not None:
        trace.step("encode", encoding, encoding + output_s)
        _trace_end(trace, entry, request, work, None, rid)
    return answer


async def _cache_lookup(
    state: ServiceState, entry: ModelEntry, payload: Payload
) -> tuple[ResponseCache | None, Key | None, np.ndarray | None, float]:
    """The response cache's answer for `payload` when `entry`'s outputs are cached: (cache,
    key, output or None, seconds spent); (None, None, None, 0.0) when they are not, or when the
    output goes to a CUDA shared-memory region (written on the device, not from the host).
    Inputs over OFF_LOOP_BYTES are hashed on a worker thread (~0.1 ms per MiB)."""
    cache = state.response_cache
    if cache is None or entry.cache_token is None or payload.output_sink is not None:
        return None, None, None, 0.0
    started = time.perf_counter()
    arrays = (payload.query, payload.key, payload.value)
    if sum(a.nbytes for a in arrays if a is not None) > OFF_LOOP_BYTES:
        key = await asyncio.to_thread(payload_key, entry.cache_token, payload)
    else:
        key = payload_key(entry.cache_token, payload)
    output = cache.get(key)
    metrics = entry.metrics or state.metrics
    metrics.cache_lookups(int(output is not None), int(output is None))
    return cache, key, output, time.perf_counter() - started


async def _cache_store(
    cache: ResponseCache, key: Key, output: np.ndarray
) -> tuple[np.ndarray, float]:
    """`output` kept under `key` (a large one copied on a worker thread): what to answer with,
    and the seconds it took."""
    started = time.perf_counter()
    if output.nbytes > OFF_LOOP_BYTES:
        kept = await asyncio.to_thread(cache.put, key, output)
    else:
        kept = cache.put(key, output)
    return kept, time.perf_counter() - started


def _trace_end(
    trace: Trace,
    entry: ModelEntry,
    request: TensorRequest,
    work: Work | None,
    error: BaseException | None,
    rid: str | None = None,
) -> None:
    """The traced request's attributes, its queue and compute steps, and its end."""
    describe(trace, entry, request.protocol, rid or request.request_id)
    if work is not None:
        trace.attributes["mha.sequences"] = work.payload.num_sequences
        trace.attributes["mha.tokens"] = work.payload.num_tokens
        queue_and_compute(trace, work)
    if error is not None:
        trace.fail(error)
    trace.end()


async def _decode(entry: ModelEntry, request: TensorRequest) -> tuple[InferRequest, Payload, float]:
    """compute_input: the request's tensors, checked against the model's current copy."""
    started = time.perf_counter()
    if request.offload:
        decoded = await asyncio.to_thread(request.decode)
        payload = await asyncio.to_thread(prepare, decoded, entry.limits)
    else:
        decoded = request.decode()
        payload = prepare(decoded, entry.limits)
    return decoded, payload, time.perf_counter() - started


__all__ = ["TensorRequest", "TensorResult", "infer"]
