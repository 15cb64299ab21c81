"""text-embeddings-inference's gRPC API (package tei.v1: Info, Embed, Predict, Rerank,
Tokenize) on --grpc-port, beside Triton's service: TEI's messages over the core its HTTP routes
use (service.text.tei_ops, service.text.work), with each call's plumbing in
service.grpc.tei_calls.

TEI serves one model; a call here uses the model its `model` metadata names, else the first
served text model of the kind the call needs (as TEI's HTTP routes here). As in TEI's gRPC
server: `truncate` is the request's own (proto3 cannot leave it unsaid, so --auto-truncate does
not apply), a unary answer carries TEI's x-compute-* timing headers, a *Stream call answers
its requests in order and ends with the status of the first one that fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from anyio.to_thread import current_default_thread_limiter
from starlette.concurrency import run_in_threadpool

from service.grpc import tei_pb2 as pb
from service.grpc import tei_pb2_grpc as pb_grpc
from service.grpc.calls import STREAM_DRAINED, cancel_with_call, read_until_drain
from service.grpc.decode_errors import answers_undecodable, decoded
from service.grpc.tei_calls import STAYS, Answer, TeiCalls, prompt_name
from service.pipeline.errors import BadInput, NotReady, PayloadTooLarge
from service.text.kinds import model_kind
from service.text.tei_ops import (
    check_batch,
    check_decode,
    check_present,
    check_query,
    info_fields,
    instruction,
    normalized,
    predictions,
    ranked,
    with_prompt,
)
from service.text.tokenizer import (
    Text,
    classify_runner,
    raw_embed_runner,
    sparse_runner,
    token_runner,
    typed_payload,
)
from service.text.work import check_chars, tokenize

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry

RANKS = ("classifier", "reranker")  # the kinds Predict answers
MODEL_TYPES = {
    "embedding": pb.MODEL_TYPE_EMBEDDING,
    "sparse": pb.MODEL_TYPE_EMBEDDING,  # TEI serves SPLADE as an embedding model
    "classifier": pb.MODEL_TYPE_CLASSIFIER,
    "reranker": pb.MODEL_TYPE_RERANKER,
}


OFFLOAD_VALUES = 1 << 16  # an EmbedAll answer past this many values is built on a worker thread


def _token_states(states: np.ndarray, metadata: Any) -> Any:
    """EmbedAll's answer: one TokenEmbedding per token of `states` (T, D)."""
    response = pb.EmbedAllResponse(metadata=metadata)
    for row in np.asarray(states, np.float32).tolist():
        response.token_embeddings.add().embeddings.extend(row)
    return response


class TeiServicer(
    TeiCalls,
    pb_grpc.InfoServicer,
    pb_grpc.EmbedServicer,
    pb_grpc.PredictServicer,
    pb_grpc.RerankServicer,
    pb_grpc.TokenizeServicer,
):
    """TEI's five services over the lifespan's ServiceState."""

    # -- Info ---------------------------------------------------------------------------------
    async def Info(self, request, context):
        async with self.tei_call(context, "tei.v1.Info/Info", None) as (_, entry):
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
        vector = await self._one_text(request, entry, context, raw_embed_runner, answer)
        if dimensions is not None:  # as TEI: cut the raw vector, then normalize
            vector = vector[:dimensions]
        if not request.HasField("normalize") or request.normalize:  # absent: true
            (vector,) = normalized([vector])
        response = pb.EmbedResponse(metadata=answer.metadata())
        response.embeddings.extend(np.asarray(vector, np.float32).tolist())
        return response, answer

    async def _one_text(
        self, request: Any, entry: ModelEntry, context: Any, runner: Any, answer: Answer
    ) -> Any:
        """An Embed* message's one text (its prompt first) through `runner`: its result."""
        texts = with_prompt(entry, [request.inputs], prompt_name(request))
        (result,) = await self.run(
            context, entry, texts, request.truncate, request.truncation_direction, runner, answer
        )
        return result

    async def _embed_sparse(
        self, request: Any, entry: ModelEntry, context: Any
    ) -> tuple[Any, Answer]:
        answer = Answer(len(request.inputs))
        weights = await self._one_text(request, entry, context, sparse_runner, answer)
        response = pb.EmbedSparseResponse(metadata=answer.metadata())
        for index, value in zip(weights["index"].tolist(), weights["value"].tolist(), strict=True):
            response.sparse_embeddings.add(index=index, value=value)
        return response, answer

    async def _embed_all(self, request: Any, entry: ModelEntry, context: Any) -> tuple[Any, Answer]:
        answer = Answer(len(request.inputs))
        states = await self._one_text(request, entry, context, token_runner, answer)
        metadata = answer.metadata()
        if states.size > OFFLOAD_VALUES:  # a float object per value: off the event loop
            response = await run_in_threadpool(_token_states, states, metadata)
        else:
            response = _token_states(states, metadata)
        size, limit = response.ByteSize(), self.state.settings.max_body_bytes
        if size > limit:  # gRPC would refuse to send it (its limit is the same)
            raise PayloadTooLarge(
                f"the answer ({states.shape[0]} tokens x {states.shape[1]} values) is {size} "
                f"bytes, over --max-body-bytes ({limit}); send less text"
            )
        return response, answer

    @answers_undecodable
    async def Embed(self, request, context):
        return await self.unary(
            request, context, "tei.v1.Embed/Embed", "embed", ("embedding",), self._embed
        )

    async def EmbedStream(self, request_iterator, context):
        await self.stream(request_iterator, context, "tei.v1.Embed/EmbedStream", "embed",
                           ("embedding",), self._embed)  # fmt: skip

    @answers_undecodable
    async def EmbedSparse(self, request, context):
        return await self.unary(
            request,
            context,
            "tei.v1.Embed/EmbedSparse",
            "embed_sparse",
            ("sparse",),
            self._embed_sparse,
        )

    async def EmbedSparseStream(self, request_iterator, context):
        await self.stream(request_iterator, context, "tei.v1.Embed/EmbedSparseStream",
                           "embed_sparse", ("sparse",), self._embed_sparse)  # fmt: skip

    @answers_undecodable
    async def EmbedAll(self, request, context):
        return await self.unary(
            request, context, "tei.v1.Embed/EmbedAll", "embed_all", ("embedding",), self._embed_all
        )

    async def EmbedAllStream(self, request_iterator, context):
        await self.stream(request_iterator, context, "tei.v1.Embed/EmbedAllStream",
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
        (logits,) = await self.run(
            context, entry, [item], request.truncate, request.truncation_direction,
            classify_runner, answer, prompt=instruction(entry, None), payload_of=typed_payload,
        )  # fmt: skip
        how = "none" if request.raw_scores else None
        response = pb.PredictResponse(metadata=answer.metadata())
        for p in predictions(entry, logits, how):
            response.predictions.add(label=p["label"], score=p["score"])
        return response, answer

    @answers_undecodable
    async def Predict(self, request, context):
        return await self.unary(
            request, context, "tei.v1.Predict/Predict", "predict", RANKS, self._predict
        )

    @answers_undecodable
    async def PredictPair(self, request, context):
        return await self.unary(
            request, context, "tei.v1.Predict/PredictPair", "predict", RANKS, self._predict
        )

    async def PredictStream(self, request_iterator, context):
        await self.stream(request_iterator, context, "tei.v1.Predict/PredictStream", "predict",
                           RANKS, self._predict)  # fmt: skip

    async def PredictPairStream(self, request_iterator, context):
        await self.stream(request_iterator, context, "tei.v1.Predict/PredictPairStream",
                           "predict", RANKS, self._predict)  # fmt: skip

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
        logits = await self.run(
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

    @answers_undecodable
    async def Rerank(self, request, context):
        return await self.unary(
            request, context, "tei.v1.Rerank/Rerank", "rerank", ("reranker",), self._rerank
        )

    async def _rerank(self, request: Any, entry: ModelEntry, context: Any) -> tuple[Any, Answer]:
        pairs = [(request.query, text) for text in request.texts]
        return await self._rank(
            context, entry, pairs, request.truncate, request.truncation_direction,
            request.raw_scores, request.return_text,
        )  # fmt: skip

    async def RerankStream(self, request_iterator, context):
        """(query, text) pairs in, one ranking out once the client closes its side; the first
        request's raw_scores, return_text, truncate and direction apply to all (as in TEI's,
        but for truncate and direction, which TEI reads per pair: one batch has one rule); at
        most --max-client-batch-size pairs and --max-request-chars characters, as one Rerank,
        refused as soon as the stream passes either."""
        method = "tei.v1.Rerank/RerankStream"
        async with self.tei_call(context, method, "rerank", "reranker") as (call, entry):
            cancel_with_call(context)  # a cancelled stream is not ranked
            pairs: list[tuple[str, str]] = []
            first = None
            chars, limit = 0, entry.char_limits.per_request

            async def read() -> None:
                nonlocal first, chars
                async for request in request_iterator:
                    request = decoded(request)
                    if first is None:
                        first = request
                    pairs.append((request.query, request.text))
                    check_batch(self.state, len(pairs), "texts")  # stop reading past the limits
                    chars += len(request.query) + len(request.text)
                    if chars > limit:
                        raise PayloadTooLarge(
                            f"the stream's pairs have over {limit} characters in all, the limit "
                            "per request (--max-request-chars; a query counts once per pair)"
                        )

            if await read_until_drain(read(), self.state):  # half a ranking is no answer
                raise NotReady(STREAM_DRAINED)
            if first is None:
                raise BadInput("the stream sent no (query, text) pair; send at least one")
            response, answer = await self._rank(
                context, entry, pairs, first.truncate, first.truncation_direction,
                first.raw_scores, first.return_text,
            )  # fmt: skip
            self.answered(call, answer)
            return response

    # -- Tokenize -----------------------------------------------------------------------------
    async def _tokenize(self, request: Any, entry: ModelEntry, context: Any) -> tuple[Any, None]:
        tokenizer = entry.tokenizer
        assert tokenizer is not None  # text_entry chose a text model
        check_present([request.inputs])
        texts = with_prompt(entry, [request.inputs], prompt_name(request))
        check_chars(texts, entry.char_limits)
        async with entry.batcher.reserve(1):  # off the loop when long, like Embed
            (tokens,) = await tokenize(
                self.state, entry, STAYS, texts, self.deadline(context),
                lambda part: tokenizer.tokens(part, request.add_special_tokens),
            )  # fmt: skip
        response = pb.EncodeResponse()
        for token in tokens:
            response.tokens.add(**token)
        return response, None

    async def _decode(self, request: Any, entry: ModelEntry, context: Any) -> tuple[Any, None]:
        tokenizer = entry.tokenizer
        assert tokenizer is not None  # text_entry chose a text model
        ids = list(request.ids)
        check_decode(entry, [ids])
        (text,) = tokenizer.decode([ids], request.skip_special_tokens)
        return pb.DecodeResponse(text=text), None

    @answers_undecodable
    async def Tokenize(self, request, context):
        return await self.unary(
            request, context, "tei.v1.Tokenize/Tokenize", "tokenize", (), self._tokenize
        )

    async def TokenizeStream(self, request_iterator, context):
        await self.stream(request_iterator, context, "tei.v1.Tokenize/TokenizeStream",
                           "tokenize", (), self._tokenize)  # fmt: skip

    @answers_undecodable
    async def Decode(self, request, context):
        return await self.unary(
            request, context, "tei.v1.Tokenize/Decode", "decode", (), self._decode
        )

    async def DecodeStream(self, request_iterator, context):
        await self.stream(request_iterator, context, "tei.v1.Tokenize/DecodeStream", "decode",
                           (), self._decode)  # fmt: skip
