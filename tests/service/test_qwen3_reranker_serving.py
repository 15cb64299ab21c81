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
    tokenizer = TextTokenizer(path / "tokenizer.json", 240, chat_pairs=True)
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


def test_a_template_that_refuses_an_instruction_answers_400(tmp_path) -> None:
    """A template may refuse messages (raise_exception): the request that sent them gets a 400
    naming it, and the model keeps serving the others."""
    _, path = tm.qwen3_reranker(tmp_path / NAME)
    refusing = (
        '{% if messages[0].role == "system" %}{{ raise_exception("no system role") }}{% endif %}'
        + tm.RERANK_TEMPLATE
    )
    (path / "chat_template.jinja").write_text(refusing)

    async def main() -> None:
        async with asgi_client(model_dir=path, model_name=NAME) as client:
            body = {"query": QUERY, "texts": TEXTS[:1], "instruction": TASK}
            refused = await client.post("/rerank", json=body)
            assert refused.status_code == 400, refused.text
            assert "refuses the instruction: no system role" in refused.json()["error"]
            assert (
                await client.post("/rerank", json={**body, "instruction": ""})
            ).status_code == 200

    asyncio.run(main())


def test_structured_message_content(tmp_path) -> None:
    """A `structured` message format gives the template text blocks, as sentence-transformers
    does: the token ids agree."""
    from sentence_transformers import CrossEncoder

    _, path = tm.qwen3_reranker(tmp_path / NAME)
    config_path = path / "sentence_bert_config.json"
    config = json.loads(config_path.read_text())
    config["modality_config"]["message"]["format"] = "structured"
    config_path.write_text(json.dumps(config))
    template = tm.RERANK_TEMPLATE
    for role in ("system", "query", "document"):
        flat = f'messages | selectattr("role", "eq", "{role}") | map(attribute="content") | first'
        blocks = f'messages | selectattr("role", "eq", "{role}") | map(attribute="content") '
        assert flat in template
        template = template.replace(flat, blocks + "| map('first') | map(attribute='text') | first")
    (path / "chat_template.jinja").write_text(template)
    cross_encoder = CrossEncoder(str(path))
    pairs = [(QUERY, t) for t in TEXTS]
    features = cross_encoder.preprocess(pairs, prompt=TASK)
    rows = zip(features["input_ids"], features["attention_mask"], strict=True)
    want = [ids[mask.bool()].tolist() for ids, mask in rows]
    got = TextTokenizer(path / "tokenizer.json", 240, chat_pairs=True).encode(pairs, prompt=TASK)
    assert [e.ids.tolist() for e in got] == want


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c: c["modality_config"]["message"].pop("format"), "format None"),
        (lambda c: c["modality_config"]["message"].update(format="auto"), "format 'auto'"),
        (lambda c: c.update(processing_kwargs={"chat_template": {"add_generation_prompt": True}}),
         "processing_kwargs"),
    ],
)  # fmt: skip
def test_message_settings_the_service_does_not_apply_are_refused(tmp_path, change, match) -> None:
    from mha_engine import CheckpointError

    _, path = tm.qwen3_reranker(tmp_path / NAME)
    config_path = path / "sentence_bert_config.json"
    config = json.loads(config_path.read_text())
    change(config)
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        TextTokenizer(path / "tokenizer.json", 240, chat_pairs=True)
    (path / "chat_template.jinja").unlink()
    config_path.write_text(json.dumps({"modality_config": {"message": {"format": "flat"}}}))
    with pytest.raises(CheckpointError, match="no chat template"):
        TextTokenizer(path / "tokenizer.json", 240, chat_pairs=True)


def test_an_embedder_with_a_chat_template_tokenizes_its_texts_as_they_are(tmp_path) -> None:
    """sentence-transformers 6 gives any model whose tokenizer has a chat template a message
    modality; an embedder's texts are still tokenized as they are (as TEI and the model cards
    do), and /embed serves them."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    import mha_engine

    base = tmp_path / "base"
    base.mkdir()
    tm.save(tm.build("qwen3", vocab_size=tm.write_chat_tokenizer(base, 64)), base)
    tm.write_chat_tokenizer(base, 64)  # save() wrote the BERT one
    (base / "chat_template.jinja").write_text(tm.RERANK_TEMPLATE)
    modules = [Transformer(str(base)), Pooling(tm.D, "lasttoken"), Normalize()]
    path = tmp_path / "st6"
    SentenceTransformer(modules=modules).save(str(path))
    config = json.loads((path / "sentence_bert_config.json").read_text())
    assert "message" in config["modality_config"]
    model = mha_engine.load_model(path)
    tokenizer = TextTokenizer(path / "tokenizer.json", model.max_seq_len)
    assert tokenizer.chat is None
    ids = [torch.from_numpy(e.ids) for e in tokenizer.encode(TEXTS[:2])]
    want = model.embed_varlen(ids).numpy()

    async def main() -> None:
        async with asgi_client(model_dir=path, model_name="emb") as client:
            embed = await client.post("/embed", json={"inputs": TEXTS[:2], "truncate": True})
            assert embed.status_code == 200, embed.text
            np.testing.assert_allclose(np.array(embed.json()), want, **FP32_TOL)

    asyncio.run(main())
