"""Several text models in one server (repeated --model-dir), in process: /v1/embeddings picks
its model by the body's `model`, each TEI route goes to the first model whose head offers it,
numbers equal transformers', and the request metrics carry the model that did the work."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from benchmarks import scrape
from tests.inprocess import asgi_client

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm

QUERY = "what is deep learning"
PASSAGES = ["deep learning is machine learning", "the cat sat on the mat", "paris"]
TOL = {"atol": 1e-5, "rtol": 1.3e-6}  # fp32: engine against transformers


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Served name (its directory's name) -> (transformers model, directory), in serving order:
    an embedder first (the default), then a classifier, then a reranker."""
    root = tmp_path_factory.mktemp("text-routing")
    return {
        "emb": tm.sentence_transformer(root / "emb", pooling="mean", normalize=True),
        "clf": tm.classifier("bert", root / "clf", seed=1),
        "rr": tm.classifier("bert", root / "rr", {0: "score"}, seed=2),
    }


def serve(dirs: list[Path], test) -> None:
    async def main() -> None:
        async with asgi_client(model_dir=dirs) as client:
            await test(client)

    asyncio.run(main())


def mean_pooled(ref, directory: Path, texts: list[str]) -> np.ndarray:
    ids, mask, _ = tm.padded(tm.tokenize(directory, texts))
    with torch.no_grad():
        hidden = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def logits(ref, directory: Path, texts: list, pairs: bool) -> np.ndarray:
    ids, mask, types = tm.padded(tm.tokenize(directory, texts, pairs))
    with torch.no_grad():
        return ref(input_ids=ids, attention_mask=mask, token_type_ids=types).logits.numpy()


def test_each_route_reaches_the_model_that_offers_it(models):
    (emb, emb_dir), (clf, clf_dir), (rr, rr_dir) = models.values()
    vectors = mean_pooled(emb, emb_dir, PASSAGES)
    rerank = logits(rr, rr_dir, [(QUERY, p) for p in PASSAGES], pairs=True)[:, 0]
    rerank = 1 / (1 + np.exp(-rerank.astype(np.float64)))
    predict = logits(clf, clf_dir, ["good movie"], pairs=False)[0].astype(np.float64)
    predict = np.exp(predict - predict.max()) / np.exp(predict - predict.max()).sum()

    async def test(client: httpx.AsyncClient) -> None:
        processed = "mha_sequences_processed_total"
        before = (await client.get("/metrics")).text  # warm-up batches count sequences too
        warm = {m: scrape.value(before, processed, model=m) for m in ("emb", "clf", "rr")}
        listed = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["emb"]  # what /v1/embeddings accepts
        classifier = await client.get("/v1/models/clf")
        assert classifier.status_code == 404
        assert "embedding models are 'emb'" in classifier.json()["error"]["message"]

        v1 = await client.post("/v1/embeddings", json={"model": "emb", "input": PASSAGES})
        assert v1.status_code == 200, v1.text
        assert v1.json()["model"] == "emb"
        np.testing.assert_allclose([d["embedding"] for d in v1.json()["data"]], vectors, **TOL)
        for name, kind in (("rr", "reranker"), ("clf", "classifier")):
            wrong = await client.post("/v1/embeddings", json={"model": name, "input": "a"})
            assert wrong.status_code == 400, wrong.text
            error = wrong.json()["error"]
            assert f"model '{name}' is a {kind}" in error["message"]
            assert error["param"] == "model"
        unknown = await client.post("/v1/embeddings", json={"model": "gpt-4", "input": "a"})
        assert unknown.status_code == 404
        message = unknown.json()["error"]["message"]
        assert "unknown model 'gpt-4'" in message
        assert "'emb' (embedding), 'clf' (classifier), 'rr' (reranker)" in message

        embed = await client.post("/embed", json={"inputs": PASSAGES})
        assert embed.status_code == 200, embed.text
        np.testing.assert_allclose(embed.json(), vectors, **TOL)

        ranks = await client.post("/rerank", json={"query": QUERY, "texts": PASSAGES})
        assert ranks.status_code == 200, ranks.text
        order = np.argsort(-rerank)
        assert [r["index"] for r in ranks.json()] == order.tolist()
        np.testing.assert_allclose([r["score"] for r in ranks.json()], rerank[order], **TOL)

        predicted = await client.post("/predict", json={"inputs": "good movie"})
        assert predicted.status_code == 200, predicted.text
        order = np.argsort(-predict)
        assert [p["label"] for p in predicted.json()] == [tm.LABELS3[i] for i in order]
        np.testing.assert_allclose([p["score"] for p in predicted.json()], predict[order], **TOL)

        info = (await client.get("/info")).json()
        assert info["model_id"] == "emb" and "embedding" in info["model_type"]

        exposition = (await client.get("/metrics")).text
        for endpoint, model in (
            ("embeddings", "emb"),
            ("embed", "emb"),
            ("rerank", "rr"),
            ("predict", "clf"),
        ):
            labels = {"endpoint": endpoint, "status": "200", "protocol": "http"}
            assert scrape.value(exposition, "mha_requests_total", model=model, **labels) == 1
            others = {"emb", "clf", "rr"} - {model}
            assert all(
                scrape.value(exposition, "mha_requests_total", 0.0, model=o, **labels) == 0
                for o in others
            ), (endpoint, model)
        done = {m: scrape.value(exposition, processed, model=m) - warm[m] for m in warm}
        assert done == {"emb": 2 * len(PASSAGES), "clf": 1, "rr": len(PASSAGES)}

    serve([emb_dir, clf_dir, rr_dir], test)


def test_a_route_no_served_model_offers_is_424_naming_every_kind(models):
    (_, emb_dir), (_, clf_dir), (_, rr_dir) = models.values()

    async def test(client: httpx.AsyncClient) -> None:
        # The reranker answers /predict (pairs scored with its one label)...
        pair = await client.post("/predict", json={"inputs": [QUERY, PASSAGES[0]]})
        assert pair.status_code == 200, pair.text
        assert pair.json()[0]["label"] == "score"
        # ... /rerank and /embed each find their model, whatever the order.
        assert (await client.post("/embed", json={"inputs": "a"})).status_code == 200
        # /info and /tokenize use the default (first) text model: here the reranker.
        assert (await client.get("/info")).json()["model_id"] == "rr"

    serve([rr_dir, emb_dir], test)

    async def no_embedder(client: httpx.AsyncClient) -> None:
        wrong = await client.post("/embed", json={"inputs": "a"})
        assert wrong.status_code == 424
        assert wrong.json()["error"] == (
            "/embed needs an embedding model; 'clf' is a classifier model, which offers "
            "/predict; 'rr' is a reranker model, which offers /rerank, /predict"
        )

    serve([clf_dir, rr_dir], no_embedder)
