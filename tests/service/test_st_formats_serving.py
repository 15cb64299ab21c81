"""A model saved by sentence-transformers 6 (its 5.4+ file layout) served in process: TEI's
/embed with and without its query prompt, and /v1/embeddings, equal to that library's own
encode at fp32 tolerance, an input past the saved max length truncated where it truncates."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tests.inprocess import asgi_client
from tests.support import FP32_TOL

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling

from tests import text_models as tm

NAME = "st6"
TEXTS = tm.LONG_AND_SHORT  # the third: 17 tokens, past max_seq_length 16


def test_a_sentence_transformers_6_model_serves_its_vectors(tmp_path) -> None:
    base = tm.save(tm.build("bert"), tmp_path / "base")
    torch.manual_seed(6)
    modules = [
        Transformer(str(base), max_seq_length=16),
        Pooling(tm.D, "mean"),
        Dense(tm.D, 12, activation_function=torch.nn.Tanh()),
        Normalize(),
    ]
    model = SentenceTransformer(modules=modules, prompts={"query": "query : "})
    directory = tmp_path / NAME
    model.save(str(directory))
    plain = model.encode(TEXTS)
    queried = model.encode(TEXTS, prompt_name="query")

    async def main() -> None:
        async with asgi_client(model_dir=directory, model_name=NAME) as client:
            embed = await client.post("/embed", json={"inputs": TEXTS, "truncate": True})
            assert embed.status_code == 200, embed.text
            np.testing.assert_allclose(np.array(embed.json()), plain, **FP32_TOL)
            query = {"inputs": TEXTS, "truncate": True, "prompt_name": "query"}
            embed = await client.post("/embed", json=query)
            assert embed.status_code == 200, embed.text
            np.testing.assert_allclose(np.array(embed.json()), queried, **FP32_TOL)
            openai = await client.post("/v1/embeddings", json={"model": NAME, "input": TEXTS})
            assert openai.status_code == 200, openai.text
            got = np.array([d["embedding"] for d in openai.json()["data"]])
            np.testing.assert_allclose(got, plain, **FP32_TOL)
            assert got.shape == (len(TEXTS), 12)

    asyncio.run(main())
