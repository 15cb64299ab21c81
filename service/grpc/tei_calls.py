"""What every call of TEI's gRPC API does around its handler (service/grpc/tei_servicer.py):
the model it uses, tracing, texts through the batcher inside the deadline, TEI's cost metadata
and x-compute-* headers, and the *Stream calls' order and end."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from service.grpc import tei_pb2 as pb
from service.grpc.calls import (
    STREAM_DRAINED,
    Call,
    Calls,
    call_metadata,
    cancel_with_call,
    read_until_drain,
)
from service.grpc.decode_errors import decoded
from service.pipeline.errors import BadInput, NotReady, ServiceError
from service.pipeline.models import ensure_serving
from service.pipeline.waiting import Stays
from service.runtime.tracing import CURRENT, TRACED, describe
from service.text.tei_ops import encode_texts, text_entry
from service.text.tokenizer import Text
from service.text.work import Timings, run_parts

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry

MODEL_KEY = "model"  # the call metadata naming the served model to use
DIRECTIONS = {pb.TRUNCATION_DIRECTION_RIGHT: "Right", pb.TRUNCATION_DIRECTION_LEFT: "Left"}
OFFERS = {  # the calls each kind of model answers (and Info, Tokenize), for refusals
    "embedding": "Embed and EmbedAll",
    "classifier": "Predict and PredictPair",
    "reranker": "Rerank, Predict and PredictPair",
    "sparse": "EmbedSparse",
}
STAYS = Stays()  # a cancelled call cancels the task awaiting its work instead

Handler = Callable[[Any, "ModelEntry", Any], Awaitable[tuple[Any, Any]]]


class Answer:
    """One request's cost, for TEI's Metadata message and x-compute-* headers."""

    def __init__(self, chars: int) -> None:
        self.started = time.perf_counter()
        self.chars = chars
        self.tokens = 0
        self.timings = Timings()
        self.device = "cpu"  # TEI's x-compute-type: cpu or gpu, of the model that ran it

    def metadata(self) -> pb.Metadata:
        t = self.timings
        return pb.Metadata(
            compute_chars=self.chars,
            compute_tokens=self.tokens,
            total_time_ns=int((time.perf_counter() - self.started) * 1e9),
            tokenization_time_ns=int(t.tokenize_s * 1e9),
            queue_time_ns=int(t.queue_s * 1e9),
            inference_time_ns=int(t.inference_s * 1e9),
        )

    def headers(self) -> tuple[tuple[str, str], ...]:
        """TEI's response headers (milliseconds, whole)."""
        total = str(int((time.perf_counter() - self.started) * 1000))
        t = self.timings
        return (
            ("x-compute-type", self.device),
            ("x-compute-time", total),
            ("x-compute-characters", str(self.chars)),
            ("x-compute-tokens", str(self.tokens)),
            ("x-total-time", total),
            ("x-tokenization-time", str(int(t.tokenize_s * 1000))),
            ("x-queue-time", str(int(t.queue_s * 1000))),
            ("x-inference-time", str(int(t.inference_s * 1000))),
        )


def direction(value: int) -> str:
    """TEI's TruncationDirection as the tokenizer's side; 400 for a value it does not have."""
    if value not in DIRECTIONS:
        raise BadInput(f"truncation_direction {value} is not a TruncationDirection (0 or 1)")
    return DIRECTIONS[value]


def prompt_name(request: Any) -> str | None:
    return request.prompt_name if request.HasField("prompt_name") else None


class TeiCalls(Calls):
    """The plumbing of TEI's handlers over the lifespan's ServiceState."""

    def deadline(self, context: Any) -> float:
        """time.monotonic()'s deadline: --request-timeout-s or the call's own, the sooner."""
        budget = self.state.settings.request_timeout_s
        remaining = context.time_remaining()
        return time.monotonic() + (budget if remaining is None else min(budget, remaining))

    @contextlib.asynccontextmanager
    async def tei_call(
        self, context: Any, method: str, endpoint: str | None, *kinds: str, unary: bool = True
    ) -> AsyncIterator[tuple[Call, ModelEntry]]:
        """Calls._call under the model the call uses (a call no model can serve is counted
        under the default model's labels); a unary call traced when tracing picks it, its
        headers sent with its answer. A stream's messages are counted and traced one by one."""
        metadata = call_metadata(context)
        try:
            model = metadata.get(MODEL_KEY)
            entry = text_entry(self.state, method, *kinds, model=model, offers=OFFERS)
            error = None
        except ServiceError as exc:
            entry, error = None, exc
        name, version = (entry.name, entry.version) if entry else (None, "")
        counted = endpoint if unary else None
        async with self._call(method, context, counted, name, version, headers=unary) as call:
            if error is not None:
                raise error
            assert entry is not None
            traced = unary and kinds and endpoint
            with self.traced(metadata, entry, endpoint, call) if traced else nullcontext():
                yield call, entry

    @contextlib.contextmanager
    def traced(
        self, metadata: dict[str, str], entry: ModelEntry, endpoint: Any, call: Call
    ) -> Iterator[None]:
        """A text request traced when tracing picks it (the caller's traceparent metadata is its
        parent); service.text.work adds the tokenize, queue and compute steps."""
        tracing = self.state.trace_control
        trace = None
        if tracing.active:
            parent, state = metadata.get("traceparent"), metadata.get("tracestate")
            trace = tracing.begin(entry.name, endpoint, parent, state, call.started)
        if trace is None:
            yield
            return
        describe(trace, entry, "grpc", call.request_id)
        TRACED.set(trace)
        token = CURRENT.set(trace)
        try:
            yield
        except BaseException as exc:
            trace.fail(exc)
            raise
        finally:
            CURRENT.reset(token)
            trace.end()

    @staticmethod
    def answered(call: Call, answer: Answer) -> None:
        """A unary call's x-compute-* headers (sent with the response)."""
        call.headers.extend(answer.headers())

    async def run(
        self,
        context: Any,
        entry: ModelEntry,
        texts: list[Text],
        truncate: bool,
        side: int,
        runner: Any,
        answer: Answer,
        field: str = "inputs",
        prompt: str | None = None,
        payload_of: Any = None,
    ) -> list[Any]:
        """Texts -> one result per text through `entry`'s batcher, inside the deadline;
        `answer` gets the tokens and the times."""
        state = self.state
        ensure_serving(state)
        answer.device = "cpu" if entry.model.device.type == "cpu" else "gpu"
        began = time.perf_counter()
        until = self.deadline(context)
        encoded = await encode_texts(
            STAYS, state, entry, texts, truncate, direction(side), until, field, prompt
        )
        answer.timings.tokenize_s = time.perf_counter() - began
        answer.tokens = sum(len(e.ids) for e in encoded)
        return await run_parts(state, entry, STAYS, encoded, until, runner, payload_of,
                               answer.timings)  # fmt: skip

    async def unary(
        self,
        request: Any,
        context: Any,
        method: str,
        endpoint: str,
        kinds: tuple[str, ...],
        handle: Handler,
    ) -> Any:
        """A unary call: `handle` under tei_call, its x-compute-* headers (where it computed)
        sent with the answer."""
        async with self.tei_call(context, method, endpoint, *kinds) as (call, entry):
            response, answer = await handle(decoded(request), entry, context)
            if answer is not None:
                self.answered(call, answer)
            return response

    async def stream(
        self,
        requests: AsyncIterator[Any],
        context: Any,
        method: str,
        endpoint: str,
        kinds: tuple[str, ...],
        handle: Handler,
    ) -> None:
        """A *Stream call: each message handled as its unary call (counted, logged and traced
        as one, under the stream's request id and its index), up to --grpc-stream-in-flight at
        once, answered in the order sent; the first that fails ends the stream with its status
        (the rest are dropped, counted 499 "stream_ended"). The client cancelling, or the
        call's deadline passing, cancels every message still running. When the server drains,
        reading stops, what was read is answered, and the stream ends UNAVAILABLE."""
        async with self.tei_call(context, method, endpoint, *kinds, unary=False) as (call, entry):
            cancel_with_call(context)
            limit = asyncio.Semaphore(self.state.settings.grpc_stream_in_flight)
            order: asyncio.Queue[asyncio.Task | None] = asyncio.Queue()
            metadata = call_metadata(context)
            ended = False  # by a message that failed

            async def one(request: Any, rid: str) -> Any:
                name, version = entry.name, entry.version
                with (
                    self.observed(f"{method}.request", rid, endpoint, name, version) as c,
                    self.traced(metadata, entry, endpoint, c) if kinds else nullcontext(),
                ):
                    try:
                        return (await handle(decoded(request), entry, context))[0]
                    except ServiceError as exc:
                        c.status, c.reason = exc.status, exc.reason
                        raise
                    except asyncio.CancelledError:
                        if ended:
                            c.reason = "stream_ended"
                        raise
                    except Exception:
                        c.status, c.reason = 500, "inference_error"
                        raise

            async def read() -> None:
                iterator = aiter(requests)
                count = 0
                while True:
                    await limit.acquire()  # before reading: a message read is one started
                    try:
                        request = await anext(iterator)
                    except StopAsyncIteration:
                        return
                    rid, count = f"{call.request_id}-{count}", count + 1
                    order.put_nowait(asyncio.create_task(one(request, rid)))

            async def read_all() -> bool:
                try:
                    return await read_until_drain(read(), self.state)
                finally:  # the end of the stream, or of reading it (then `await reader` raises)
                    order.put_nowait(None)

            reader = asyncio.create_task(read_all())
            try:
                while (task := await order.get()) is not None:
                    try:
                        answer = await task
                    except Exception:
                        ended = True
                        raise
                    finally:
                        limit.release()
                    await context.write(answer)
                if await reader:  # the server drains: what was read is answered, then the end
                    raise NotReady(STREAM_DRAINED)
            finally:
                left = [reader]
                while not order.empty():
                    if (task := order.get_nowait()) is not None:
                        left.append(task)
                for task in left:
                    task.cancel()
                await asyncio.wait(left)
                for task in left:  # their outcomes are the stream's end's, not to be logged
                    if not task.cancelled():
                        task.exception()
