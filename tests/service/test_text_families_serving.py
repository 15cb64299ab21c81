"""The newer text families served in process: MPNet (all-mpnet-base-v2's layout: mean pooling,
Normalize), ModernBERT, Qwen3-Embedding (last token, a query prompt) and EmbeddingGemma (mean,
two Dense modules, prompts) directories answer /v1/embeddings and TEI's /embed equal to
transformers' own models at fp32 tolerance, several sentences batched together; the debug routes
take their heads."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.inprocess import asgi_client
from tests.support import FP32_TOL

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import jina_models as jm
from tests import text_models as tm

NAME = "mpnet"
TEXTS = ["the cat sat on the mat", "what is deep learning?", "hello", "paris is the capital"]
TOKEN = "debug-token"


@pytest.fixture(scope="module")
def mpnet(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    root = tmp_path_factory.mktemp("mpnet")
    return tm.sentence_transformer(root / NAME, pooling="mean", model_type="mpnet")


def _reference(model, directory: Path, texts: list[str]) -> tuple[np.ndarray, tuple]:
    """Normalized mean-pooled vectors and the per-layer attention weights of the first text."""
    ids, mask, _ = tm.padded(tm.tokenize(directory, texts))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    m = mask[..., None].float()
    mean = (out.last_hidden_state * m).sum(1) / m.sum(1)
    first = int(mask[0].sum())
    weights = tuple(a[:1, :, :first, :first] for a in out.attentions)
    return torch.nn.functional.normalize(mean, dim=-1).numpy(), weights


def test_embeddings_and_attention_equal_transformers(mpnet) -> None:
    model, directory = mpnet
    want, weights = _reference(model, directory, TEXTS)

    async def main() -> None:
        settings = {"debug_endpoint": True, "debug_token": TOKEN}
        async with asgi_client(model_dir=directory, model_name=NAME, **settings) as client:
            openai = await client.post("/v1/embeddings", json={"model": NAME, "input": TEXTS})
            assert openai.status_code == 200, openai.text
            got = np.array([d["embedding"] for d in openai.json()["data"]])
            np.testing.assert_allclose(got, want, **FP32_TOL)
            tei = await client.post("/embed", json={"inputs": TEXTS})
            assert tei.status_code == 200, tei.text
            np.testing.assert_allclose(np.array(tei.json()), want, **FP32_TOL)
            info = (await client.get("/info")).json()
            assert info["model_type"] == {"embedding": {"pooling": "mean"}}

            text = {"name": "text", "shape": [1], "datatype": "BYTES", "data": [TEXTS[0]]}
            debug = await client.post(
                f"/v2/models/{NAME}/attention",
                json={"inputs": [text]},
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            assert debug.status_code == 200, debug.text
            out = {o["name"]: o for o in debug.json()["outputs"]}["attention_weights"]
            got_weights = torch.tensor(out["data"]).reshape(out["shape"])  # (L, 1, H, T, T)
            torch.testing.assert_close(got_weights, torch.stack(weights), **FP32_TOL)

    asyncio.run(main())


def test_modernbert_embeddings_equal_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A ModernBERT directory (rotary positions, a sliding-window layer) served the same way;
    the texts run longer and shorter than the test model's window."""
    root = tmp_path_factory.mktemp("modernbert")
    model, directory = tm.sentence_transformer(root / "mb", pooling="mean", model_type="modernbert")
    texts = [*TEXTS, "what is deep learning and how does a model rank a passage for a query ?"]
    want, _ = _reference(model, directory, texts)

    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def main() -> None:
        settings = {"debug_endpoint": True, "debug_token": TOKEN}
        async with asgi_client(model_dir=directory, model_name="mb", **settings) as client:
            openai = await client.post("/v1/embeddings", json={"model": "mb", "input": texts})
            assert openai.status_code == 200, openai.text
            got = np.array([d["embedding"] for d in openai.json()["data"]])
            np.testing.assert_allclose(got, want, **FP32_TOL)
            tei = await client.post("/embed", json={"inputs": texts})
            np.testing.assert_allclose(np.array(tei.json()), want, **FP32_TOL)
            # the debug routes and the model's metadata and configuration
            text = {"name": "text", "shape": [1], "datatype": "BYTES", "data": [texts[-1]]}
            debug = await client.post(
                "/v2/models/mb/attention", json={"inputs": [text]}, headers=auth
            )
            assert debug.status_code == 200, debug.text
            heads = await client.get("/v2/models/mb/heads", headers=auth)
            assert heads.status_code == 200, heads.text
            assert len(heads.json()["layers"]) == 3
            for route in ("/v2/models/mb", "/v2/models/mb/config", "/debug/info", "/info"):
                response = await client.get(route, headers=auth)
                assert response.status_code == 200, (route, response.text)

    asyncio.run(main())


def test_qwen3_embeddings_equal_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A Qwen3-Embedding directory (causal GQA decoder, last-token pooling, Normalize, a query
    prompt) answers /v1/embeddings and /embed with the prompt applied, equal to transformers'
    Qwen3Model; the debug routes take its heads (64 wide on a 32-wide model)."""
    root = tmp_path_factory.mktemp("qwen3")
    prompt = "Instruct: find the passage\nQuery: "
    model, directory = tm.sentence_transformer(
        root / "qw", pooling="last_token", prompts={"query": prompt}, model_type="qwen3"
    )
    texts = [*TEXTS, "what is deep learning and how does a model rank a passage for a query ?"]

    def reference(batch: list[str]) -> np.ndarray:
        ids, mask, _ = tm.padded(tm.tokenize(directory, batch))
        with torch.no_grad():
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(batch)), mask.sum(1) - 1]  # right padding
        return torch.nn.functional.normalize(last, dim=-1).numpy()

    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def main() -> None:
        settings = {"debug_endpoint": True, "debug_token": TOKEN}
        async with asgi_client(model_dir=directory, model_name="qw", **settings) as client:
            openai = await client.post("/v1/embeddings", json={"model": "qw", "input": texts})
            assert openai.status_code == 200, openai.text
            got = np.array([d["embedding"] for d in openai.json()["data"]])
            np.testing.assert_allclose(got, reference(texts), **FP32_TOL)
            tei = await client.post("/embed", json={"inputs": texts, "prompt_name": "query"})
            assert tei.status_code == 200, tei.text
            want = reference([prompt + t for t in texts])
            np.testing.assert_allclose(np.array(tei.json()), want, **FP32_TOL)
            info = (await client.get("/info")).json()
            assert info["model_type"] == {"embedding": {"pooling": "last_token"}}
            text = {"name": "text", "shape": [1], "datatype": "BYTES", "data": [texts[0]]}
            debug = await client.post(
                "/v2/models/qw/attention", json={"inputs": [text]}, headers=auth
            )
            assert debug.status_code == 200, debug.text
            out = {o["name"]: o for o in debug.json()["outputs"]}["attention_weights"]
            weights = torch.tensor(out["data"]).reshape(out["shape"])  # (L, 1, H, T, T)
            assert weights.shape[:3] == (tm.LAYERS, 1, tm.HEADS)
            assert (weights.triu(diagonal=1) == 0).all()  # causal
            heads = await client.get("/v2/models/qw/heads", headers=auth)
            assert heads.status_code == 200, heads.text
            assert len(heads.json()["layers"]) == tm.LAYERS
            for route in ("/v2/models/qw", "/v2/models/qw/config", "/debug/info"):
                response = await client.get(route, headers=auth)
                assert response.status_code == 200, (route, response.text)

    asyncio.run(main())


def test_embeddinggemma_embeddings_equal_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """An EmbeddingGemma-shaped directory (bidirectional Gemma 3 with a sliding layer, mean
    pooling, two Dense modules, Normalize, its task prompts) through /v1/embeddings and /embed."""
    root = tmp_path_factory.mktemp("gemma")
    prompts = {"query": "task: search result | query: ", "document": "title: none | text: "}
    model, directory = tm.sentence_transformer(
        root / "eg", pooling="mean", prompts=prompts, model_type="gemma3_text"
    )
    identity = "linear.Identity"
    up, down = tm.add_dense(directory, [(tm.D, 48, False, identity), (48, 24, False, identity)])
    texts = [*TEXTS, "what is deep learning and how does a model rank a passage for a query ?"]

    def reference(batch: list[str]) -> np.ndarray:
        ids, mask, _ = tm.padded(tm.tokenize(directory, batch))
        m = mask[..., None].float()
        with torch.no_grad():
            mean = (model(input_ids=ids, attention_mask=mask).last_hidden_state * m).sum(1)
            vectors = down(up(mean / m.sum(1)))
        return torch.nn.functional.normalize(vectors, dim=-1).numpy()

    async def main() -> None:
        async with asgi_client(model_dir=directory, model_name="eg") as client:
            openai = await client.post("/v1/embeddings", json={"model": "eg", "input": texts})
            assert openai.status_code == 200, openai.text
            got = np.array([d["embedding"] for d in openai.json()["data"]])
            assert got.shape == (len(texts), 24)
            np.testing.assert_allclose(got, reference(texts), **FP32_TOL)
            tei = await client.post("/embed", json={"inputs": texts, "prompt_name": "query"})
            assert tei.status_code == 200, tei.text
            want = reference([prompts["query"] + t for t in texts])
            np.testing.assert_allclose(np.array(tei.json()), want, **FP32_TOL)

    asyncio.run(main())


@pytest.mark.parametrize("family", ["nomic_bert", "gte"])
def test_rotary_bert_embedders_equal_transformers(tmp_path, family) -> None:
    """nomic-embed-text's layout (mean pooling, Normalize, its task prefixes as prompts) and
    gte-multilingual-base's: /v1/embeddings and /embed (with a prompt) equal transformers'
    NomicBertModel / GteModel."""
    prompts = {"search_query": "search_query: ", "search_document": "search_document: "}
    model, directory = tm.sentence_transformer(
        tmp_path / family, pooling="mean", prompts=prompts, model_type=family
    )
    plain, _ = _reference(model, directory, TEXTS)
    queried, _ = _reference(model, directory, [f"search_query: {t}" for t in TEXTS])

    async def main() -> None:
        async with asgi_client(model_dir=directory, model_name=family) as client:
            openai = await client.post("/v1/embeddings", json={"model": family, "input": TEXTS})
            assert openai.status_code == 200, openai.text
            got = np.array([d["embedding"] for d in openai.json()["data"]])
            np.testing.assert_allclose(got, plain, **FP32_TOL)
            body = {"inputs": TEXTS, "prompt_name": "search_query"}
            tei = await client.post("/embed", json=body)
            assert tei.status_code == 200, tei.text
            np.testing.assert_allclose(np.array(tei.json()), queried, **FP32_TOL)

    asyncio.run(main())


async def _check_rerank(path: Path, query: str, passages: list[str], scores: np.ndarray) -> None:
    """/rerank of the reranker at `path` ranks the passages by `scores` and answers them."""
    async with asgi_client(model_dir=path, model_name="reranker") as client:
        ranked = await client.post("/rerank", json={"query": query, "texts": passages})
        assert ranked.status_code == 200, ranked.text
        order = np.argsort(-scores)
        assert [r["index"] for r in ranked.json()] == order.tolist()
        got = [r["score"] for r in ranked.json()]
        np.testing.assert_allclose(got, scores[order], rtol=1e-5, atol=1e-6)


def test_jina_bert_embedders_and_rerankers_equal_the_reference(tmp_path) -> None:
    """jina-embeddings-v2's layout (JinaBERT: ALiBi, a GLU; mean pooling, Normalize) on
    /v1/embeddings and /embed, and jina-reranker-v1's (one label) on /rerank, equal to the
    reference tests/jina_models.py builds from transformers' BertModel."""
    embedder = jm.reference(heads=6)
    directory = jm.hub_form(embedder, tmp_path / "jina")
    tm.write_st_modules(directory, "mean", normalize=True)
    ids, mask, types = tm.padded(tm.tokenize(directory, TEXTS))
    states = jm.run(embedder, ids, mask, token_type_ids=types).last_hidden_state
    m = mask[..., None].float()
    want = torch.nn.functional.normalize((states * m).sum(1) / m.sum(1), dim=-1).numpy()

    labels = {"id2label": {0: "score"}, "label2id": {"score": 0}}
    reranker = jm.reference("ForSequenceClassification", num_labels=1, **labels)
    ranker_dir = jm.hub_form(
        reranker, tmp_path / "jina-r", architectures=["JinaBertForSequenceClassification"]
    )
    query, passages = TEXTS[1], [TEXTS[0], TEXTS[2], TEXTS[3]]
    pairs = tm.padded(tm.tokenize(ranker_dir, [(query, p) for p in passages], pairs=True))
    logits = jm.run(reranker, pairs[0], pairs[1], token_type_ids=pairs[2]).logits[:, 0]
    scores = torch.sigmoid(logits.double()).numpy()

    async def main() -> None:
        async with asgi_client(model_dir=directory, model_name="jina") as client:
            openai = await client.post("/v1/embeddings", json={"model": "jina", "input": TEXTS})
            assert openai.status_code == 200, openai.text
            got = np.array([d["embedding"] for d in openai.json()["data"]])
            np.testing.assert_allclose(got, want, **FP32_TOL)
            tei = await client.post("/embed", json={"inputs": TEXTS})
            np.testing.assert_allclose(np.array(tei.json()), want, **FP32_TOL)
        await _check_rerank(ranker_dir, query, passages, scores)

    asyncio.run(main())


def test_jina_reranker_v2_reranks_as_transformers(tmp_path) -> None:
    """jina-reranker-v2-base-multilingual's form (Jina's XLM-RoBERTa code: no model_type, flash
    weight names) on /rerank: sigmoid of transformers' XLMRobertaForSequenceClassification."""
    labels = {"id2label": {0: "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    reference = tm.build("xlm-roberta", "ForSequenceClassification", num_labels=1, **labels)
    path = jm.xlmr_flash_form(
        reference, tmp_path / "jina-r2", architectures=["XLMRobertaForSequenceClassification"]
    )
    query, passages = TEXTS[1], [TEXTS[0], TEXTS[2], TEXTS[3]]
    ids, mask, _ = tm.padded(tm.tokenize(path, [(query, p) for p in passages], pairs=True))
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=mask).logits[:, 0]
    scores = torch.sigmoid(logits.double()).numpy()

    asyncio.run(_check_rerank(path, query, passages, scores))


YARN = {
    "rope_type": "yarn",
    "rope_theta": 1000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
}


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("mistral", {}), ("qwen2", {}), ("llama", {"rope_parameters": YARN}), ("eurobert", {})],
)
def test_llama_family_embedders_equal_sentence_transformers(tmp_path, family, overrides) -> None:
    """e5-mistral's and gte-Qwen2's layout (last-token pooling, Normalize, a query prompt) saved
    by sentence-transformers itself: /v1/embeddings and /embed equal its encode (also with RoPE
    scaling: a Llama with YaRN)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    base = tm.save(tm.build(family, **overrides), tmp_path / "base")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]"}
    (base / "tokenizer_config.json").write_text(json.dumps(config))  # its padding (left)
    modules = [Transformer(str(base)), Pooling(tm.D, "lasttoken"), Normalize()]
    model = SentenceTransformer(modules=modules, prompts={"query": "query : "})
    directory = tmp_path / family
    model.save(str(directory))
    plain, queried = model.encode(TEXTS), model.encode(TEXTS, prompt_name="query")

    async def main() -> None:
        async with asgi_client(model_dir=directory, model_name=family) as client:
            body = {"model": family, "input": TEXTS}
            openai = await client.post("/v1/embeddings", json=body)
            assert openai.status_code == 200, openai.text
            got = np.array([d["embedding"] for d in openai.json()["data"]])
            np.testing.assert_allclose(got, plain, **FP32_TOL)
            tei = await client.post("/embed", json={"inputs": TEXTS, "prompt_name": "query"})
            assert tei.status_code == 200, tei.text
            np.testing.assert_allclose(np.array(tei.json()), queried, **FP32_TOL)

    asyncio.run(main())
