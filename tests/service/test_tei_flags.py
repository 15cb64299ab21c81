"""TEI's launch flags for embedding models, in process: --pooling (the model's 1_Pooling overridden;
TEI's `last-token` spelling too), --default-prompt-name and --default-prompt (put before inputs
that name no prompt, on /embed and /v1/embeddings), and the model's own default_prompt_name on
/v1/embeddings, all against sentence-transformers' own encode; what is refused; a reranker
served beside them keeps its own pooling and prompt."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from tests.inprocess import asgi_client
from tests.support import FP32_TOL, free_port, run_server

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling

from service.runtime.settings import Settings
from service.runtime.startup import StartupError
from tests import text_models as tm

TEXTS = tm.LONG_AND_SHORT
PROMPTS = {"query": "query: ", "doc": "passage: "}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tm.save(tm.build("bert"), tmp_path_factory.mktemp("bert"))


def _st(base: Path, pooling: str = "mean", **kw) -> SentenceTransformer:
    modules = [Transformer(str(base)), Pooling(tm.D, pooling), Normalize()]
    return SentenceTransformer(modules=modules, prompts=PROMPTS, **kw)


def _saved(st: SentenceTransformer, where: Path) -> Path:
    st.save(str(where))
    return where


async def _embed(client, body: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(/embed, /v1/embeddings) vectors of TEXTS (/embed with `body`'s extra fields)."""
    tei = await client.post("/embed", json={"inputs": TEXTS, **(body or {})})
    assert tei.status_code == 200, tei.text
    openai = await client.post("/v1/embeddings", json={"model": "m", "input": TEXTS})
    assert openai.status_code == 200, openai.text
    return np.array(tei.json()), np.array([d["embedding"] for d in openai.json()["data"]])


@pytest.mark.parametrize(
    ("flag", "mode", "st_mode"), [("cls", "cls", "cls"), ("last-token", "last_token", "lasttoken")]
)
def test_pooling_overrides_the_models_own(base, tmp_path, flag, mode, st_mode) -> None:
    path = _saved(_st(base, "mean"), tmp_path / "m")
    want = _st(base, st_mode).encode(TEXTS)
    assert not np.allclose(want, _st(base, "mean").encode(TEXTS), atol=1e-3)

    async def main() -> None:
        async with asgi_client(model_dir=path, model_name="m", pooling=flag) as client:
            info = (await client.get("/info")).json()
            assert info["model_type"] == {"embedding": {"pooling": mode}}
            for got in await _embed(client):
                np.testing.assert_allclose(got, want, **FP32_TOL)

    asyncio.run(main())


def test_pooling_and_default_prompt_per_model_in_mha_serve_json(base, tmp_path) -> None:
    _saved(_st(base, "mean"), tmp_path / "repo" / "m" / "1")
    own = {"pooling": "cls", "default_prompt_name": "query"}
    (tmp_path / "repo" / "m" / "mha-serve.json").write_text(json.dumps(own))
    want = _st(base, "cls").encode(TEXTS, prompt_name="query")

    async def main() -> None:
        async with asgi_client(model_repository=tmp_path / "repo") as client:
            for got in await _embed(client):
                np.testing.assert_allclose(got, want, **FP32_TOL)

    asyncio.run(main())


def test_a_models_own_prompt_setting_replaces_the_servers_other_form(base, tmp_path) -> None:
    _saved(_st(base), tmp_path / "repo" / "m" / "1")
    (tmp_path / "repo" / "m" / "mha-serve.json").write_text('{"default_prompt_name": "query"}')
    want = _st(base).encode(TEXTS, prompt_name="query")

    async def main() -> None:
        flags = {"model_repository": tmp_path / "repo", "default_prompt": "search: "}
        async with asgi_client(**flags) as client:
            for got in await _embed(client):
                np.testing.assert_allclose(got, want, **FP32_TOL)

    asyncio.run(main())


def test_default_prompt_name_and_default_prompt(base, tmp_path) -> None:
    path = _saved(_st(base), tmp_path / "m")
    st = _st(base)
    query, doc = st.encode(TEXTS, prompt_name="query"), st.encode(TEXTS, prompt_name="doc")
    literal = st.encode(TEXTS, prompt="search: ")

    async def main() -> None:
        async with asgi_client(model_dir=path, model_name="m", default_prompt_name="query") as c:
            for got in await _embed(c):
                np.testing.assert_allclose(got, query, **FP32_TOL)
            named, _ = await _embed(c, {"prompt_name": "doc"})  # a request's own name wins
            np.testing.assert_allclose(named, doc, **FP32_TOL)
        async with asgi_client(model_dir=path, model_name="m", default_prompt="search: ") as c:
            for got in await _embed(c):
                np.testing.assert_allclose(got, literal, **FP32_TOL)
            # the other routes that take prompt_name put it in front too (TEI's /similarity)
            for route, body in (
                ("/embed_all", {"inputs": TEXTS[0]}),
                ("/tokenize", {"inputs": TEXTS[0]}),
                ("/similarity", {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS}}),
            ):
                got = (await c.post(route, json=body)).json()
                if route == "/similarity":
                    unit = literal / np.linalg.norm(literal, axis=1, keepdims=True)
                    np.testing.assert_allclose(got, unit @ unit[0], atol=1e-5)
                    continue
                plain = (await c.post(route, json={**body, "prompt_name": "doc"})).json()
                assert got != plain  # "search: " in front, not "passage: "

    asyncio.run(main())


def test_the_models_own_default_prompt_applies_on_v1_embeddings(base, tmp_path) -> None:
    """config_sentence_transformers.json's default_prompt_name: sentence-transformers' encode
    applies it to every input, and so do /embed and /v1/embeddings."""
    path = _saved(_st(base, default_prompt_name="doc"), tmp_path / "m")
    want = SentenceTransformer(str(path)).encode(TEXTS)
    np.testing.assert_allclose(want, _st(base).encode(TEXTS, prompt_name="doc"), **FP32_TOL)
    assert not np.allclose(want, _st(base).encode(TEXTS), atol=1e-3)  # the prompt changes them

    async def main() -> None:
        async with asgi_client(model_dir=path, model_name="m") as client:
            for got in await _embed(client):
                np.testing.assert_allclose(got, want, **FP32_TOL)

    asyncio.run(main())


def test_what_is_refused(base, tmp_path) -> None:
    with pytest.raises(ValidationError, match="exclude each other"):
        Settings(default_prompt="a: ", default_prompt_name="query")
    with pytest.raises(ValidationError, match="pooling"):
        Settings(pooling="max")
    path = _saved(_st(base), tmp_path / "m")

    async def main() -> None:
        async with asgi_client(model_dir=path, model_name="m", default_prompt_name="nope"):
            pass

    with pytest.raises(StartupError, match=r"--default-prompt-name 'nope' is not one of its"):
        asyncio.run(main())


def test_a_splade_model_keeps_its_own_pooling(tmp_path) -> None:
    _, path = tm.splade(tmp_path / "sp")
    body = {"inputs": TEXTS}

    async def answers(**flags) -> tuple:
        async with asgi_client(model_dir=path, model_name="sp", **flags) as client:
            info = (await client.get("/info")).json()
            return info["model_type"], (await client.post("/embed_sparse", json=body)).json()

    assert asyncio.run(answers(pooling="cls")) == asyncio.run(answers())


def test_a_reranker_keeps_its_own_prompt(tmp_path) -> None:
    _, path = tm.classifier("bert", tmp_path / "rr", {0: "score"})
    body = {"query": "what is deep learning?", "texts": ["a cat", "deep learning is a model"]}

    async def scores(**flags) -> list[float]:
        async with asgi_client(model_dir=path, model_name="rr", **flags) as client:
            ranked = await client.post("/rerank", json=body)
            assert ranked.status_code == 200, ranked.text
            return [r["score"] for r in sorted(ranked.json(), key=lambda r: r["index"])]

    plain = asyncio.run(scores())
    flagged = asyncio.run(scores(default_prompt="search: ", default_prompt_name=None))
    assert flagged == plain


def test_dense_path_serves_the_named_dense_module(tmp_path) -> None:
    """--dense-path (TEI's flag): vectors of the named Dense module's width, as the engine
    gives them with dense_path (tests/mha_engine/test_dense.py checks those against torch)."""
    import mha_engine

    _, path = tm.sentence_transformer(tmp_path / "m", "mean", normalize=True)
    tm.add_dense(path, [(tm.D, 24, True, "linear.Identity")])
    tm.write_dense(path, "2_Dense_16", 16)
    model = mha_engine.load_model(path, dense_path="2_Dense_16")
    want = model.embed_varlen([ids for ids, _ in tm.tokenize(path, TEXTS)]).numpy()

    async def main() -> None:
        async with asgi_client(model_dir=path, model_name="m", dense_path="2_Dense_16") as c:
            for got in await _embed(c):
                assert got.shape == (len(TEXTS), 16)
                np.testing.assert_allclose(got, want, **FP32_TOL)

    asyncio.run(main())


def test_the_flags_reach_the_engine_processes_with_workers(base, tmp_path) -> None:
    """--workers 2: the engine process loads the model with --pooling, the front-ends apply the
    default prompt; the same vectors as sentence-transformers' encode, over HTTP and over TEI's
    gRPC API."""
    import grpc
    import httpx

    from service.grpc import tei_pb2, tei_pb2_grpc

    path = _saved(_st(base, "mean"), tmp_path / "m")
    want = _st(base, "cls").encode(TEXTS, prompt_name="query")
    port = free_port()
    flags = ("--pooling", "cls", "--default-prompt-name", "query", "--workers", "2",
             "--grpc-port", str(port))  # fmt: skip
    with run_server(tmp_path, "--model-dir", str(path), "--model-name", "m", *flags) as server:
        info = httpx.get(f"{server.url}/info", timeout=10).json()
        tei = httpx.post(f"{server.url}/embed", json={"inputs": TEXTS}, timeout=30)
        body = {"model": "m", "input": TEXTS}
        openai = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tei_pb2_grpc.EmbedStub(channel)
            answers = [stub.Embed(tei_pb2.EmbedRequest(inputs=text), timeout=30) for text in TEXTS]
    got = np.array([list(a.embeddings) for a in answers], np.float32)
    np.testing.assert_allclose(got, want, **FP32_TOL)
    assert info["model_type"] == {"embedding": {"pooling": "cls"}}
    assert tei.status_code == openai.status_code == 200, (tei.text, openai.text)
    np.testing.assert_allclose(np.array(tei.json()), want, **FP32_TOL)
    got = np.array([d["embedding"] for d in openai.json()["data"]])
    np.testing.assert_allclose(got, want, **FP32_TOL)
