"""ModelStreamInfer: Triton's bidirectional stream of ModelInferRequests over one call.

Each request runs as a unary ModelInfer would (the same checks, limits, deadline, statistics,
metrics and access-log line, under its own id) and is answered on the stream as soon as it is
done, in completion order, with its id. A failed request is answered with `error_message` (as
Triton does) and the stream goes on. At most --grpc-stream-in-flight requests of a stream run
at once; past that the server stops reading it (HTTP/2 flow control holds the client back).
The client cancelling, or the call's deadline passing, cancels every request still queued.
When the server drains, it stops reading the stream, answers what it read, and ends the call
UNAVAILABLE (an open stream does not hold the drain up until the grace runs out).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from service.grpc import grpc_service_pb2 as pb
from service.grpc.calls import STREAM_DRAINED, cancel_with_call, read_until_drain
from service.grpc.decode_errors import Undecodable
from service.http.middleware import request_id
from service.pipeline.errors import NotReady, ServiceError

if TYPE_CHECKING:
    from service.grpc.servicer import InferenceServicer

log = logging.getLogger("service.grpc")
METHOD = "ModelStreamInfer.request"  # each request's access-log line (the stream has its own)


def _failed(request: Any, message: str) -> pb.ModelStreamInferResponse:
    """A request's error on the stream, naming the request (its id, model and version)."""
    answer = pb.ModelStreamInferResponse(error_message=message)
    if isinstance(request, pb.ModelInferRequest):
        answer.infer_response.id = request.id
        answer.infer_response.model_name = request.model_name
        answer.infer_response.model_version = request.model_version
    return answer


async def _answer(
    servicer: InferenceServicer,
    request: Any,
    context: grpc.aio.ServicerContext,
    write: Callable[[pb.ModelStreamInferResponse], Awaitable[None]],
) -> None:
    """Run one request of the stream and write its answer (or its error) on the stream."""
    if isinstance(request, Undecodable):
        message = f"the request is not a valid protobuf message: {request.error}"
        await write(_failed(request, message))
        return
    rid = request.id or request_id(None)
    name, version = request.model_name, request.model_version
    with servicer.observed(METHOD, rid, "infer", name, version) as call:
        try:
            response = await servicer.infer(request, rid, context, call.started)
            answer = pb.ModelStreamInferResponse(infer_response=response)
        except ServiceError as exc:
            call.status, call.reason = exc.status, exc.reason
            answer = _failed(request, exc.message)
        except Exception:
            call.status, call.reason = 500, "inference_error"
            log.exception("unhandled error in a gRPC %s request", METHOD)
            answer = _failed(request, "internal server error")
    await write(answer)


async def stream_infer(
    servicer: InferenceServicer,
    requests: AsyncIterator[Any],
    context: grpc.aio.ServicerContext,
    stream_id: str,
) -> None:
    """Answer every request of the stream; returns once the client has closed its side and
    every answer is written."""
    in_flight = asyncio.Semaphore(servicer.state.settings.grpc_stream_in_flight)
    writing = asyncio.Lock()  # one write at a time on the call
    tasks: set[asyncio.Task] = set()

    async def write(answer: pb.ModelStreamInferResponse) -> None:
        async with writing:
            await context.write(answer)

    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        in_flight.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("gRPC %s %s: a request's answer failed: %r", METHOD, stream_id,
                      task.exception())  # fmt: skip

    async def read() -> None:
        iterator = aiter(requests)
        while True:
            await in_flight.acquire()  # before reading: a message read is a request started
            try:
                request = await anext(iterator)
            except StopAsyncIteration:
                return
            task = asyncio.create_task(_answer(servicer, request, context, write))
            tasks.add(task)
            task.add_done_callback(done)

    cancel_with_call(context)  # then every request of the stream is cancelled too
    try:
        drained = await read_until_drain(read(), servicer.state)
        while tasks:
            await asyncio.wait(set(tasks))
        if drained:
            raise NotReady(STREAM_DRAINED)
    finally:  # cancelled (client gone, deadline, shutdown): nothing of the stream runs on
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(set(tasks))
