"""TEI's /embed_sparse for a SPLADE model (sentence-transformers' SparseEncoder directory): the
non-zero weights, by vocabulary index, equal transformers' `...ForMaskedLM` through SPLADE's
pooling; the routes a sparse model offers and refuses; served beside an embedding model; with
the response cache. The real app in process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests import text_models as tm
from tests.inprocess import asgi_client
from tests.support import FP32_TOL, run_server, validate_oip

TEXTS = ["the cat sat on the mat", "what is deep learning?", "hello world"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("sparse")
    reference, sparse = tm.splade(root / "sp")
    _, embedder = tm.sentence_transformer(root / "emb")
    yield {"reference": reference, "sp": sparse, "emb": embedder}


def run(models: dict, test, **settings: object) -> None:
    async def main() -> None:
        dirs = [models["sp"], models["emb"]]
        async with asgi_client(model_dir=dirs, max_batch_delay_ms=0, **settings) as client:
            await test(client)

    asyncio.run(main())


def _dense(entries: list[dict], size: int) -> torch.Tensor:
    row = torch.zeros(size)
    for entry in entries:
        row[entry["index"]] = entry["value"]
    return row


def test_sparse_weights_equal_transformers_splade(models) -> None:
    reference = models["reference"]
    want = tm.splade_reference(reference, tm.tokenize(models["sp"], TEXTS))

    async def check(client: httpx.AsyncClient) -> None:
        response = await client.post("/embed_sparse", json={"inputs": TEXTS})
        assert response.status_code == 200, response.text
        answer = response.json()
        assert len(answer) == len(TEXTS)
        for entries, expected in zip(answer, want, strict=True):
            indices = [e["index"] for e in entries]
            assert indices == sorted(indices) and all(e["value"] > 0 for e in entries)
            assert indices == torch.nonzero(expected).flatten().tolist()
            got = _dense(entries, reference.config.vocab_size)
            torch.testing.assert_close(got, expected, **FP32_TOL)
        one = await client.post("/embed_sparse", json={"inputs": TEXTS[0]})  # a string
        assert one.json() == answer[:1]

    run(models, check)


def test_routes_a_sparse_model_offers_and_refuses(models) -> None:
    async def check(client: httpx.AsyncClient) -> None:
        info = (await client.get("/models/sp/info")).json()
        assert info["model_type"] == {"embedding": {"pooling": "splade"}}
        sparse = (await client.post("/embed_sparse", json={"inputs": "hello"})).json()
        # TEI's POST / and SageMaker's /invocations answer as /embed_sparse for this model
        for path in ("/models/sp", "/models/sp/invocations"):
            response = await client.post(path, json={"inputs": "hello"})
            assert response.status_code == 200 and response.json() == sparse, response.text
        # /embed goes to the embedding model beside it; named, the sparse one is refused
        assert (await client.post("/embed", json={"inputs": "hello"})).status_code == 200
        refused = await client.post("/models/sp/embed", json={"inputs": "hello"})
        assert refused.status_code == 424, refused.text
        assert "'sp' is a sparse model, which offers /embed_sparse" in refused.json()["error"]
        for path in ("/models/emb/embed_sparse", "/embed_sparse"):
            body = {"inputs": "hello"} if path.startswith("/models") else {"inputs": []}
            wrong = await client.post(path, json=body)
            assert wrong.status_code in (400, 424), wrong.text
            assert set(wrong.json()) == {"error", "error_type"}  # TEI's error shape
        wrong = await client.post("/models/emb/embed_sparse", json={"inputs": "hello"})
        assert wrong.status_code == 424
        assert "/embed_sparse needs a sparse model" in wrong.json()["error"]
        openai = await client.post("/v1/embeddings", json={"input": "hello", "model": "sp"})
        assert openai.status_code == 400, openai.text
        assert "'sp' is a sparse model" in openai.text and "/embed_sparse" in openai.text
        models_listed = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        assert "sp" not in models_listed and "emb" in models_listed
        for bad, says in (
            ({"inputs": []}, "at least one"),
            ({"inputs": ["ok", ""]}, "empty string"),
            ({"inputs": "x", "normalize": True}, "normalize"),
        ):
            response = await client.post("/embed_sparse", json=bad)
            assert response.status_code in (400, 422), (bad, response.text)
            assert says in response.text, (bad, response.text)
        metadata = (await client.get("/v2/models/sp")).json()
        validate_oip("metadata_model_response", metadata)

    run(models, check)


def test_sparse_answers_are_cached_exactly(models) -> None:
    texts = {"inputs": ["the cat sat on the mat", "hello world", "the cat sat on the mat"]}

    async def cached(client: httpx.AsyncClient) -> None:
        first = (await client.post("/embed_sparse", json=texts)).json()
        again = (await client.post("/embed_sparse", json=texts)).json()
        plain = run_plain()
        assert first == again == plain
        assert first[0] == first[2]
        metrics = (await client.get("/metrics")).text
        hits = [line for line in metrics.splitlines()
                if line.startswith("mha_response_cache_lookups_total{") and 'model="sp"' in line
                and 'result="hit"' in line]  # fmt: skip
        assert hits and float(hits[0].split()[-1]) == 4  # the repeat, then all three

    def run_plain() -> list:
        answers: list = []

        async def plain(client: httpx.AsyncClient) -> None:
            answers.append((await client.post("/embed_sparse", json=texts)).json())

        thread = threading.Thread(target=run, args=(models, plain))
        thread.start()
        thread.join()
        return answers[0]

    run(models, cached, response_cache_bytes=1 << 20)


def test_the_weights_array_is_what_the_engine_gives(models) -> None:
    """The runner's structured arrays: index order, every non-zero weight, float32 values."""
    import mha_engine
    from service.oip.inputs import Payload
    from service.text.tokenizer import SPARSE, sparse_runner

    model = mha_engine.load_model(models["sp"])
    ids = [ids.numpy() for ids, _ in tm.tokenize(models["sp"], TEXTS)]
    payloads = [Payload(np.concatenate(ids[:2]), [len(i) for i in ids[:2]], datatype="INT64"),
                Payload(ids[2], [len(ids[2])], datatype="INT64")]  # fmt: skip
    rows = [row for part in sparse_runner(model, payloads) for row in part]
    dense = model.sparse_embed_varlen([torch.from_numpy(i) for i in ids])
    for row, want in zip(rows, dense, strict=True):
        assert row.dtype == SPARSE
        assert row["index"].tolist() == torch.nonzero(want).flatten().tolist()
        assert np.array_equal(row["value"], want[want > 0].numpy())


def test_workers_serve_sparse_embeddings(models, tmp_path: Path) -> None:
    """With --workers 2 the front-ends tokenize and the engine process runs the model: the same
    answer as one process gives."""
    body = {"inputs": TEXTS}
    with run_server(tmp_path, "--model-dir", str(models["sp"]), "--workers", "2") as server:
        served = httpx.post(f"{server.url}/embed_sparse", json=body, timeout=30)
        info = httpx.get(f"{server.url}/info", timeout=10).json()
    assert served.status_code == 200, served.text
    assert info["model_type"] == {"embedding": {"pooling": "splade"}}
    answers: list = []

    async def one(client: httpx.AsyncClient) -> None:
        answers.append((await client.post("/embed_sparse", json=body)).json())

    run(models, one)
    assert served.json() == answers[0]


def test_every_tei_route_answers_errors_in_teis_shape() -> None:
    """The error shape is chosen by path (service.pipeline.errors.TEI_ROUTES): it must list
    every route the TEI routers serve (a route missing there answered OIP's shape)."""
    from service.http.routes import tei, tei_mount, tei_rank
    from service.pipeline.errors import TEI_ROUTES

    paths = {route.path for router in (tei.router, tei_rank.router, tei_mount.router)
             for route in router.routes}  # fmt: skip
    assert paths <= TEI_ROUTES, sorted(paths - TEI_ROUTES)


def test_the_routes_that_forward_to_embed_sparse_document_its_body(models) -> None:
    """POST / and /invocations answer a SPLADE model's /embed_sparse: their OpenAPI request
    bodies list its request among the alternatives."""

    async def test(client: httpx.AsyncClient) -> None:
        spec = (await client.get("/openapi.json")).json()
        for path in ("/", "/invocations"):
            schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            titles = {option.get("title") for option in schema["schema"]["anyOf"]}
            assert "EmbedSparseRequest" in titles, (path, titles)

    run(models, test)
