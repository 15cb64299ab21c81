"""Qwen3 rerankers served in process: pairs formatted by the model's chat template exactly as
sentence-transformers formats them (its token ids, truncation and restored tail), and TEI's
/rerank, /predict and the Cohere-style /v1/rerank scoring them equal to its CrossEncoder.predict
at fp32 tolerance, with and without an instruction, for the causal (LogitScore) and seq-cls
forms; what a chat reranker refuses."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from service.text.tokenizer import TextTokenizer
from tests.inprocess import asgi_client
from tests.support import FP32_TOL

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm

NAME = "qwen3-reranker"
QUERY = "what is deep learning ?"
TEXTS = ["a model learns", "hello world " * 60, "the cat sat on the mat", "deep learning"]
TASK = "rank passages about machine learning"


@pytest.fixture(scope="module", params=["ForCausalLM", "ForSequenceClassification"])
def reranker(request, tmp_path_factory) -> tuple:
    return tm.qwen3_reranker(tmp_path_factory.mktemp("rr") / NAME, request.param)


@pytest.mark.parametrize("prompt", [None, TASK])
def test_pairs_tokenize_as_sentence_transformers_formats_them(reranker, prompt) -> None:
    cross_encoder, path = reranker
    tokenizer = TextTokenizer(path / "tokenizer.json", 240)
    assert tokenizer.chat is not None
    pairs = [(QUERY, t) for t in TEXTS]
    features = cross_encoder.preprocess(pairs, prompt=prompt)
    rows = zip(features["input_ids"], features["attention_mask"], strict=True)
    want = [ids[mask.bool()].tolist() for ids, mask in rows]
    got = tokenizer.encode(pairs, prompt=prompt)
    assert [e.ids.tolist() for e in got] == want
    assert [e.truncated for e in got] == [False, True, False, False]


def test_rerank_routes_equal_the_cross_encoder(reranker) -> None:
    cross_encoder, path = reranker
    pairs = [(QUERY, t) for t in TEXTS]
    plain = cross_encoder.predict(pairs, convert_to_numpy=True)  # sigmoid of the score
    task = cross_encoder.predict(pairs, prompt=TASK, convert_to_numpy=True)
    logits = cross_encoder.predict(pairs, activation_fn=torch.nn.Identity(), convert_to_numpy=True)

    async def main() -> None:
        async with asgi_client(model_dir=path, model_name=NAME) as client:
            info = (await client.get("/info")).json()
            assert "reranker" in info["model_type"]
            body = {"query": QUERY, "texts": TEXTS, "truncate": True}
            ranks = await client.post("/rerank", json=body)
            assert ranks.status_code == 200, ranks.text
            got = {r["index"]: r["score"] for r in ranks.json()}
            np.testing.assert_allclose([got[i] for i in range(len(TEXTS))], plain, **FP32_TOL)
            raw = await client.post("/rerank", json={**body, "raw_scores": True})
            got = {r["index"]: r["score"] for r in raw.json()}
            np.testing.assert_allclose([got[i] for i in range(len(TEXTS))], logits, **FP32_TOL)
            told = await client.post("/rerank", json={**body, "instruction": TASK})
            got = {r["index"]: r["score"] for r in told.json()}
            np.testing.assert_allclose([got[i] for i in range(len(TEXTS))], task, **FP32_TOL)

            cohere = {"model": NAME, "query": QUERY, "documents": TEXTS, "instruction": TASK}
            ranked = await client.post("/v1/rerank", json=cohere)
            assert ranked.status_code == 200, ranked.text
            got = {r["index"]: r["relevance_score"] for r in ranked.json()["results"]}
            np.testing.assert_allclose([got[i] for i in range(len(TEXTS))], task, **FP32_TOL)

            predict = await client.post("/predict", json={"inputs": [[QUERY, TEXTS[0]]]})
            assert predict.status_code == 200, predict.text
            np.testing.assert_allclose(predict.json()[0][0]["score"], plain[0], **FP32_TOL)

            long = await client.post("/rerank", json={**body, "truncate": False})
            assert long.status_code == 413 and "texts[1]" in long.json()["error"]
            single = await client.post("/predict", json={"inputs": "just one text"})
            assert single.status_code == 400 and "send pairs" in single.json()["error"]
            huge = {**body, "instruction": "x" * 10**6}
            assert (await client.post("/rerank", json=huge)).status_code == 413
            ok = await client.post("/rerank", json={**body, "texts": TEXTS[:1]})
            assert ok.status_code == 200  # the connection and model still serve

    asyncio.run(main())


def test_the_models_default_prompt_is_its_instruction(tmp_path) -> None:
    """config_sentence_transformers.json's default prompt is the system message when a request
    gives no instruction, as CrossEncoder.predict applies it; an empty instruction is none."""
    _, path = tm.qwen3_reranker(tmp_path / NAME)
    config_path = path / "config_sentence_transformers.json"
    config = json.loads(config_path.read_text())
    config.update(prompts={"web": TASK}, default_prompt_name="web")
    config_path.write_text(json.dumps(config))
    from sentence_transformers import CrossEncoder

    cross_encoder = CrossEncoder(str(path))
    pairs = [(QUERY, t) for t in TEXTS[:1]]
    default = cross_encoder.predict(pairs, convert_to_numpy=True)
    bare = cross_encoder.predict(pairs, prompt="", convert_to_numpy=True)
    assert not np.allclose(default, bare)

    async def main() -> None:
        async with asgi_client(model_dir=path, model_name=NAME) as client:
            body = {"query": QUERY, "texts": TEXTS[:1]}
            got = (await client.post("/rerank", json=body)).json()[0]["score"]
            np.testing.assert_allclose(got, default[0], **FP32_TOL)
            got = (await client.post("/rerank", json={**body, "instruction": ""})).json()
            np.testing.assert_allclose(got[0]["score"], bare[0], **FP32_TOL)

    asyncio.run(main())
