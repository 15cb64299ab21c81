"""TEI's routes on the real all-MiniLM-L6-v2 server: /embed (normalize, truncate, 413),
/tokenize, /decode, /info, TEI's error shape, and huggingface_hub's InferenceClient."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.service.test_embeddings import minilm_dir
from tests.support import Server, run_server

NAME = "all-MiniLM-L6-v2"
TEXTS = ["This is an example sentence", "Each sentence is converted"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--model-dir", str(minilm_dir()), "--model-name", NAME]
    with run_server(tmp_path_factory.mktemp("tei"), *args) as s:
        yield s


def post(server: Server, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_embed_equals_v1_embeddings_and_normalize(server):
    openai_style = post(server, "/v1/embeddings", {"model": NAME, "input": TEXTS}).json()
    want = np.array([d["embedding"] for d in openai_style["data"]])
    got = post(server, "/embed", {"inputs": TEXTS})
    assert got.status_code == 200, got.text
    np.testing.assert_allclose(np.array(got.json()), want, atol=1e-6)
    single = post(server, "/embed", {"inputs": TEXTS[0]}).json()
    np.testing.assert_allclose(single, want[:1], atol=1e-6)
    raw = np.array(post(server, "/embed", {"inputs": TEXTS, "normalize": False}).json())
    norms = np.linalg.norm(raw, axis=1)
    assert not np.allclose(norms, 1.0)  # mean pooling without MiniLM's Normalize module
    np.testing.assert_allclose(raw / norms[:, None], want, atol=1e-6)


def test_too_long_is_cut_unless_truncate_is_false(server):
    """--auto-truncate is on by default (TEI's default): an over-long input is cut unless the
    request sets 'truncate': false."""
    long = " ".join(["tokenization"] * 400) + " the end"
    refused = post(server, "/embed", {"inputs": [TEXTS[0], long], "truncate": False})
    assert refused.status_code == 413
    body = refused.json()
    assert body["error_type"] == "Validation"
    assert "inputs[1] is longer than the model's 256 tokens" in body["error"]
    assert "'truncate': true" in body["error"]
    cut = post(server, "/embed", {"inputs": [TEXTS[0], long], "truncate": True})
    assert cut.status_code == 200 and len(cut.json()) == 2
    assert post(server, "/embed", {"inputs": [TEXTS[0], long]}).json() == cut.json()
    # Left truncation keeps the end: the vector of [CLS] + the last 254 tokens + [SEP].
    left = {"inputs": long, "truncate": True, "truncation_direction": "Left"}
    (got,) = post(server, "/embed", left).json()
    from tokenizers import Tokenizer

    plain = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    plain.no_truncation()
    ids = [101, *plain.encode(long, add_special_tokens=False).ids[-254:], 102]
    want = post(server, "/v1/embeddings", {"model": NAME, "input": [ids]}).json()
    np.testing.assert_allclose(got, want["data"][0]["embedding"], atol=1e-6)
    assert np.dot(got, cut.json()[1]) < 0.9999  # not the right-truncated vector
    states = post(server, "/embed_all", left).json()
    assert np.array(states).shape == (1, 256, 384)


def test_dimensions_cut_the_vector_then_normalize(server):
    """TEI 1.9's `dimensions` on /embed: the first n values of the raw vector, then unit length
    when `normalize` (the default); bounded by the embedding size."""
    raw = np.array(post(server, "/embed", {"inputs": TEXTS, "normalize": False}).json())
    cut = np.array(post(server, "/embed", {"inputs": TEXTS, "dimensions": 16}).json())
    want = raw[:, :16] / np.linalg.norm(raw[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, want, atol=1e-6)
    body = {"inputs": TEXTS, "dimensions": 16, "normalize": False}
    np.testing.assert_allclose(post(server, "/embed", body).json(), raw[:, :16], atol=1e-7)
    too_wide = "'dimensions' 385 exceeds the embedding size 384"
    for dims, words in ((0, "dimensions"), (385, too_wide)):
        refused = post(server, "/embed", {"inputs": TEXTS, "dimensions": dims})
        assert refused.status_code == 400 and words in refused.json()["error"], refused.text


BAD = [
    ("/embed", {"inputs": []}, 400, "empty list"),
    ("/embed", {"inputs": [""]}, 400, "inputs[0] is an empty string"),
    ("/embed", {"inputs": "a", "truncation_direction": "Up"}, 400, "truncation_direction"),
    ("/embed", {"inputs": "a", "temperature": 1}, 400, "temperature"),
    ("/embed", {"inputs": "a", "truncation_direction": "left"}, 400, "'Right' or 'Left'"),
    ("/embed", {"inputs": ["a"] * 33}, 413, "'inputs' has 33 items; at most 32"),
    ("/embed", {"inputs": "a", "prompt_name": "query"}, 400, "unknown prompt_name 'query'"),
    ("/embed_all", {"inputs": [""]}, 400, "inputs[0] is an empty string"),
    ("/rerank", {"query": "a", "texts": ["b"]}, 424, "'all-MiniLM-L6-v2' is an embedding model"),
    ("/predict", {"inputs": "a"}, 424, "/predict needs a classifier or a reranker model"),
    ("/tokenize", {"inputs": []}, 400, "empty list"),
    ("/decode", {"ids": [101, 40000]}, 400, "ids[0] must hold 1 to 256 ids in [0, 30522)"),
]


@pytest.mark.parametrize("case", BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD)])
def test_bad_input_in_tei_error_shape(server, case):
    path, body, status, words = case
    response = post(server, path, body)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]
    assert response.json()["error_type"] == ("Backend" if status == 424 else "Validation")


def test_tokenize_decode_info(server):
    tokens = post(server, "/tokenize", {"inputs": "Hello world"}).json()
    # TEI's form: a special token its own text and no span, another the input's text it covers
    assert [t["text"] for t in tokens[0]] == ["[CLS]", "Hello", "world", "[SEP]"]
    assert [t["special"] for t in tokens[0]] == [True, False, False, True]
    assert [(t["start"], t["stop"]) for t in tokens[0]] == [
        (None, None),
        (0, 5),
        (6, 11),
        (None, None),
    ]
    accented = post(server, "/tokenize", {"inputs": "né world"}).json()[0]  # UTF-8 byte spans
    assert [(t["text"], t["start"], t["stop"]) for t in accented[1:-1]] == [
        ("né", 0, 3), ("world", 4, 9)
    ]  # fmt: skip
    assert post(server, "/tokenize", {"inputs": ""}).status_code == 400
    assert post(server, "/decode", {"ids": []}).status_code == 400
    ids = [t["id"] for t in tokens[0]]
    assert post(server, "/decode", {"ids": ids}).json() == ["hello world"]
    assert post(server, "/decode", {"ids": [ids], "skip_special_tokens": False}).json() == [
        "[CLS] hello world [SEP]"
    ]
    info = httpx.get(f"{server.url}/info", timeout=10).json()
    assert info["model_id"] == NAME and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256


def test_huggingface_hub_inference_client(server, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    # Other tests set HF_HUB_OFFLINE (no downloads); this client only talks to 127.0.0.1.
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    client = hub.InferenceClient(base_url=server.url)
    got = np.asarray(client.feature_extraction(TEXTS[0]))
    want = post(server, "/embed", {"inputs": TEXTS[0]}).json()
    np.testing.assert_allclose(got.reshape(1, -1), want, atol=1e-6)


def test_similarity_is_the_cosine_of_embed_vectors(server):
    sentences = ["A man is eating food.", "He drove to the stadium."]
    body = {"inputs": {"source_sentence": TEXTS[0], "sentences": sentences}}
    got = post(server, "/similarity", body)
    assert got.status_code == 200, got.text
    vectors = np.array(post(server, "/embed", {"inputs": [TEXTS[0], *sentences]}).json())
    np.testing.assert_allclose(got.json(), vectors[1:] @ vectors[0], atol=1e-6)
    empty = post(server, "/similarity", {"inputs": {"source_sentence": "a", "sentences": []}})
    assert empty.status_code == 400 and "'inputs.sentences' is empty" in empty.json()["error"]


def test_tei_routes_are_counted_by_endpoint(server):
    assert post(server, "/embed", {"inputs": "counted"}).status_code == 200
    before = server.metric("mha_requests_total", endpoint="embed", status="200")
    assert post(server, "/embed", {"inputs": "counted"}).status_code == 200
    assert server.metric("mha_requests_total", endpoint="embed", status="200") == before + 1
