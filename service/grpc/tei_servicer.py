"""text-embeddings-inference's gRPC API (package tei.v1: Info, Embed, Predict, Rerank,
Tokenize) on --grpc-port, beside Triton's service: TEI's messages over the core its HTTP routes
use (service.text.tei_ops, service.text.work), with every call's plumbing (service.grpc.calls).

TEI serves one model; a call here uses the model its `model` metadata names, else the first
served text model of the kind the call needs (as TEI's HTTP routes here). As in TEI's gRPC
server: `truncate` is the request's own (proto3 cannot leave it unsaid, so --auto-truncate does
not apply), a unary answer carries TEI's x-compute-* timing headers, a *Stream call answers
its requests in order and ends with the status of the first one that fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
from anyio.to_thread import current_default_thread_limiter

from service.grpc import tei_pb2 as pb
from service.grpc import tei_pb2_grpc as pb_grpc
from service.grpc.calls import Call, Calls
from service.grpc.decode_errors import Undecodable
from service.pipeline.errors import BadInput, ServiceError
from service.pipeline.models import ensure_serving
from service.pipeline.waiting import Stays
from service.runtime.tracing import CURRENT, TRACED, describe
from service.text.tei_ops import (
    check_batch,
    check_query,
    encode_texts,
    info_fields,
    instruction,
    normalized,
    predictions,
    ranked,
    text_entry,
    with_prompt,
)
from service.text.tokenizer import (
    Text,
    classify_runner,
    model_kind,
    raw_embed_runner,
    sparse_runner,
    token_runner,
    typed_payload,
)
from service.text.work import Timings, check_chars, run_parts, tokenize

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry

MODEL_KEY = "model"  # the call metadata naming the served model to use
DIRECTIONS = {pb.TRUNCATION_DIRECTION_RIGHT: "Right", pb.TRUNCATION_DIRECTION_LEFT: "Left"}
MODEL_TYPES = {
    "embedding": pb.MODEL_TYPE_EMBEDDING,
    "sparse": pb.MODEL_TYPE_EMBEDDING,  # TEI serves SPLADE as an embedding model
    "classifier": pb.MODEL_TYPE_CLASSIFIER,
    "reranker": pb.MODEL_TYPE_RERANKER,
}
OFFERS = {  # the calls each kind of model answers (and Info, Tokenize)
    "embedding": "Embed and EmbedAll",
    "classifier": "Predict and PredictPair",
    "reranker": "Rerank, Predict and PredictPair",
    "sparse": "EmbedSparse",
}
STAYS = Stays()


class Answer:
    """One request's cost, for TEI's Metadata message and x-compute-* headers."""

    def __init__(self, chars: int) -> None:
        self.started = time.perf_counter()
        self.chars = chars
        self.tokens = 0
        self.timings = Timings()

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

    def headers(self, device: str) -> tuple[tuple[str, str], ...]:
        """TEI's response headers (milliseconds, whole)."""
        total = str(int((time.perf_counter() - self.started) * 1000))
        t = self.timings
        return (
            ("x-compute-type", device),
            ("x-compute-time", total),
            ("x-compute-characters", str(self.chars)),
            ("x-compute-tokens", str(self.tokens)),
            ("x-total-time", total),
            ("x-tokenization-time", str(int(t.tokenize_s * 1000))),
            ("x-queue-time", str(int(t.queue_s * 1000))),
            ("x-inference-time", str(int(t.inference_s * 1000))),
        )


def _direction(value: int) -> str:
    if value not in DIRECTIONS:
        raise BadInput(f"truncation_direction {value} is not a TruncationDirection (0 or 1)")
    return DIRECTIONS[value]


def _decoded(request: Any) -> Any:
    """A stream's message, or 400 for one that is no valid protobuf message."""
    if isinstance(request, Undecodable):
        raise BadInput(f"the request is not a valid protobuf message: {request.error}")
    return request


def _metadata(context: Any) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def _prompt_name(request: Any) -> str | None:
    return request.prompt_name if request.HasField("prompt_name") else None


class TeiServicer(
    Calls,
    pb_grpc.InfoServicer,
    pb_grpc.EmbedServicer,
    pb_grpc.PredictServicer,
    pb_grpc.RerankServicer,
    pb_grpc.TokenizeServicer,
):
    """TEI's five services over the lifespan's ServiceState."""

    # -- per-call plumbing --------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _tei(
        self, context: Any, method: str, endpoint: str | None, *kinds: str, unary: bool = True
    ) -> AsyncIterator[tuple[Call, ModelEntry]]:
        """Calls._call under the model the call uses (a call no model can serve is counted
        under the default model's labels); traced when tracing picks it."""
        metadata = _metadata(context)
        try:
            entry, error = (
                text_entry(
                    self.state, method, *kinds, model=metadata.get(MODEL_KEY), offers=OFFERS
                ),
                None,
            )
        except ServiceError as exc:
            entry, error = None, exc
        name, version = (entry.name, entry.version) if entry else (None, "")
        counted = endpoint if unary else None  # a stream's requests are counted one by one
        async with self._call(method, context, counted, name, version, headers=unary) as call:
            if error is not None:
                raise error
            assert entry is not None
            traced = unary and kinds and endpoint  # a stream's requests are traced one by one
            with self._traced(metadata, entry, endpoint, call) if traced else nullcontext():
                yield call, entry

    @contextlib.contextmanager
    def _traced(
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

    def _answered(self, call: Call, answer: Answer) -> None:
        """A unary call's x-compute-* headers (sent with the response)."""
        device = "cpu" if self.state.default.model.device.type == "cpu" else "gpu"
        call.headers.extend(answer.headers(device))

    async def _run(
        self,
        context: Any,
        entry: ModelEntry,
        texts: list[Text],
        truncate: bool,
        direction: int,
        runner: Any,
        answer: Answer,
        field: str = "inputs",
        prompt: str | None = None,
        payload_of: Any = None,
    ) -> list[Any]:
        """Texts -> one result per text through `entry`'s batcher, inside the request timeout
        and the call's own deadline; `answer` gets the tokens and the times."""
        state = self.state
        ensure_serving(state)
        budget = state.settings.request_timeout_s
        remaining = context.time_remaining()
        deadline = time.monotonic() + (budget if remaining is None else min(budget, remaining))
        began = time.perf_counter()
        encoded = await encode_texts(
            STAYS, state, entry, texts, truncate, _direction(direction), deadline, field, prompt
        )
        answer.timings.tokenize_s = time.perf_counter() - began
        answer.tokens = sum(len(e.ids) for e in encoded)
        return await run_parts(
            state, entry, STAYS, encoded, deadline, runner, payload_of, answer.timings
        )

    async def _stream(
        self,
        requests: AsyncIterator[Any],
        context: Any,
        method: str,
        endpoint: str,
        kinds: tuple[str, ...],
        handle: Callable[[Any, ModelEntry, Any], Awaitable[tuple[Any, Any]]],
    ) -> None:
        """A *Stream call: each request handled as its unary call (counted as one, under its
        own request id), up to --grpc-stream-in-flight at once, answered in order; the first
        that fails ends the stream with its status."""
        async with self._tei(context, method, endpoint, *kinds, unary=False) as (call, entry):
            limit = asyncio.Semaphore(self.state.settings.grpc_stream_in_flight)
            order: asyncio.Queue[asyncio.Task | None] = asyncio.Queue()

            metadata = _metadata(context)
            count = 0

            async def one(request: Any, rid: str) -> Any:
                name, version = entry.name, entry.version
                with (
                    self.observed(f"{method}.request", rid, endpoint, name, version) as c,
                    self._traced(metadata, entry, endpoint, c) if kinds else nullcontext(),
                ):
                    try:
                        return (await handle(_decoded(request), entry, context))[0]
                    except ServiceError as exc:
                        c.status, c.reason = exc.status, exc.reason
                        raise
                    except Exception:
                        c.status, c.reason = 500, "inference_error"
                        raise

            async def read() -> None:
                nonlocal count
                try:
                    async for request in requests:
                        await limit.acquire()
                        rid, count = f"{call.request_id}-{count}", count + 1
                        order.put_nowait(asyncio.create_task(one(request, rid)))
                finally:  # the end of the stream, or of reading it (then `await reader` raises)
                    order.put_nowait(None)

            reader = asyncio.create_task(read())
            try:
                while (task := await order.get()) is not None:
                    try:
                        answer = await task
                    finally:
                        limit.release()
                    await context.write(answer)
                await reader
            finally:
                reader.cancel()
                while not order.empty():
                    task = order.get_nowait()
                    if task is not None:
                        task.cancel()

    # -- Info ---------------------------------------------------------------------------------
    async def Info(self, request, context):
        async with self._tei(context, "tei.v1.Info/Info", None) as (_, entry):
            fields = info_fields(self.state, entry)
            del fields["auto_truncate"], fields["prompts"]  # not in the gRPC message
            return pb.InfoResponse(
                **fields,
                model_type=MODEL_TYPES[model_kind(entry.model)],
                tokenization_workers=current_default_thread_limiter().total_tokens,
            )

    # -- Embed --------------------------------------------------------------------------------
    async def _embed(self, request: Any, entry: ModelEntry, context: Any) -> tuple[Any, Answer]:
        width = entry.model.embedding_dim
        dimensions = request.dimensions if request.HasField("dimensions") else None
        if dimensions is not None and not 1 <= dimensions <= width:
            raise BadInput(f"'dimensions' {dimensions} must be in [1, {width}], the embedding size")
        answer = Answer(len(request.inputs))
        texts = with_prompt(entry, [request.inputs], _prompt_name(request))
        (vector,) = await self._run(
            context, entry, texts, request.truncate, request.truncation_direction,
            raw_embed_runner, answer,
        )  # fmt: skip
        if dimensions is not None:  # as TEI: cut the raw vector, then normalize
            vector = vector[:dimensions]
        if not request.HasField("normalize") or request.normalize:  # absent: true
            (vector,) = normalized([vector])
        response = pb.EmbedResponse(metadata=answer.metadata())
        response.embeddings.extend(np.asarray(vector, np.float32).tolist())
        return response, answer

    async def _embed_sparse(
        self, request: Any, entry: ModelEntry, context: Any
    ) -> tuple[Any, Answer]:
        answer = Answer(len(request.inputs))
        texts = with_prompt(entry, [request.inputs], _prompt_name(request))
        (weights,) = await self._run(
            context, entry, texts, request.truncate, request.truncation_direction,
            sparse_runner, answer,
        )  # fmt: skip
        response = pb.EmbedSparseResponse(metadata=answer.metadata())
        for index, value in zip(weights["index"].tolist(), weights["value"].tolist(), strict=True):
            response.sparse_embeddings.add(index=index, value=value)
        return response, answer

    async def _embed_all(self, request: Any, entry: ModelEntry, context: Any) -> tuple[Any, Answer]:
        answer = Answer(len(request.inputs))
        texts = with_prompt(entry, [request.inputs], _prompt_name(request))
        (states,) = await self._run(
            context, entry, texts, request.truncate, request.truncation_direction,
            token_runner, answer,
        )  # fmt: skip
        response = pb.EmbedAllResponse(metadata=answer.metadata())
        for row in np.asarray(states, np.float32).tolist():
            response.token_embeddings.add().embeddings.extend(row)
        return response, answer

    async def Embed(self, request, context):
        async with self._tei(context, "tei.v1.Embed/Embed", "embed", "embedding") as (call, entry):
            response, answer = await self._embed(request, entry, context)
            self._answered(call, answer)
            return response

    async def EmbedStream(self, request_iterator, context):
        await self._stream(request_iterator, context, "tei.v1.Embed/EmbedStream", "embed",
                           ("embedding",), self._embed)  # fmt: skip

    async def EmbedSparse(self, request, context):
        method = "tei.v1.Embed/EmbedSparse"
        async with self._tei(context, method, "embed_sparse", "sparse") as (call, entry):
            response, answer = await self._embed_sparse(request, entry, context)
            self._answered(call, answer)
            return response

    async def EmbedSparseStream(self, request_iterator, context):
        await self._stream(request_iterator, context, "tei.v1.Embed/EmbedSparseStream",
                           "embed_sparse", ("sparse",), self._embed_sparse)  # fmt: skip

    async def EmbedAll(self, request, context):
        method = "tei.v1.Embed/EmbedAll"
        async with self._tei(context, method, "embed_all", "embedding") as (call, entry):
            response, answer = await self._embed_all(request, entry, context)
            self._answered(call, answer)
            return response

    async def EmbedAllStream(self, request_iterator, context):
        await self._stream(request_iterator, context, "tei.v1.Embed/EmbedAllStream",
                           "embed_all", ("embedding",), self._embed_all)  # fmt: skip

    # -- Predict ------------------------------------------------------------------------------
    async def _predict(self, request: Any, entry: ModelEntry, context: Any) -> tuple[Any, Answer]:
        if isinstance(request, pb.PredictPairRequest):
            if len(request.inputs) not in (1, 2):
                raise BadInput(
                    f"'inputs' must hold one text or a pair; it holds {len(request.inputs)}"
                )
            item: Text = request.inputs[0] if len(request.inputs) == 1 else tuple(request.inputs)  # type: ignore[assignment]
        else:
            item = request.inputs
        chars = len(item) if isinstance(item, str) else sum(map(len, item))
        answer = Answer(chars)
        (logits,) = await self._run(
            context, entry, [item], request.truncate, request.truncation_direction,
            classify_runner, answer, payload_of=typed_payload,
        )  # fmt: skip
        how = "none" if request.raw_scores else None
        response = pb.PredictResponse(metadata=answer.metadata())
        for p in predictions(entry, logits, how):
            response.predictions.add(label=p["label"], score=p["score"])
        return response, answer

    async def Predict(self, request, context):
        kinds = ("classifier", "reranker")
        async with self._tei(context, "tei.v1.Predict/Predict", "predict", *kinds) as (call, entry):
            response, answer = await self._predict(request, entry, context)
            self._answered(call, answer)
            return response

    async def PredictPair(self, request, context):
        method, kinds = "tei.v1.Predict/PredictPair", ("classifier", "reranker")
        async with self._tei(context, method, "predict", *kinds) as (call, entry):
            response, answer = await self._predict(request, entry, context)
            self._answered(call, answer)
            return response

    async def PredictStream(self, request_iterator, context):
        await self._stream(request_iterator, context, "tei.v1.Predict/PredictStream", "predict",
                           ("classifier", "reranker"), self._predict)  # fmt: skip

    async def PredictPairStream(self, request_iterator, context):
        await self._stream(request_iterator, context, "tei.v1.Predict/PredictPairStream",
                           "predict", ("classifier", "reranker"), self._predict)  # fmt: skip

    # -- Rerank -------------------------------------------------------------------------------
    async def _rank(
        self,
        context: Any,
        entry: ModelEntry,
        pairs: list[tuple[str, str]],
        truncate: bool,
        direction: int,
        raw_scores: bool,
        return_text: bool,
    ) -> tuple[Any, Answer]:
        check_batch(self.state, len(pairs), "texts")
        for query, _ in pairs:
            check_query(query)
        answer = Answer(sum(len(q) + len(t) for q, t in pairs))
        logits = await self._run(
            context, entry, list(pairs), truncate, direction, classify_runner, answer, "texts",
            instruction(entry, None), typed_payload,
        )  # fmt: skip
        values, order = ranked(logits, raw_scores)
        response = pb.RerankResponse(metadata=answer.metadata())
        for i in order:
            rank = response.ranks.add(index=i, score=values[i])
            if return_text:
                rank.text = pairs[i][1]
        return response, answer

    async def Rerank(self, request, context):
        async with self._tei(context, "tei.v1.Rerank/Rerank", "rerank", "reranker") as (
            call,
            entry,
        ):
            pairs = [(request.query, text) for text in request.texts]
            response, answer = await self._rank(
                context, entry, pairs, request.truncate, request.truncation_direction,
                request.raw_scores, request.return_text,
            )  # fmt: skip
            self._answered(call, answer)
            return response

    async def RerankStream(self, request_iterator, context):
        """(query, text) pairs in, one ranking out once the client closes its side; the first
        request's raw_scores, return_text, truncate and direction apply to all (as in TEI's,
        but for truncate and direction, which TEI reads per pair: one batch has one rule); at
        most --max-client-batch-size pairs, as one Rerank."""
        method = "tei.v1.Rerank/RerankStream"
        async with self._tei(context, method, "rerank", "reranker") as (call, entry):
            pairs: list[tuple[str, str]] = []
            first = None
            async for request in request_iterator:
                request = _decoded(request)
                first = first or request
                pairs.append((request.query, request.text))
                check_batch(self.state, len(pairs), "texts")  # stop reading past the limit
            if first is None:
                raise BadInput("the stream sent no (query, text) pair; send at least one")
            response, answer = await self._rank(
                context, entry, pairs, first.truncate, first.truncation_direction,
                first.raw_scores, first.return_text,
            )  # fmt: skip
            self._answered(call, answer)
            return response

    # -- Tokenize -----------------------------------------------------------------------------
    async def _tokenize(self, request: Any, entry: ModelEntry, context: Any) -> tuple[Any, None]:
        tokenizer = entry.tokenizer
        assert tokenizer is not None  # text_entry chose a text model
        texts = with_prompt(entry, [request.inputs], _prompt_name(request))
        check_chars(texts, entry.char_limits)
        deadline = time.monotonic() + self.state.settings.request_timeout_s
        async with entry.batcher.reserve(1):  # off the loop when long, like Embed
            (tokens,) = await tokenize(
                self.state, entry, STAYS, texts, deadline,
                lambda part: tokenizer.tokens(part, request.add_special_tokens),
            )  # fmt: skip
        response = pb.EncodeResponse()
        for token in tokens:
            response.tokens.add(**token)
        return response, None

    async def _decode(self, request: Any, entry: ModelEntry, context: Any) -> tuple[Any, None]:
        tokenizer = entry.tokenizer
        assert tokenizer is not None  # text_entry chose a text model
        vocab = entry.model.vocab_size
        ids = list(request.ids)
        if len(ids) > tokenizer.max_length or any(t >= vocab for t in ids):
            raise BadInput(f"'ids' must hold at most {tokenizer.max_length} ids in [0, {vocab})")
        (text,) = tokenizer.decode([ids], request.skip_special_tokens)
        return pb.DecodeResponse(text=text), None

    async def Tokenize(self, request, context):
        async with self._tei(context, "tei.v1.Tokenize/Tokenize", "tokenize") as (_, entry):
            return (await self._tokenize(request, entry, context))[0]

    async def TokenizeStream(self, request_iterator, context):
        await self._stream(request_iterator, context, "tei.v1.Tokenize/TokenizeStream",
                           "tokenize", (), self._tokenize)  # fmt: skip

    async def Decode(self, request, context):
        async with self._tei(context, "tei.v1.Tokenize/Decode", "decode") as (_, entry):
            return (await self._decode(request, entry, context))[0]

    async def DecodeStream(self, request_iterator, context):
        await self._stream(request_iterator, context, "tei.v1.Tokenize/DecodeStream", "decode",
                           (), self._decode)  # fmt: skip
