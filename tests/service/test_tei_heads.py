"""TEI's routes on tiny sequence-classification and sentence-transformers models built offline
(tests/text_models.py), in process: /rerank and /predict equal transformers' logits through the
batcher, /embed_all and /embed with prompts and last-token pooling, /info and v2 metadata, the
424 for a route the model's head does not offer, and every bad input with status and message."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from benchmarks import scrape
from service.runtime.repository import ModelSource, model_settings
from service.runtime.settings import Settings
from tests.inprocess import asgi_client

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm

NAME = "tiny"
QUERY = "what is deep learning"
PASSAGES = ["deep learning is machine learning", "the cat sat on the mat", "paris", "rain"]
TOL = {"atol": 1e-5, "rtol": 1.3e-6}  # fp32: engine against transformers


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """name -> (transformers model, directory) for every family and head the tests use."""
    root = tmp_path_factory.mktemp("text-heads")
    built = {}
    for family in ("bert", "xlm-roberta", "mpnet", "modernbert", "nomic_bert", "gte"):
        built[f"{family}-reranker"] = tm.classifier(family, root / f"{family}-r", {0: "score"})
    for family in ("bert", "roberta", "distilbert"):
        built[f"{family}-classifier"] = tm.classifier(family, root / f"{family}-c", seed=1)
    prompts = {"query": "query: ", "passage": "passage: "}
    built["embedder"] = tm.sentence_transformer(
        root / "embedder", pooling="last_token", normalize=True, prompts=prompts
    )
    return built


def serve(directory: Path, test, **settings: object) -> None:
    """Run `test(client)` against the real app of `directory`, in process."""

    async def main() -> None:
        async with asgi_client(model_dir=directory, model_name=NAME, **settings) as client:
            await test(client)

    asyncio.run(main())


def transformers_logits(ref, directory: Path, texts: list, pairs: bool) -> np.ndarray:
    encoded = tm.tokenize(directory, texts, pairs)
    ids, mask, types = tm.padded(encoded)
    typed = ref.config.model_type in ("bert", "nomic_bert")  # pairs' second segment: type 1
    kwargs = {"token_type_ids": types} if typed else {}
    with torch.no_grad():
        return ref(input_ids=ids, attention_mask=mask, **kwargs).logits.numpy()


@pytest.mark.parametrize(
    "family", ["bert", "xlm-roberta", "mpnet", "modernbert", "nomic_bert", "gte"]
)
def test_rerank_equals_transformers(models, family):
    ref, path = models[f"{family}-reranker"]
    logits = transformers_logits(ref, path, [(QUERY, p) for p in PASSAGES], pairs=True)[:, 0]
    probs = 1 / (1 + np.exp(-logits.astype(np.float64)))
    order = np.argsort(-probs)

    async def test(client: httpx.AsyncClient) -> None:
        got = await client.post("/rerank", json={"query": QUERY, "texts": PASSAGES})
        assert got.status_code == 200, got.text
        ranks = got.json()
        assert [r["index"] for r in ranks] == order.tolist()
        assert all("text" not in r for r in ranks)
        np.testing.assert_allclose([r["score"] for r in ranks], probs[order], **TOL)
        body = {"query": QUERY, "texts": PASSAGES, "raw_scores": True, "return_text": True}
        raw = (await client.post("/rerank", json=body)).json()
        np.testing.assert_allclose([r["score"] for r in raw], logits[order], **TOL)
        assert [r["text"] for r in raw] == [PASSAGES[i] for i in order]
        # A reranker answers /predict for pairs too: one "score" label, sigmoid.
        pair = (await client.post("/predict", json={"inputs": [QUERY, PASSAGES[0]]})).json()
        assert pair[0]["label"] == "score"
        np.testing.assert_allclose(pair[0]["score"], probs[0], **TOL)
        info = (await client.get("/info")).json()
        assert info["model_type"] == {
            "reranker": {"id2label": {"0": "score"}, "label2id": {"score": 0}, "problem_type": None}
        }

    serve(path, test)


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_predict_single_pair_and_batch_equal_transformers(models, family):
    ref, path = models[f"{family}-classifier"]
    singles = ["good movie", "terrible weather"]
    pair = ("what is the capital of france", "paris")
    want_single = transformers_logits(ref, path, singles, pairs=False)
    want_pair = transformers_logits(ref, path, [pair], pairs=True)[0]

    def softmax(x: np.ndarray) -> np.ndarray:
        e = np.exp(x - x.max())
        return e / e.sum()

    def check(predictions: list[dict], logits: np.ndarray, raw: bool = False) -> None:
        scores = logits if raw else softmax(logits.astype(np.float64))
        order = np.argsort(-scores)
        assert [p["label"] for p in predictions] == [tm.LABELS3[i] for i in order]
        np.testing.assert_allclose([p["score"] for p in predictions], scores[order], **TOL)

    async def test(client: httpx.AsyncClient) -> None:
        one = await client.post("/predict", json={"inputs": singles[0]})
        assert one.status_code == 200, one.text
        check(one.json(), want_single[0])
        check((await client.post("/predict", json={"inputs": list(pair)})).json(), want_pair)
        batch = {"inputs": [[singles[0]], list(pair), [singles[1]]], "raw_scores": True}
        got = (await client.post("/predict", json=batch)).json()
        assert len(got) == 3
        for predictions, logits in zip(
            got, [want_single[0], want_pair, want_single[1]], strict=True
        ):
            check(predictions, logits, raw=True)
        info = (await client.get("/info")).json()["model_type"]["classifier"]
        assert info["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
        assert info["label2id"] == {"negative": 0, "neutral": 1, "positive": 2}
        meta = (await client.get(f"/v2/models/{NAME}")).json()["properties"]
        assert meta["task"] == "classifier" and '"2": "positive"' in meta["id2label"]

    serve(path, test)


def test_routes_follow_the_models_head(models):
    _, classifier = models["bert-classifier"]

    async def test(client: httpx.AsyncClient) -> None:
        for path, body in (
            ("/embed", {"inputs": "a"}),
            ("/embed_all", {"inputs": "a"}),
            ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
            ("/rerank", {"query": "a", "texts": ["b"]}),
        ):
            response = await client.post(path, json=body)
            assert response.status_code == 424, (path, response.text)
            error = response.json()
            assert error["error_type"] == "Backend"
            assert f"'{NAME}' is a classifier model, which offers /predict" in error["error"]
        v1 = await client.post("/v1/embeddings", json={"model": NAME, "input": "a"})
        assert v1.status_code == 400
        message = v1.json()["error"]["message"]
        assert f"'{NAME}' is a classifier model, not an embedding model: use /predict" in message

    serve(classifier, test)


BAD = [
    ("/predict", {"inputs": ["a"]}, 400, "a list of 1 strings; a list of strings must be one pair"),
    ("/predict", {"inputs": ["a", "b", "c"]}, 400, "a list of 3 strings"),
    ("/predict", {"inputs": [["a", "b", "c"]]}, 400, "inputs[0] must be [text] or [a, b]"),
    ("/predict", {"inputs": []}, 400, "'inputs' is an empty list"),
    ("/predict", {"inputs": [["a", ""]]}, 400, "inputs[0] holds an empty string"),
    ("/predict", {"inputs": [["a"]] * 33}, 413, "'inputs' has 33 items; at most 32"),
    ("/predict", {"inputs": "a", "top_k": 1}, 400, "top_k"),
    ("/rerank", {"query": "a", "texts": []}, 400, "'texts' is an empty list"),
    ("/rerank", {"query": "", "texts": ["b"]}, 400, "'query' is an empty string"),
    ("/rerank", {"query": "a", "texts": ["b", ""]}, 400, "texts[1] holds an empty string"),
    ("/rerank", {"query": "a", "texts": ["b"] * 33}, 413, "'texts' has 33 items; at most 32"),
    ("/rerank", {"texts": ["b"]}, 400, "query"),
    ("/rerank", {"query": "a", "texts": "b"}, 400, "texts"),
    ("/rerank", {"query": "a", "texts": ["b"], "truncation_direction": "Up"}, 400, "'Left'"),
    ("/rerank", {"query": "a " * 30, "texts": ["b " * 30], "truncate": False}, 413,
     "texts[0] is longer than the model's 40 tokens; send less text or set 'truncate': true"),
    ("/rerank", {"query": "a", "texts": ["x" * 3000]}, 413, "(--max-input-chars)"),
]  # fmt: skip


def test_bad_input_on_rerank_and_predict(models):
    _, reranker = models["bert-reranker"]

    async def test(client: httpx.AsyncClient) -> None:
        for path, body, status, words in BAD:
            response = await client.post(path, json=body)
            assert response.status_code == status, (path, body, response.text)
            assert words in response.json()["error"], (path, response.text)
            assert response.json()["error_type"] == "Validation"
        # Truncated instead of refused when asked, from either side.
        for side in ("Right", "Left"):
            long = {"query": "a " * 30, "texts": ["b " * 30], "truncate": True}
            ok = await client.post("/rerank", json={**long, "truncation_direction": side})
            assert ok.status_code == 200, ok.text
        assert (await client.post("/rerank", json={"query": "a", "texts": ["b"]})).is_success

    serve(reranker, test, max_input_chars=2000)


def test_client_batch_size_and_auto_truncate_follow_the_flags(models):
    """--max-client-batch-size bounds every TEI route and shows in /info; --auto-truncate (on
    by default, as TEI's) cuts over-long inputs of requests that do not set 'truncate', a
    request that sets it still decides, and --no-auto-truncate refuses them."""
    _, reranker = models["bert-reranker"]
    long = {"query": "a " * 30, "texts": ["b " * 30]}

    async def flagged(client: httpx.AsyncClient) -> None:
        info = (await client.get("/info")).json()
        assert (info["max_client_batch_size"], info["auto_truncate"]) == (3, True)
        for path, body, field in (
            ("/rerank", {"query": "a", "texts": ["b"] * 4}, "texts"),
            ("/predict", {"inputs": [["a"]] * 4}, "inputs"),
            ("/tokenize", {"inputs": ["a"] * 4}, "inputs"),
            ("/decode", {"ids": [[5]] * 4}, "ids"),
        ):
            got = await client.post(path, json=body)
            assert got.status_code == 413, (path, got.text)
            assert f"'{field}' has 4 items; at most 3 per request" in got.json()["error"]
        ok = await client.post("/rerank", json={"query": "a", "texts": ["b"] * 3})
        assert ok.status_code == 200, ok.text
        cut = await client.post("/rerank", json=long)
        asked = await client.post("/rerank", json={**long, "truncate": True})
        assert cut.status_code == asked.status_code == 200, cut.text
        assert cut.json() == asked.json()
        refused = await client.post("/rerank", json={**long, "truncate": False})
        assert refused.status_code == 413, refused.text

    async def disabled(client: httpx.AsyncClient) -> None:
        info = (await client.get("/info")).json()
        assert (info["max_client_batch_size"], info["auto_truncate"]) == (32, False)
        refused = await client.post("/rerank", json=long)
        assert refused.status_code == 413
        assert "(the server runs with --no-auto-truncate)" in refused.json()["error"]

    serve(reranker, flagged, max_client_batch_size=3)
    serve(reranker, disabled, auto_truncate=False)
    # A model's own settings with a queue shorter than the default bound still load (a
    # request with more inputs than the queue gets 429, as before the flag).
    small = ModelSource("m", None, overrides={"max_queue": 16, "max_batch_size": 8})
    chosen = model_settings(Settings(), small)
    assert (chosen.max_queue, chosen.max_client_batch_size) == (16, 32)


def test_rerank_is_batched_invariant_and_counted(models):
    """Concurrent requests share engine calls; each gets the numbers it gets alone."""
    _, reranker = models["bert-reranker"]

    async def test(client: httpx.AsyncClient) -> None:
        bodies = [{"query": QUERY, "texts": PASSAGES[i:] + PASSAGES[:i]} for i in range(4)]
        alone = [(await client.post("/rerank", json=b)).json() for b in bodies]
        metrics = client.app.state.service.metrics  # type: ignore[attr-defined]
        ok = metrics.batches.labels(model=NAME, version="1", outcome="ok")
        batches = ok._value.get()
        together = await asyncio.gather(*(client.post("/rerank", json=b) for b in bodies))
        assert ok._value.get() - batches < len(bodies)
        for got, want in zip(together, alone, strict=True):
            assert [r["index"] for r in got.json()] == [r["index"] for r in want]
            np.testing.assert_allclose(
                [r["score"] for r in got.json()], [r["score"] for r in want], **TOL
            )
        exposition = (await client.get("/metrics")).text
        labels = {"endpoint": "rerank", "model": NAME, "status": "200", "protocol": "http"}
        assert scrape.value(exposition, "mha_requests_total", **labels) >= len(bodies)

    serve(reranker, test, max_batch_delay_ms=50)


def test_queue_bound_is_429_for_rerank_predict_and_tokenize(models):
    _, reranker = models["bert-reranker"]

    async def test(client: httpx.AsyncClient) -> None:
        for path, body in (
            ("/rerank", {"query": "a", "texts": ["b"] * 5}),
            ("/predict", {"inputs": [["a"]] * 5}),
            ("/tokenize", {"inputs": ["a"] * 5}),  # tokenizing is queued work too
        ):
            response = await client.post(path, json=body)
            assert response.status_code == 429, response.text
            assert response.json()["error_type"] == "Overloaded"

    serve(reranker, test, max_queue=4, max_batch_size=4)


def test_embed_prompts_last_token_pooling_and_embed_all(models):
    ref, path = models["embedder"]
    texts = ["what is deep learning", "paris"]

    def reference(texts: list[str]) -> tuple[np.ndarray, list[np.ndarray]]:
        encoded = tm.tokenize(path, texts)
        ids, mask, _ = tm.padded(encoded)
        with torch.no_grad():
            hidden = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(texts)), mask.sum(1) - 1]
        vectors = torch.nn.functional.normalize(last, dim=-1).numpy()
        return vectors, [h[: len(e[0])].numpy() for h, e in zip(hidden, encoded, strict=True)]

    async def test(client: httpx.AsyncClient) -> None:
        info = (await client.get("/info")).json()
        assert info["model_type"] == {"embedding": {"pooling": "last_token"}}
        assert info["prompts"] == {"query": "query: ", "passage": "passage: "}
        plain = await client.post("/embed", json={"inputs": texts})
        assert plain.status_code == 200, plain.text
        vectors, states = reference(texts)
        np.testing.assert_allclose(plain.json(), vectors, **TOL)
        prompted = await client.post("/embed", json={"inputs": texts, "prompt_name": "query"})
        want, _ = reference([f"query: {t}" for t in texts])
        np.testing.assert_allclose(prompted.json(), want, **TOL)
        unknown = await client.post("/embed", json={"inputs": texts, "prompt_name": "doc"})
        assert unknown.status_code == 400
        assert (
            "unknown prompt_name 'doc'; this model's prompts: ['passage', 'query']"
            in (unknown.json()["error"])
        )
        all_states = (await client.post("/embed_all", json={"inputs": texts})).json()
        for got, want_states in zip(all_states, states, strict=True):
            np.testing.assert_allclose(got, want_states, **TOL)
        tokens = await client.post("/tokenize", json={"inputs": "paris", "prompt_name": "query"})
        assert [t["text"] for t in tokens.json()[0]] == ["[CLS]", "query", ":", "paris", "[SEP]"]
        for path_, body in (
            ("/predict", {"inputs": "a"}),
            ("/rerank", {"query": "a", "texts": ["b"]}),
        ):
            wrong = await client.post(path_, json=body)
            assert wrong.status_code == 424
            assert f"'{NAME}' is an embedding model, which offers /embed" in wrong.json()["error"]

    serve(path, test)


def test_huggingface_hub_inference_client(models, tmp_path, monkeypatch):
    """The unmodified client on a real server: text_classification (POST /) on a classifier,
    feature_extraction (POST /) on an embedding model. huggingface_hub 2.4.0 has no rerank
    method (and get_endpoint_info refuses a base_url), so /rerank and /info are checked above
    over HTTP."""
    hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    from tests.support import run_server

    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)  # 127.0.0.1 only
    ref, classifier = models["roberta-classifier"]
    want = transformers_logits(ref, classifier, ["good movie"], pairs=False)[0]
    probs = np.exp(want - want.max()) / np.exp(want - want.max()).sum()
    with run_server(tmp_path, "--model-dir", str(classifier), "--model-name", NAME) as server:
        client = hub.InferenceClient(base_url=server.url)
        got = client.text_classification("good movie")
        assert [g.label for g in got] == [tm.LABELS3[i] for i in np.argsort(-probs)]
        np.testing.assert_allclose([g.score for g in got], np.sort(probs)[::-1], **TOL)
        top = client.text_classification("good movie", top_k=1, function_to_apply="sigmoid")
        assert len(top) == 1 and top[0].score == pytest.approx(1 / (1 + np.exp(-want.max())))
    _, embedder = models["embedder"]
    with run_server(tmp_path, "--model-dir", str(embedder), "--model-name", NAME) as server:
        client = hub.InferenceClient(base_url=server.url)
        got = np.asarray(client.feature_extraction("paris"))
        want = httpx.post(f"{server.url}/embed", json={"inputs": "paris"}, timeout=30).json()
        np.testing.assert_allclose(got.reshape(1, -1), want, **TOL)


def test_openapi_documents_the_text_routes(models):
    """TEI's error shape (with its 424) on the new routes; every $ref resolves in the document."""
    _, reranker = models["bert-reranker"]

    async def test(client: httpx.AsyncClient) -> None:
        spec = (await client.get("/openapi.json")).json()
        for path in ("/rerank", "/predict", "/embed_all", "/embed", "/"):
            responses = spec["paths"][path]["post"]["responses"]
            error = responses["424"]["content"]["application/json"]["schema"]
            assert error["required"] == ["error", "error_type"], path
        assert "$defs" not in str(spec)
        rerank = spec["paths"]["/rerank"]["post"]["requestBody"]["content"]["application/json"]
        bodies = rerank["schema"]["anyOf"]  # TEI's body and infinity-emb's, inline
        assert [sorted(b["required"]) for b in bodies] == [
            ["query", "texts"], ["documents", "query"]
        ]  # fmt: skip

    serve(reranker, test)


def test_deadline_is_504_for_rerank_and_predict(models):
    """A request whose deadline (--request-timeout-s) passes before its work runs is never
    computed: 504 in TEI's shape."""
    _, reranker = models["bert-reranker"]

    async def test(client: httpx.AsyncClient) -> None:
        for path, body in (
            ("/rerank", {"query": "a", "texts": ["b", "c"]}),
            ("/predict", {"inputs": ["a", "b"]}),
        ):
            response = await client.post(path, json=body)
            assert response.status_code == 504, response.text
            assert "deadline" in response.json()["error"]
            assert response.json()["error_type"] == "Backend"

    serve(reranker, test, request_timeout_s=1e-6)
