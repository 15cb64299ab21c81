"""Cohere's (and Jina's) rerank API, /v1/rerank and /v2/rerank, on tiny text models built offline:
scores and order equal transformers' sigmoid of the cross-encoder's logit, top_n, documents as
strings and objects (rank_fields), truncation of long pairs, each bad input a 4xx in the
route's error shape, and the unmodified cohere SDK (v1 and v2 clients) against a real server."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

from benchmarks import scrape
from tests.service.test_text_routing import PASSAGES, QUERY, TOL, logits, models, serve
from tests.support import Server, run_server

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

__all__ = ["models"]  # the fixture: three tiny text models (emb, clf, rr) built offline
KEY = "rerank-key"


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x.astype(np.float64)))


def want_scores(models, documents: list[str]) -> np.ndarray:
    rr, rr_dir = models["rr"]
    return sigmoid(logits(rr, rr_dir, [(QUERY, d) for d in documents], pairs=True)[:, 0])


def test_scores_order_top_n_and_documents_equal_transformers(models):
    probs = want_scores(models, PASSAGES)
    order = np.argsort(-probs, kind="stable").tolist()
    objects = [{"text": p, "id": f"doc-{i}", "rank": i} for i, p in enumerate(PASSAGES)]

    async def test(client: httpx.AsyncClient) -> None:
        for path in ("/v1/rerank", "/v2/rerank"):
            got = await client.post(
                path,
                json={"model": "rr", "query": QUERY, "documents": PASSAGES},
                headers={"X-Request-ID": "rerank-1"},
            )
            assert got.status_code == 200, got.text
            body = got.json()
            assert body["id"] == "rerank-1" and body["model"] == "rr"
            assert body["meta"]["api_version"]["version"] == path[2]
            assert [r["index"] for r in body["results"]] == order
            assert all("document" not in r for r in body["results"])
            scores = [r["relevance_score"] for r in body["results"]]
            np.testing.assert_allclose(scores, probs[order], **TOL)
            assert body["usage"]["total_tokens"] > len(PASSAGES) * 3  # [CLS] q [SEP] d [SEP]

        # No model named: the first reranker (the first served model is an embedder).
        # top_n cuts; objects come back whole; return_documents wraps strings as {"text"}.
        top = await client.post(
            "/v1/rerank",
            json={
                "query": QUERY,
                "documents": objects,
                "top_n": 2,
                "return_documents": True,
            },
        )
        assert top.status_code == 200, top.text
        results = top.json()["results"]
        assert [r["index"] for r in results] == order[:2]
        assert [r["document"] for r in results] == [objects[i] for i in order[:2]]
        strings = await client.post(
            "/v1/rerank",
            json={
                "model": "rr",
                "query": QUERY,
                "documents": PASSAGES,
                "return_documents": True,
                "top_n": 50,
            },
        )
        assert [r["document"] for r in strings.json()["results"]] == [
            {"text": PASSAGES[i]} for i in order
        ]
        # What other clients send: vLLM's top_n 0 (all) and truncate_prompt_tokens -1 (the
        # model's maximum), Cohere v2's relevant_spans off, infinity-emb's raw_scores (logits).
        others = await client.post(
            "/v1/rerank",
            json={
                "model": "rr",
                "query": QUERY,
                "documents": PASSAGES,
                "top_n": 0,
                "truncate_prompt_tokens": -1,
                "relevant_spans": {"mode": "disabled"},
                "raw_scores": True,
            },
        )
        assert others.status_code == 200, others.text
        results = others.json()["results"]
        assert [r["index"] for r in results] == order
        rr, rr_dir = models["rr"]
        logit = logits(rr, rr_dir, [(QUERY, p) for p in PASSAGES], pairs=True)[:, 0]
        np.testing.assert_allclose([r["relevance_score"] for r in results], logit[order], **TOL)

    serve([d for _, d in models.values()], test)


def test_rank_fields_score_the_named_fields_as_lines(models):
    documents = [
        {"title": "deep learning", "text": "machine learning"},
        {"title": "x", "text": "cat"},
    ]
    ranked = [f"title: {d['title']}\ntext: {d['text']}" for d in documents]
    probs = want_scores(models, ranked)

    async def test(client: httpx.AsyncClient) -> None:
        got = await client.post(
            "/v1/rerank",
            json={
                "model": "rr",
                "query": QUERY,
                "documents": documents,
                "rank_fields": ["title", "text"],
            },
        )
        assert got.status_code == 200, got.text
        by_index = {r["index"]: r["relevance_score"] for r in got.json()["results"]}
        np.testing.assert_allclose([by_index[0], by_index[1]], probs, **TOL)

    serve([d for _, d in models.values()], test)


def test_a_pair_over_the_maximum_is_truncated_longest_first(models):
    from tokenizers import Tokenizer

    rr, rr_dir = models["rr"]
    long_document = " ".join(["deep learning is machine learning"] * 40)

    async def test(client: httpx.AsyncClient) -> None:
        max_length = (await client.get("/models/rr/info")).json()["max_input_length"]
        tokenizer = Tokenizer.from_file(str(rr_dir / "tokenizer.json"))
        tokenizer.enable_truncation(max_length=max_length)  # longest_first, as Cohere cuts
        enc = tokenizer.encode(QUERY, long_document)
        assert len(enc.ids) == max_length
        ids = torch.tensor([enc.ids])
        with torch.no_grad():
            want = rr(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                token_type_ids=torch.tensor([enc.type_ids]),
            ).logits.numpy()[0]
        got = await client.post(
            "/v1/rerank", json={"model": "rr", "query": QUERY, "documents": [long_document]}
        )
        assert got.status_code == 200, got.text
        body = got.json()
        np.testing.assert_allclose(body["results"][0]["relevance_score"], sigmoid(want)[0], **TOL)
        assert body["usage"]["total_tokens"] == max_length
        # TEI's /rerank, by contrast, refuses it when asked not to truncate.
        tei = await client.post(
            "/models/rr/rerank",
            json={"query": QUERY, "texts": [long_document], "truncate": False},
        )
        assert tei.status_code == 413

    serve([d for _, d in models.values()], test)


def test_max_tokens_per_doc_cuts_each_document_first(models):
    """Cohere's max_tokens_per_doc: every document cut to its first n tokens before it is
    paired with the query; against transformers' logit of exactly those token ids."""
    from tokenizers import Tokenizer

    rr, rr_dir = models["rr"]
    documents = [" ".join(["deep learning is machine learning"] * 9), "paris", PASSAGES[0]]
    tokenizer = Tokenizer.from_file(str(rr_dir / "tokenizer.json"))
    tokenizer.no_truncation()
    query = tokenizer.encode(QUERY, add_special_tokens=False)
    want = []
    for document in documents:
        cut = tokenizer.encode(document, add_special_tokens=False)
        cut.truncate(4)  # ids, types and offsets of its first 4 tokens
        pair = tokenizer.post_process(query, cut)
        ids, types = torch.tensor([pair.ids]), torch.tensor([pair.type_ids])
        with torch.no_grad():
            out = rr(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=types)
        want.append(out.logits.numpy()[0, 0])
    assert len(tokenizer.encode(documents[0]).ids) > 40  # the cut matters

    async def test(client: httpx.AsyncClient) -> None:
        body = {"model": "rr", "query": QUERY, "documents": documents, "raw_scores": True}
        got = await client.post("/v2/rerank", json={**body, "max_tokens_per_doc": 4})
        assert got.status_code == 200, got.text
        scores = {r["index"]: r["relevance_score"] for r in got.json()["results"]}
        np.testing.assert_allclose([scores[i] for i in range(3)], want, **TOL)
        whole = await client.post("/v2/rerank", json={**body, "max_tokens_per_doc": 4096})
        assert whole.json()["results"][0]["relevance_score"] != scores[0]

    serve([d for _, d in models.values()], test)


BAD = [  # (body, status, words in the message)
    ({"model": "nope", "query": "q", "documents": ["a"]}, 404, "unknown model 'nope'"),
    ({"model": "emb", "query": "q", "documents": ["a"]}, 400, "'emb' is an embedding model"),
    ({"model": "clf", "query": "q", "documents": ["a"]}, 400, "'clf' is a classifier model"),
    ({"query": "", "documents": ["a"]}, 400, "'query' is an empty string"),
    ({"query": "q", "documents": []}, 400, "'documents' is an empty list"),
    ({"query": "q", "documents": ["a", ""]}, 400, "documents[1] is an empty text"),
    ({"query": "q", "documents": "a"}, 400, "body.documents"),
    ({"query": "q", "documents": [3]}, 400, "body.documents.0"),
    ({"query": "q", "documents": [{"title": "a"}]}, 400, "documents[0] is an object without"),
    (
        {"query": "q", "documents": [{"text": "a"}], "rank_fields": ["title"]},
        400,
        "documents[0] has no string field(s) ['title']",
    ),
    ({"query": "q", "documents": ["a"], "rank_fields": []}, 400, "'rank_fields' must name"),
    ({"query": "q", "documents": ["a"], "top_n": -1}, 400, "body.top_n"),
    (
        {"query": "q", "documents": ["a"], "relevant_spans": {"mode": "enabled"}},
        400,
        "'relevant_spans' must be absent",
    ),
    (
        {"query": "q", "documents": ["a"], "truncate_prompt_tokens": 4},
        400,
        "'truncate_prompt_tokens' must be at least",
    ),
    ({"query": "q", "documents": ["a"], "top_n": True}, 400, "body.top_n"),
    ({"query": "q", "documents": ["a"], "return_documents": "yes"}, 400, "return_documents"),
    ({"query": "q", "documents": ["a"], "max_chunks_per_doc": 3}, 400, "'max_chunks_per_doc'"),
    ({"query": "q", "documents": ["a"], "max_tokens_per_doc": 0}, 400, "max_tokens_per_doc"),
    ({"query": "q", "documents": ["a"], "temperature": 1}, 400, "temperature"),
    ({"query": "q"}, 400, "body.documents"),
    ({"query": "q", "documents": ["a"] * 9}, 413, "'documents' has 9 items; at most 8"),
    (
        {"query": "q", "documents": ["a", "x" * 3000]},
        413,
        "documents[1] has 3001 characters (with the query it is paired with), over the limit",
    ),
]


def test_bad_requests_are_4xx_in_each_routes_shape_and_the_connection_stays_usable(models):
    async def test(client: httpx.AsyncClient) -> None:
        for body, status, words in BAD:
            for path in ("/v1/rerank", "/v2/rerank"):
                got = await client.post(path, json=body)
                assert got.status_code == status, (path, body, got.text)
                error = got.json()["error"]
                message = error["message"] if path.startswith("/v1") else error
                assert words in message, (path, body, message)
        assert (await client.post("/v1/rerank", content=b"{")).status_code == 400
        ok = await client.post("/v1/rerank", json={"query": "q", "documents": ["a"]})
        assert ok.status_code == 200, ok.text

    dirs = [d for _, d in models.values()]

    async def main() -> None:
        from tests.inprocess import asgi_client

        async with asgi_client(model_dir=dirs, max_queue=8, max_batch_size=8) as client:
            await test(client)

    import asyncio

    asyncio.run(main())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, models) -> Iterator[Server]:
    args = [arg for _, d in models.values() for arg in ("--model-dir", str(d))]
    root = tmp_path_factory.mktemp("rerank-api")
    with run_server(root, *args, env={"MHA_API_KEY": KEY}) as s:
        yield s


def test_the_cohere_sdk_ranks_through_v1_and_v2(server, models):
    cohere = pytest.importorskip("cohere")
    probs = want_scores(models, PASSAGES)
    order = np.argsort(-probs, kind="stable").tolist()

    v1 = cohere.Client(api_key=KEY, base_url=server.url, timeout=60)
    got = v1.rerank(model="rr", query=QUERY, documents=PASSAGES, top_n=2, return_documents=True)
    assert [r.index for r in got.results] == order[:2]
    assert [r.document.text for r in got.results] == [PASSAGES[i] for i in order[:2]]
    np.testing.assert_allclose([r.relevance_score for r in got.results], probs[order[:2]], **TOL)

    v2 = cohere.ClientV2(api_key=KEY, base_url=server.url, timeout=60)
    got = v2.rerank(model="rr", query=QUERY, documents=PASSAGES)
    assert [r.index for r in got.results] == order
    np.testing.assert_allclose([r.relevance_score for r in got.results], probs[order], **TOL)

    with pytest.raises(cohere.errors.NotFoundError):
        v2.rerank(model="nope", query=QUERY, documents=PASSAGES)
    with pytest.raises(cohere.errors.ForbiddenError):
        cohere.ClientV2(api_key="wrong", base_url=server.url).rerank(
            model="rr", query=QUERY, documents=PASSAGES
        )
    # Counted under the reranker that did the work, by the route's endpoint label.
    text = scrape.scrape(server.url)
    assert scrape.value(text, "mha_requests_total", endpoint="rerank_api", model="rr") == 2
    assert scrape.value(text, "mha_requests_total", endpoint="rerank_api", status="404") == 1
