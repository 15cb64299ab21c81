"""TEI's gRPC API (tei.v1) on a real gRPC listener, the app in process: an embedding model, a
classifier, a reranker and a SPLADE model served together. Every call's numbers against
transformers (or the same server's HTTP route, itself tested against transformers), streams
in order and ending at the first failure, the `model` metadata, TEI's status codes and
x-compute-* headers, the standard health service, the API key and the request metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from benchmarks import scrape
from service.grpc import health_pb2, health_pb2_grpc
from service.grpc import tei_pb2 as pb
from service.grpc import tei_pb2_grpc as pb_grpc
from tests.inprocess import asgi_client
from tests.support import free_port

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm
from tests.service.test_text_routing import logits, mean_pooled

QUERY = "what is deep learning"
PASSAGES = ["deep learning is machine learning", "the cat sat on the mat", "paris"]
TOL = {"atol": 1e-5, "rtol": 1.3e-6}  # fp32: engine against transformers
KEY = "tei-grpc-key"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Served name -> (transformers model, directory), in serving order."""
    root = tmp_path_factory.mktemp("tei-grpc")
    return {
        "emb": tm.sentence_transformer(root / "emb", pooling="mean", normalize=True),
        "clf": tm.classifier("bert", root / "clf", seed=1),
        "rr": tm.classifier("bert", root / "rr", {0: "score"}, seed=2),
        "splade": tm.splade(root / "splade"),
    }


class Stubs:
    """TEI's five stubs and the health stub on one channel, plus the app's HTTP client."""

    def __init__(self, channel: grpc.aio.Channel, http) -> None:
        self.info = pb_grpc.InfoStub(channel)
        self.embed = pb_grpc.EmbedStub(channel)
        self.predict = pb_grpc.PredictStub(channel)
        self.rerank = pb_grpc.RerankStub(channel)
        self.tokenize = pb_grpc.TokenizeStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.channel = channel
        self.http = http


def serve(dirs: list[Path], test: Callable, **settings: object) -> None:
    async def main() -> None:
        port = free_port()
        async with (
            asgi_client(model_dir=dirs, grpc_port=port, **settings) as http,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            await test(Stubs(channel, http))

    asyncio.run(main())


def dirs_of(models: dict[str, tuple], *names: str) -> list[Path]:
    return [models[name][1] for name in names or models]


def f32(values) -> np.ndarray:
    return np.asarray(list(values), np.float32)


async def code_of(call) -> grpc.StatusCode:
    """The status code a call ends with (it must fail)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if isinstance(call, (grpc.aio.StreamStreamCall, grpc.aio.UnaryStreamCall)):
            async for _ in call:
                pass
        else:
            await call
    return info.value.code()


def test_embed_calls_equal_transformers_and_the_http_routes(models):
    emb, emb_dir = models["emb"]
    expected = mean_pooled(emb, emb_dir, PASSAGES)
    with torch.no_grad():
        ids, mask, _ = tm.padded(tm.tokenize(emb_dir, PASSAGES[:1]))
        states = emb(input_ids=ids, attention_mask=mask).last_hidden_state[0].numpy()

    async def test(s: Stubs) -> None:
        for text, want in zip(PASSAGES, expected, strict=True):
            call = s.embed.Embed(pb.EmbedRequest(inputs=text))
            got = np.asarray((await call).embeddings, np.float32)
            np.testing.assert_allclose(got, want, **TOL)
            headers = dict(await call.initial_metadata())
            assert headers["x-request-id"] and headers["x-compute-type"] == "cpu"
            tokens = len(tm.tokenize(emb_dir, [text])[0][0])
            assert headers["x-compute-tokens"] == str(tokens)
            assert headers["x-compute-characters"] == str(len(text))
            assert {
                "x-total-time",
                "x-tokenization-time",
                "x-queue-time",
                "x-inference-time",
            } <= set(headers)
            meta = (await call).metadata
            assert meta.compute_tokens == tokens and meta.compute_chars == len(text)
            assert meta.total_time_ns >= meta.inference_time_ns > 0
        http = await s.http.post("/embed", json={"inputs": PASSAGES[0], "normalize": False})
        raw = await s.embed.Embed(pb.EmbedRequest(inputs=PASSAGES[0], normalize=False))
        assert f32(raw.embeddings).tobytes() == f32(http.json()[0]).tobytes()  # bit for bit
        cut = await s.embed.Embed(pb.EmbedRequest(inputs=PASSAGES[0], dimensions=8))
        http = await s.http.post("/embed", json={"inputs": PASSAGES[0], "dimensions": 8})
        assert len(cut.embeddings) == 8
        assert f32(cut.embeddings).tobytes() == f32(http.json()[0]).tobytes()
        width = len(expected[0])
        too_wide = s.embed.Embed(pb.EmbedRequest(inputs="x", dimensions=width + 1))
        assert await code_of(too_wide) == grpc.StatusCode.INVALID_ARGUMENT

        every = await s.embed.EmbedAll(pb.EmbedAllRequest(inputs=PASSAGES[0]))
        got = np.asarray([list(t.embeddings) for t in every.token_embeddings], np.float32)
        np.testing.assert_allclose(got, states, **TOL)

        info = await s.info.Info(pb.InfoRequest())
        assert (info.model_id, info.model_type) == ("emb", pb.MODEL_TYPE_EMBEDDING)
        long = " ".join(["word"] * 300)  # over the tiny model's max length
        refused = s.embed.Embed(pb.EmbedRequest(inputs=long))  # truncate: false, as in TEI
        assert await code_of(refused) == grpc.StatusCode.INVALID_ARGUMENT
        cut = await s.embed.Embed(pb.EmbedRequest(inputs=long, truncate=True))
        assert cut.metadata.compute_tokens == info.max_input_length
        empty = s.embed.Embed(pb.EmbedRequest(inputs=""))
        assert await code_of(empty) == grpc.StatusCode.INVALID_ARGUMENT

    serve(dirs_of(models), test)


def test_streams_answer_in_order_and_end_at_the_first_failure(models):
    emb, emb_dir = models["emb"]
    expected = mean_pooled(emb, emb_dir, PASSAGES * 3)

    async def test(s: Stubs) -> None:
        texts = PASSAGES * 3
        answers = [a async for a in s.embed.EmbedStream(pb.EmbedRequest(inputs=t) for t in texts)]
        got = np.asarray([list(a.embeddings) for a in answers], np.float32)
        np.testing.assert_allclose(got, expected, **TOL)  # in the order sent

        requests = [pb.EmbedRequest(inputs=t) for t in ("one", "two", "", "four")]
        call = s.embed.EmbedStream(iter(requests))
        seen = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for answer in call:
                seen.append(answer)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "empty" in info.value.details()
        assert len(seen) == 2  # the two before the empty input, then the stream's end

        raw = s.channel.stream_stream(
            "/tei.v1.Embed/EmbedStream", lambda b: b, pb.EmbedResponse.FromString
        )  # a message that is no protobuf after one that is
        call = raw(iter([pb.EmbedRequest(inputs="one").SerializeToString(), b"\xff\xff"]))
        seen = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for answer in call:
                seen.append(answer)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(seen) == 1
        assert "not a valid protobuf message" in info.value.details()

        words = ["hello world", "paris"]
        tokens = [
            a async for a in s.tokenize.TokenizeStream(pb.EncodeRequest(inputs=w) for w in words)
        ]
        assert [[t.text for t in a.tokens] for a in tokens] == [["hello", "world"], ["paris"]]

    serve(dirs_of(models, "emb"), test)


def test_predict_rerank_and_sparse_reach_their_models(models):
    (clf, clf_dir), (rr, rr_dir), (splade, splade_dir) = (
        models[n] for n in ("clf", "rr", "splade")
    )
    pair_logits = logits(rr, rr_dir, [(QUERY, p) for p in PASSAGES], pairs=True)[:, 0]
    rerank = 1 / (1 + np.exp(-pair_logits.astype(np.float64)))
    single = logits(clf, clf_dir, ["good movie"], pairs=False)[0].astype(np.float64)
    softmax = np.exp(single - single.max()) / np.exp(single - single.max()).sum()
    pair = logits(clf, clf_dir, [("good", "movie")], pairs=True)[0].astype(np.float64)
    weights = tm.splade_reference(splade, tm.tokenize(splade_dir, ["sparse words"]))[0].numpy()

    async def test(s: Stubs) -> None:
        predicted = await s.predict.Predict(pb.PredictRequest(inputs="good movie"))
        labels = clf.config.id2label
        order = np.argsort(-softmax, kind="stable")
        assert [p.label for p in predicted.predictions] == [labels[int(i)] for i in order]
        np.testing.assert_allclose(
            [p.score for p in predicted.predictions], softmax[order], atol=1e-6
        )
        raw = await s.predict.PredictPair(
            pb.PredictPairRequest(inputs=["good", "movie"], raw_scores=True)
        )
        got = {p.label: p.score for p in raw.predictions}
        np.testing.assert_allclose([got[labels[i]] for i in range(len(pair))], pair, atol=1e-5)
        three = s.predict.PredictPair(pb.PredictPairRequest(inputs=["a", "b", "c"]))
        assert await code_of(three) == grpc.StatusCode.INVALID_ARGUMENT
        streamed = [
            a
            async for a in s.predict.PredictStream(
                pb.PredictRequest(inputs=t) for t in ("good movie", "good movie")
            )
        ]
        assert streamed[0].predictions == streamed[1].predictions == predicted.predictions

        ranked = await s.rerank.Rerank(
            pb.RerankRequest(query=QUERY, texts=PASSAGES, return_text=True)
        )
        order = np.argsort(-rerank, kind="stable")
        assert [r.index for r in ranked.ranks] == order.tolist()
        assert [r.text for r in ranked.ranks] == [PASSAGES[i] for i in order]
        np.testing.assert_allclose([r.score for r in ranked.ranks], rerank[order], atol=1e-6)
        pairs = (pb.RerankStreamRequest(query=QUERY, text=p, return_text=True) for p in PASSAGES)
        assert (await s.rerank.RerankStream(pairs)).ranks == ranked.ranks
        for bad in (
            pb.RerankRequest(query=QUERY, texts=[]),
            pb.RerankRequest(query="", texts=["a"]),
            pb.RerankRequest(query=QUERY, texts=["a"] * 33),  # --max-client-batch-size 32
        ):
            assert await code_of(s.rerank.Rerank(bad)) == grpc.StatusCode.INVALID_ARGUMENT
        assert await code_of(s.rerank.RerankStream(iter(()))) == grpc.StatusCode.INVALID_ARGUMENT

        sparse = await s.embed.EmbedSparse(pb.EmbedSparseRequest(inputs="sparse words"))
        nonzero = np.flatnonzero(weights)
        assert [v.index for v in sparse.sparse_embeddings] == nonzero.tolist()
        np.testing.assert_allclose(
            [v.value for v in sparse.sparse_embeddings], weights[nonzero], **TOL
        )

        # The `model` metadata picks a model; one of the wrong kind is TEI's FAILED_PRECONDITION
        as_rr = await s.predict.Predict(
            pb.PredictRequest(inputs="good movie"), metadata=(("model", "rr"),)
        )
        assert [p.label for p in as_rr.predictions] == ["score"]
        wrong = s.embed.Embed(pb.EmbedRequest(inputs="x"), metadata=(("model", "clf"),))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await wrong
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'clf' is a classifier model, which offers Predict" in info.value.details()
        unknown = s.embed.Embed(pb.EmbedRequest(inputs="x"), metadata=(("model", "nope"),))
        assert await code_of(unknown) == grpc.StatusCode.NOT_FOUND
        infos = {
            name: (await s.info.Info(pb.InfoRequest(), metadata=(("model", name),))).model_type
            for name in models
        }
        assert infos == {
            "emb": pb.MODEL_TYPE_EMBEDDING,
            "clf": pb.MODEL_TYPE_CLASSIFIER,
            "rr": pb.MODEL_TYPE_RERANKER,
            "splade": pb.MODEL_TYPE_EMBEDDING,
        }

        text = (await s.http.get("/metrics")).text
        for endpoint in ("predict", "rerank", "embed_sparse"):
            assert (
                scrape.value(
                    text, "mha_requests_total", protocol="grpc", endpoint=endpoint, status="200"
                )
                > 0
            )
        assert (
            scrape.value(
                text, "mha_requests_total", protocol="grpc", endpoint="embed", status="424"
            )
            == 1
        )

    serve(dirs_of(models), test)


def test_tokenize_and_decode_equal_the_http_routes(models):
    async def test(s: Stubs) -> None:
        text = "Hello, tiny world!"
        for special in (True, False):
            http = await s.http.post(
                "/tokenize", json={"inputs": text, "add_special_tokens": special}
            )
            got = await s.tokenize.Tokenize(
                pb.EncodeRequest(inputs=text, add_special_tokens=special)
            )
            fields = [
                (
                    t.id,
                    t.text,
                    t.special,
                    *((t.start, t.stop) if t.HasField("start") else (None, None)),
                )
                for t in got.tokens
            ]
            assert fields == [tuple(t.values()) for t in http.json()[0]]
        ids = [t.id for t in got.tokens]
        for skip in (True, False):
            http = await s.http.post("/decode", json={"ids": ids, "skip_special_tokens": skip})
            got = await s.tokenize.Decode(pb.DecodeRequest(ids=ids, skip_special_tokens=skip))
            assert got.text == http.json()[0]
        for bad in (pb.DecodeRequest(ids=[10**6]), pb.DecodeRequest(ids=[])):
            assert await code_of(s.tokenize.Decode(bad)) == grpc.StatusCode.INVALID_ARGUMENT
        empty = s.tokenize.Tokenize(pb.EncodeRequest(inputs=""))
        assert await code_of(empty) == grpc.StatusCode.INVALID_ARGUMENT
        decoded = s.tokenize.DecodeStream(pb.DecodeRequest(ids=ids) for _ in range(2))
        assert [a.text async for a in decoded] == [got.text] * 2

    serve(dirs_of(models, "emb"), test)


def test_health_service_and_the_api_key(models, caplog):
    """One embedding model: TEI's Predict and Rerank are NOT_SERVING, as TEI reports them for
    a model without that head; Check and Watch stay open without the key, TEI's calls do not,
    nor does an undecodable message."""
    auth = (("authorization", f"Bearer {KEY}"),)
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )

    async def test(s: Stubs) -> None:
        statuses = {}
        for service in (
            "",
            "inference.GRPCInferenceService",
            "tei.v1.Info",
            "tei.v1.Embed",
            "tei.v1.Predict",
            "tei.v1.Rerank",
            "tei.v1.Tokenize",
        ):
            answer = await s.health.Check(health_pb2.HealthCheckRequest(service=service))
            statuses[service] = answer.status
        assert statuses == {
            "": serving,
            "inference.GRPCInferenceService": serving,
            "tei.v1.Info": serving,
            "tei.v1.Embed": serving,
            "tei.v1.Predict": not_serving,
            "tei.v1.Rerank": not_serving,
            "tei.v1.Tokenize": serving,
        }
        unknown = s.health.Check(health_pb2.HealthCheckRequest(service="tei.v1.Nope"))
        assert await code_of(unknown) == grpc.StatusCode.NOT_FOUND
        watch = s.health.Watch(health_pb2.HealthCheckRequest(service="tei.v1.Embed"))
        assert (await watch.read()).status == serving
        s.http.app.state.service.draining = True  # as the drain on SIGTERM sets it
        assert (await asyncio.wait_for(watch.read(), 5)).status == not_serving
        s.http.app.state.service.draining = False
        watch.cancel()

        keyless = s.embed.Embed(pb.EmbedRequest(inputs="x"))
        assert await code_of(keyless) == grpc.StatusCode.UNAUTHENTICATED
        assert await code_of(s.info.Info(pb.InfoRequest())) == grpc.StatusCode.UNAUTHENTICATED
        answer = await s.embed.Embed(pb.EmbedRequest(inputs="x"), metadata=auth)
        assert len(answer.embeddings) > 0
        streamed = s.embed.EmbedStream(iter([pb.EmbedRequest(inputs="x")]))
        assert await code_of(streamed) == grpc.StatusCode.UNAUTHENTICATED

        # a message that is no protobuf: the key is checked first, then a refusal like any
        # other (request id, access line, a 400 in its endpoint's request metrics), on TEI's
        # and on Triton's service
        async def refused(endpoint: str) -> float:
            text = (await s.http.get("/metrics")).text
            labels = {"protocol": "grpc", "endpoint": endpoint, "status": "400"}
            try:
                return scrape.value(text, "mha_requests_total", **labels)
            except KeyError:
                return 0.0

        before = {endpoint: await refused(endpoint) for endpoint in ("embed", "infer")}
        for path in ("/tei.v1.Embed/Embed", "/inference.GRPCInferenceService/ModelInfer"):
            raw = s.channel.unary_unary(path, lambda b: b, lambda b: b)
            assert await code_of(raw(b"\xff\xff")) == grpc.StatusCode.UNAUTHENTICATED
            call = raw(b"\xff\xff", metadata=(*auth, ("x-request-id", "undecodable-1")))
            assert await code_of(call) == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid protobuf message" in (await call.details())
            assert dict(await call.initial_metadata())["x-request-id"] == "undecodable-1"
        assert {e: await refused(e) - n for e, n in before.items()} == {"embed": 1, "infer": 1}
        watch = s.channel.unary_stream("/grpc.health.v1.Health/Watch", lambda b: b, lambda b: b)
        call = watch(b"\xff\xff", metadata=(("x-request-id", "undecodable-2"),))  # open: no key
        assert await code_of(call) == grpc.StatusCode.INVALID_ARGUMENT
        lines = [r for r in caplog.records if getattr(r, "request_id", "") == "undecodable-1"]
        assert [(r.path, r.status) for r in lines] == [
            ("tei.v1.Embed/Embed", 400),
            ("ModelInfer", 400),
        ]

    caplog.set_level("INFO", logger="service.access")
    serve(dirs_of(models, "emb"), test, api_key=KEY)


def test_every_stream_call_the_model_prompt_and_the_request_id(models, tmp_path):
    """Each *Stream call answers as its unary call; a reranker's default prompt applies to
    gRPC Predict as to HTTP /predict; x-request-id comes back, on a refusal too; a bad enum or
    prompt name is INVALID_ARGUMENT; RerankStream takes its options from its first message."""
    import json
    import shutil

    prompted = tmp_path / "rrp"  # the reranker with a default prompt (an instruction)
    shutil.copytree(models["rr"][1], prompted)
    config = {"prompts": {"judge": "Is it relevant? "}, "default_prompt_name": "judge"}
    (prompted / "config_sentence_transformers.json").write_text(json.dumps(config))
    rrp = (("model", "rrp"),)

    async def test(s: Stubs) -> None:
        text = PASSAGES[0]
        unary = await s.embed.EmbedAll(pb.EmbedAllRequest(inputs=text))
        streamed = [
            a async for a in s.embed.EmbedAllStream(iter([pb.EmbedAllRequest(inputs=text)]))
        ]
        assert [a.token_embeddings for a in streamed] == [unary.token_embeddings]
        unary = await s.embed.EmbedSparse(pb.EmbedSparseRequest(inputs=text))
        sparse = s.embed.EmbedSparseStream(iter([pb.EmbedSparseRequest(inputs=text)] * 2))
        assert [a.sparse_embeddings async for a in sparse] == [unary.sparse_embeddings] * 2
        pair = pb.PredictPairRequest(inputs=[QUERY, text])
        unary = await s.predict.PredictPair(pair, metadata=rrp)
        streamed = [a async for a in s.predict.PredictPairStream(iter([pair]), metadata=rrp)]
        assert [a.predictions for a in streamed] == [unary.predictions]

        http = await s.http.post("/models/rrp/predict", json={"inputs": [QUERY, text]})
        assert http.status_code == 200, http.text
        assert f32([unary.predictions[0].score]) == f32([http.json()[0]["score"]])
        plain = await s.predict.PredictPair(pair, metadata=(("model", "rr"),))
        assert plain.predictions[0].score != unary.predictions[0].score  # the prompt counted

        call = s.embed.Embed(pb.EmbedRequest(inputs="x"), metadata=(("x-request-id", "abc-1"),))
        await call
        assert dict(await call.initial_metadata())["x-request-id"] == "abc-1"
        call = s.embed.Embed(pb.EmbedRequest(inputs=""), metadata=(("x-request-id", "abc-2"),))
        assert await code_of(call) == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(await call.initial_metadata())["x-request-id"] == "abc-2"
        for bad in (
            pb.EmbedRequest(inputs="x", truncation_direction=5),
            pb.EmbedRequest(inputs="x", prompt_name="nope"),
        ):
            assert await code_of(s.embed.Embed(bad)) == grpc.StatusCode.INVALID_ARGUMENT

        first_says = [
            pb.RerankStreamRequest(query=QUERY, text=PASSAGES[0], return_text=False),
            pb.RerankStreamRequest(query=QUERY, text=PASSAGES[1], return_text=True),
        ]
        ranked = await s.rerank.RerankStream(iter(first_says))
        assert len(ranked.ranks) == 2 and not any(r.HasField("text") for r in ranked.ranks)
        many = (pb.RerankStreamRequest(query=QUERY, text="a") for _ in range(33))
        assert await code_of(s.rerank.RerankStream(many)) == grpc.StatusCode.INVALID_ARGUMENT

    serve([*dirs_of(models), prompted], test)


def test_cancelling_a_stream_stops_its_work(models, caplog):
    """RerankStream: the client sends pairs and cancels without closing its side; nothing is
    ranked (counted 499), where a half-closed stream would have been. EmbedStream cancelled
    after its first answer ends with one line: 499, or 200 where grpc-aio handed the server
    the end of the client's messages before the cancel (docs/protocols/tei.md, Streams). An
    unknown service's Watch says SERVICE_UNKNOWN; a drain ends every Watch."""
    unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    caplog.set_level("INFO", logger="service.access")

    async def test(s: Stubs) -> None:
        async def one_then_wait():
            yield pb.EmbedRequest(inputs="one")
            await asyncio.Event().wait()  # never closes its side

        def stream_lines() -> list[int]:
            line = "GRPC tei.v1.Embed/EmbedStream "
            return [r.status for r in caplog.records if r.getMessage().startswith(line)]

        stream = s.embed.EmbedStream(one_then_wait(), metadata=(("model", "emb"),))
        assert len((await stream.read()).embeddings) > 0
        stream.cancel()
        for _ in range(50):
            if stream_lines():
                break
            await asyncio.sleep(0.1)
        assert stream_lines() in ([499], [200])  # an idle stream: see the docstring

        async def requests():
            yield pb.RerankStreamRequest(query=QUERY, text=PASSAGES[0])
            sent.set()
            await asyncio.Event().wait()  # never closes its side

        def counted(status: str) -> float:
            try:
                return scrape.value(metrics, "mha_requests_total", protocol="grpc",
                                    endpoint="rerank", status=status)  # fmt: skip
            except KeyError:
                return 0.0

        sent = asyncio.Event()
        call = s.rerank.RerankStream(requests())
        await sent.wait()
        await asyncio.sleep(0.2)  # the server has read the pair
        call.cancel()
        for _ in range(50):
            metrics = (await s.http.get("/metrics")).text
            if counted("499"):
                break
            await asyncio.sleep(0.1)
        assert counted("499") == 1 and counted("200") == 0

        watch = s.health.Watch(health_pb2.HealthCheckRequest(service="tei.v1.Nope"))
        assert (await watch.read()).status == unknown
        watch.cancel()
        watch = s.health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        s.http.app.state.service.draining = True
        assert (await asyncio.wait_for(watch.read(), 5)).status != unknown
        assert await asyncio.wait_for(watch.read(), 5) is grpc.aio.EOF  # the watch has ended
        s.http.app.state.service.draining = False

    serve(dirs_of(models, "rr", "emb"), test)


def test_health_watches_are_capped_and_name_every_tei_service(models):
    """At most a quarter of --max-connections calls may be Watches (they need no key and last
    as long as the client wants); the health service knows each of tei.v1's services."""
    from service.grpc.health import TEI_KINDS

    assert set(TEI_KINDS) == {s.full_name for s in pb.DESCRIPTOR.services_by_name.values()}

    async def test(s: Stubs) -> None:
        first = s.health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await first.read()).status == health_pb2.HealthCheckResponse.SERVING
        second = s.health.Watch(health_pb2.HealthCheckRequest(service=""))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await second.read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()
        check = await s.health.Check(health_pb2.HealthCheckRequest(service=""))
        assert check.status == health_pb2.HealthCheckResponse.SERVING

    serve(dirs_of(models, "emb"), test, max_connections=4)


def test_a_large_embed_all_answer_is_built_off_the_loop_the_same(models, monkeypatch):
    from service.grpc import tei_servicer

    async def test(s: Stubs) -> None:
        inline = await s.embed.EmbedAll(pb.EmbedAllRequest(inputs=PASSAGES[0]))
        monkeypatch.setattr(tei_servicer, "OFFLOAD_VALUES", 0)  # every answer on a thread
        threaded = await s.embed.EmbedAll(pb.EmbedAllRequest(inputs=PASSAGES[0]))
        assert threaded.token_embeddings == inline.token_embeddings

    serve(dirs_of(models, "emb"), test)
