"""A LaBSE-shaped directory (CLS pooling, a Dense module to 24 features, Normalize) served in
process: /v1/embeddings and TEI's /embed give the 24-wide vectors transformers' states pooled and
passed through the Dense Linear give; `dimensions` is checked against 24, not the model's
hidden width; the metadata names the width."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tests.inprocess import asgi_client
from tests.support import FP32_TOL

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm

TEXTS = ["the cat sat on the mat", "what is deep learning?", "hello"]


def test_dense_vectors_served(tmp_path) -> None:
    reference, path = tm.sentence_transformer(tmp_path / "labse", "cls", normalize=True)
    [linear] = tm.add_dense(path, [(tm.D, 24, True, "activation.Tanh")])
    ids, mask, types = tm.padded(tm.tokenize(path, TEXTS))
    with torch.no_grad():
        cls = reference(input_ids=ids, attention_mask=mask, token_type_ids=types)[0][:, 0]
        want = torch.nn.functional.normalize(torch.tanh(linear(cls))).numpy()

    async def main() -> None:
        async with asgi_client(model_dir=path, model_name="labse") as client:
            body = {"model": "labse", "input": TEXTS}
            openai = await client.post("/v1/embeddings", json=body)
            assert openai.status_code == 200, openai.text
            got = np.array([d["embedding"] for d in openai.json()["data"]])
            np.testing.assert_allclose(got, want, **FP32_TOL)
            tei = await client.post("/embed", json={"inputs": TEXTS})
            np.testing.assert_allclose(np.array(tei.json()), want, **FP32_TOL)
            wide = await client.post("/v1/embeddings", json={**body, "dimensions": tm.D})
            assert wide.status_code == 400
            assert "over this model's 24" in wide.json()["error"]["message"]
            same = await client.post("/v1/embeddings", json={**body, "dimensions": 24})
            assert same.status_code == 200, same.text
            meta = (await client.get("/v2/models/labse")).json()
            assert meta["properties"]["embedding_dim"] == "24"

    asyncio.run(main())
