"""A BGE-M3-shaped model served: /embed (and /v1/embeddings) give its dense vector, /embed_sparse
its lexical weights (FlagEmbedding's formula, tests/mha_engine/test_lexical.py), over HTTP and
TEI's gRPC API, in process and with --workers 2 (the front-ends learn from the engine process
that the model offers both)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import numpy as np
import pytest

import mha_engine
from service.grpc import tei_pb2, tei_pb2_grpc
from tests.inprocess import asgi_client
from tests.mha_engine.test_lexical import TEXTS, bge_m3, reference
from tests.support import FP32_TOL, free_port, run_server

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm


@pytest.fixture(scope="module")
def m3(tmp_path_factory) -> tuple:
    return bge_m3(tmp_path_factory.mktemp("m3") / "bge-m3")


def check_sparse(answer: list[list[dict]], want: np.ndarray) -> None:
    """/embed_sparse's answer against reference weights (B, V): the non-zero ones, index
    order, equal at fp32 tolerance."""
    assert [[e["index"] for e in row] for row in answer] == [
        np.flatnonzero(row).tolist() for row in want
    ]
    got = np.concatenate([[e["value"] for e in row] for row in answer])
    np.testing.assert_allclose(got, want[want > 0], **FP32_TOL)


def test_dense_and_lexical_over_http_and_grpc(m3) -> None:
    reference_model, path, state = m3
    want_sparse = reference(reference_model, path, TEXTS, state).numpy()
    model = mha_engine.load_model(path)
    want_dense = model.embed_varlen([ids for ids, _ in tm.tokenize(path, TEXTS)]).numpy()

    async def main() -> None:
        port = free_port()
        async with (
            asgi_client(model_dir=[path], model_name="m3", grpc_port=port) as client,
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            dense = await client.post("/embed", json={"inputs": TEXTS})
            assert dense.status_code == 200, dense.text
            np.testing.assert_allclose(np.array(dense.json()), want_dense, **FP32_TOL)
            body = {"model": "m3", "input": TEXTS}
            openai = (await client.post("/v1/embeddings", json=body)).json()["data"]
            np.testing.assert_allclose([d["embedding"] for d in openai], want_dense, **FP32_TOL)
            sparse = await client.post("/embed_sparse", json={"inputs": TEXTS})
            assert sparse.status_code == 200, sparse.text
            check_sparse(sparse.json(), want_sparse)
            info = (await client.get("/info")).json()
            assert info["model_type"] == {"embedding": {"pooling": "cls"}}

            stub = tei_pb2_grpc.EmbedStub(channel)
            answer = await stub.EmbedSparse(tei_pb2.EmbedSparseRequest(inputs=TEXTS[0]))
            assert [v.index for v in answer.sparse_embeddings] == [
                e["index"] for e in sparse.json()[0]
            ]
            values = np.float32([v.value for v in answer.sparse_embeddings])
            assert values.tobytes() == np.float32([e["value"] for e in sparse.json()[0]]).tobytes()

            refused = await client.post("/rerank", json={"query": "q", "texts": ["a"]})
            assert refused.status_code == 424
            assert "which offers /embed, /embed_all" in refused.json()["error"]
            assert "and /embed_sparse" in refused.json()["error"]

    asyncio.run(main())


def test_workers_serve_both(m3, tmp_path) -> None:
    reference_model, path, state = m3
    want = reference(reference_model, path, TEXTS, state).numpy()
    args = ("--model-dir", str(path), "--model-name", "m3", "--workers", "2")
    with run_server(tmp_path, *args) as server:
        sparse = httpx.post(f"{server.url}/embed_sparse", json={"inputs": TEXTS}, timeout=30)
        dense = httpx.post(f"{server.url}/embed", json={"inputs": TEXTS}, timeout=30)
    assert sparse.status_code == 200 and dense.status_code == 200, (sparse.text, dense.text)
    check_sparse(sparse.json(), want)
