"""infinity-emb's routes, called by infinity's own generated client (`infinity_client`,
unmodified) against the app in process: an embedder, a classifier and a reranker served
together; embeddings, rerank and classify equal transformers' numbers, /models and /health
parse as infinity's types, and the refusals are OpenAI-shaped 400s naming the problem."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import numpy as np
import pytest

from benchmarks import scrape
from tests.inprocess import asgi_client

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("infinity_client", reason="the test command installs it (--no-deps)")
from infinity_client import Client
from infinity_client.api.default import classify, embeddings, health, rerank
from infinity_client.api.default import models as models_api
from infinity_client.models import ClassifyInput, OpenAIEmbeddingInputText, RerankInput

from tests import text_models as tm
from tests.service.test_text_routing import PASSAGES, QUERY, TOL, logits, mean_pooled
from tests.service.test_text_routing import models as models  # a fixture: emb, clf, rr


def serve(dirs, test: Callable) -> None:
    async def main() -> None:
        async with asgi_client(model_dir=dirs) as http:
            transport = httpx.ASGITransport(app=http.app)
            client = Client(
                base_url="http://test",
                httpx_args={"transport": transport},
                raise_on_unexpected_status=True,
            )
            await test(client, http)

    asyncio.run(main())


def test_infinitys_client_embeds_reranks_and_classifies(models) -> None:
    (emb, emb_dir), (clf, clf_dir), (rr, rr_dir) = models.values()
    vectors = mean_pooled(emb, emb_dir, PASSAGES)
    rr_logits = logits(rr, rr_dir, [(QUERY, p) for p in PASSAGES], pairs=True)[:, 0]
    relevance = 1 / (1 + np.exp(-rr_logits.astype(np.float64)))
    clf_logits = logits(clf, clf_dir, ["good movie", "bad film"], pairs=False).astype(np.float64)
    softmax = np.exp(clf_logits) / np.exp(clf_logits).sum(1, keepdims=True)

    async def test(client: Client, http: httpx.AsyncClient) -> None:
        body = OpenAIEmbeddingInputText(input_=PASSAGES)  # model "default/not-specified"
        answer = await embeddings.asyncio(client=client, body=body)
        got = np.array([d.embedding for d in answer.data], np.float32)
        np.testing.assert_allclose(got, vectors, **TOL)
        assert answer.model == "emb" and answer.usage.prompt_tokens > 0

        body = RerankInput(query=QUERY, documents=PASSAGES, return_documents=True, top_n=2)
        ranked = await rerank.asyncio(client=client, body=body)
        order = np.argsort(-relevance, kind="stable")[:2]
        assert [r.index for r in ranked.results] == order.tolist()
        assert [r.document for r in ranked.results] == [PASSAGES[i] for i in order]
        np.testing.assert_allclose(
            [r.relevance_score for r in ranked.results], relevance[order], atol=1e-6
        )
        assert ranked.object_ == "rerank" and ranked.model == "rr"
        tei = await http.post("/rerank", json={"query": QUERY, "texts": PASSAGES})
        full = np.argsort(-relevance, kind="stable").tolist()
        assert [r["index"] for r in tei.json()] == full  # TEI's body: TEI's answer
        body = RerankInput(query=QUERY, documents=PASSAGES, raw_scores=True)
        raw = await rerank.asyncio(client=client, body=body)  # no documents, every result
        assert [r.document for r in raw.results] == [None] * len(PASSAGES)
        np.testing.assert_allclose(
            [r.relevance_score for r in raw.results], rr_logits[full], atol=1e-5
        )
        mounted = await http.post("/models/rr/rerank", json=body.to_dict())
        assert [r["index"] for r in mounted.json()["results"]] == full
        clash = await http.post("/models/rr/rerank", json={**body.to_dict(), "model": "clf"})
        assert clash.status_code == 400 and "the path names model 'rr'" in clash.json()["error"]
        text = (await http.get("/metrics")).text
        assert (
            scrape.value(text, "mha_requests_total", endpoint="rerank", model="rr", status="200")
            >= 3
        )

        many = await http.post("/classify", json={"input": ["good movie"] * 40})
        assert many.status_code == 200 and len(many.json()["data"]) == 40  # past TEI's 32
        body = ClassifyInput(input_=["good movie", "bad film"])
        labelled = await classify.asyncio(client=client, body=body)
        labels = clf.config.id2label
        for row, want in zip(labelled.data, softmax, strict=True):
            best = np.argsort(-want, kind="stable")
            assert [c.label for c in row] == [labels[int(i)] for i in best]
            np.testing.assert_allclose([c.score for c in row], want[best], atol=1e-6)

        listed = await models_api.asyncio(client=client)
        capabilities = {m.id: m.capabilities for m in listed.data}
        assert capabilities == {"emb": ["embed"], "clf": ["classify"], "rr": ["rerank", "classify"]}
        alive = await health.asyncio(client=client)
        assert alive.additional_properties["unix"] > 0

    serve([d for _, d in models.values()], test)


def test_infinitys_refusals_are_openai_shaped(models) -> None:
    async def test(client: Client, http: httpx.AsyncClient) -> None:
        image = await http.post("/embeddings", json={"input": ["x"], "modality": "image"})
        assert image.status_code == 400
        assert "only text models" in image.json()["error"]["message"]
        wrong = await http.post("/classify", json={"input": ["x"], "model": "emb"})
        assert wrong.status_code == 400
        assert "'emb' is not a classifier or reranker model" in wrong.json()["error"]["message"]
        bare = await http.post("/classify", json={"input": "a string"})  # infinity: a list
        assert bare.status_code == 400 and bare.json()["error"]["type"] == "invalid_request_error"
        empty = await http.post("/embeddings", json={"input": [""]})
        assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]
        named = await http.post(
            "/embeddings", json={"input": ["x"], "model": "emb", "dimensions": 0}
        )
        assert named.status_code == 200, named.text

    serve([d for _, d in models.values()], test)


def test_an_infinity_rerank_without_a_reranker_is_teis_424(models) -> None:
    async def test(client: Client, http: httpx.AsyncClient) -> None:
        answer = await http.post("/rerank", json={"query": "q", "documents": ["a"]})
        assert answer.status_code == 424 and answer.json()["error_type"] == "Backend"

    serve([models["emb"][1]], test)


def test_several_embedders_need_a_name(tmp_path) -> None:
    dirs = [tm.sentence_transformer(tmp_path / n)[1] for n in ("one", "two")]

    async def test(client: Client, http: httpx.AsyncClient) -> None:
        unnamed = await http.post("/embeddings", json={"input": ["x"]})
        assert unnamed.status_code == 400
        message = unnamed.json()["error"]["message"]
        assert "name an embedding model: 'one', 'two'" in message
        named = await http.post("/embeddings", json={"input": ["x"], "model": "two"})
        assert named.status_code == 200 and named.json()["model"] == "two"

    serve(dirs, test)
