"""POST /v1/embeddings on the real all-MiniLM-L6-v2 directory, over real HTTP.

Vectors equal sentence-transformers' recipe (transformers BertModel + mean pooling + normalise,
computed here) to cosine >= 0.99999; requests larger than a batch are split and keep order;
long inputs are truncated and reported; bad input gets a 4xx naming the problem; metrics count
the endpoint; the tensor API and the attention debug endpoint serve the same BERT model.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import mha_engine
from tests.support import Server, fp32_request, run_server

NAME = "all-MiniLM-L6-v2"
MAX_BATCH = 8  # small, so a 20-input request needs three batcher works
MAX_QUEUE = 64
CARD_SENTENCES = ["This is an example sentence", "Each sentence is converted"]
MORE_SENTENCES = [
    "The weather is lovely today.",
    "It's so sunny outside!",
    "He drove to the stadium.",
    "A man is eating food.",
    "A man is riding a horse on a dirt road, far away from any city lights.",
    "Quantum chromodynamics describes the strong interaction between quarks and gluons.",
]


def minilm_dir() -> Path:
    """The installed package's model directory; skip (fail under CI) when it is missing."""
    from service.text.tokenizer import MINILM_PIP, minilm_path

    path = minilm_path()
    if path is None:
        message = f"all-MiniLM-L6-v2 is not installed ({MINILM_PIP})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def minilm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = minilm_dir()
    args = ["--model-dir", str(path), "--model-name", NAME, "--debug-endpoint"]
    args += ["--max-batch-size", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE)]
    with run_server(tmp_path_factory.mktemp("minilm"), *args) as server:
        yield server


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' numbers without it: BertModel, mean pooling, L2 normalise."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the hub
    transformers = pytest.importorskip("transformers")
    path = str(minilm_dir())
    model = transformers.BertModel.from_pretrained(path, add_pooling_layer=False).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)

    def embed(texts: list[str]) -> tuple[np.ndarray, list[int]]:
        batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        vectors = torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()
        return vectors, batch["attention_mask"].sum(1).tolist()

    return embed


def post(server: Server, body: object, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60, **kwargs)


def vectors_of(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.asarray([d["embedding"] for d in data], dtype=np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_model_card_sentences_match_sentence_transformers(minilm_server, reference):
    texts = CARD_SENTENCES + MORE_SENTENCES
    response = post(minilm_server, {"input": texts, "model": NAME})
    body = response.json()
    assert body["object"] == "list" and body["model"] == NAME
    assert all(d["object"] == "embedding" for d in body["data"])
    got = vectors_of(response)
    want, lengths = reference(texts)
    assert got.shape == (len(texts), 384)
    assert cosine(got, want).min() >= 0.99999
    assert body["usage"] == {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}
    assert "x-truncated-inputs" not in response.headers

    single = post(minilm_server, {"input": CARD_SENTENCES[0], "model": NAME})  # a bare string
    assert cosine(vectors_of(single), want[:1]).min() >= 0.99999


def test_large_requests_are_split_and_keep_order(minilm_server):
    texts = [f"{s} (variant {i})" for i, s in enumerate((MORE_SENTENCES * 4)[:20])]
    before = minilm_server.metric("mha_sequences_processed_total", model=NAME)
    batches_before = minilm_server.metric("mha_batches_total", model=NAME, outcome="ok")
    whole = vectors_of(post(minilm_server, {"input": texts, "model": NAME}))
    after = minilm_server.metric("mha_sequences_processed_total", model=NAME)
    batches = minilm_server.metric("mha_batches_total", model=NAME, outcome="ok") - batches_before
    assert after - before == len(texts)
    assert batches >= 3  # 20 inputs with --max-batch-size 8
    # Concurrent single-input requests (batched with each other) give the same vectors.
    with ThreadPoolExecutor(8) as pool:
        singles = list(
            pool.map(lambda t: post(minilm_server, {"input": [t], "model": NAME}), texts)
        )
    alone = np.concatenate([vectors_of(r) for r in singles])
    np.testing.assert_allclose(whole, alone, atol=2e-6, rtol=0)


def test_long_input_is_truncated_and_reported(minilm_server, reference):
    long_text = " ".join(["tokenization"] * 400)  # far beyond 256 tokens
    texts = ["short one", long_text]
    response = post(minilm_server, {"input": texts, "model": NAME})
    assert response.headers["x-truncated-inputs"] == "1"
    want, lengths = reference(texts)
    assert lengths[1] == 256
    assert response.json()["usage"]["prompt_tokens"] == sum(lengths)
    assert cosine(vectors_of(response), want).min() >= 0.99999


def test_base64_encoding_carries_the_same_floats(minilm_server):
    floats = vectors_of(post(minilm_server, {"input": CARD_SENTENCES, "model": NAME}))
    response = post(
        minilm_server, {"input": CARD_SENTENCES, "model": NAME, "encoding_format": "base64"}
    )
    assert response.status_code == 200, response.text
    decoded = [
        np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        for d in response.json()["data"]
    ]
    np.testing.assert_array_equal(np.stack(decoded), floats)


BAD = [
    # (id, body, status, words the error must contain)
    ("empty list", {"input": [], "model": NAME}, 400, "empty list"),
    ("empty string", {"input": "", "model": NAME}, 400, "input[0] is an empty string"),
    ("empty item", {"input": ["a", ""], "model": NAME}, 400, "input[1] is an empty string"),
    ("number item", {"input": ["a", 3], "model": NAME}, 400, "input[1] is an integer"),
    ("null item", {"input": [None], "model": NAME}, 400, "input[0] is null"),
    ("nested list", {"input": [["a"]], "model": NAME}, 400, "input[0][0] = 'a' is not a token"),
    ("id over vocab", {"input": [101, 30522], "model": NAME}, 400, "input[0][1] = 30522"),
    ("negative id", {"input": [[101], [-1]], "model": NAME}, 400, "input[1][0] = -1"),
    ("too many ids", {"input": [[101] * 257], "model": NAME}, 400, "context length is 256"),
    ("empty ids", {"input": [[101], []], "model": NAME}, 400, "input[1] must be a non-empty"),
    ("object input", {"input": {"a": 1}, "model": NAME}, 400, "got an object"),
    ("too many", {"input": ["a"] * (MAX_QUEUE + 1), "model": NAME}, 400, "at most 64"),
    ("no input", {"model": NAME}, 400, "'input' is required"),
    ("no model", {"input": "a"}, 400, "'model' is required"),
    ("wrong model", {"input": "a", "model": "gpt-4"}, 404, "unknown model 'gpt-4'"),
    ("format", {"input": "a", "model": NAME, "encoding_format": "int8"}, 400, "encoding_format"),
    ("dimensions", {"input": "a", "model": NAME, "dimensions": 128}, 400, "must be 384"),
    ("unknown field", {"input": "a", "model": NAME, "temperature": 1}, 400, "['temperature']"),
    ("not an object", ["a"], 400, "must be a JSON object"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_gets_4xx_naming_the_problem(minilm_server, case):
    _, body, status, words = case
    response = post(minilm_server, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]  # OpenAI's shape on /v1
    assert words in error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_malformed_json_and_metrics(minilm_server):
    before = minilm_server.metric("mha_requests_total", endpoint="embeddings", status="400")
    response = httpx.post(
        f"{minilm_server.url}/v1/embeddings",
        content=b'{"input": [',
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    after = minilm_server.metric("mha_requests_total", endpoint="embeddings", status="400")
    assert after == before + 1
    failures = minilm_server.metric(
        "mha_request_failures_total", endpoint="embeddings", reason="bad_input"
    )
    assert failures >= 1
    assert minilm_server.metric("mha_requests_total", endpoint="embeddings", status="200") >= 1
    assert httpx.get(f"{minilm_server.url}/v2/health/ready", timeout=10).status_code == 200


def test_tensor_api_and_attention_debug_serve_the_bert_encoder(minilm_server):
    """/v2 infer takes hidden states [B, T, 384] through the six encoder layers; the debug
    endpoint gives the attention weights of one layer or of all six."""
    model = mha_engine.load_model(minilm_dir(), device="cpu")
    hidden = np.random.default_rng(0).standard_normal((2, 5, 384)).astype(np.float32)
    content, headers = fp32_request(hidden)
    response = httpx.post(
        f"{minilm_server.url}/v2/models/{NAME}/infer", content=content, headers=headers, timeout=60
    )
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    got = np.frombuffer(response.content[length:], dtype=np.float32).reshape(2, 5, 384)
    want = model(torch.from_numpy(hidden)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1.3e-6)

    def weights(**parameters) -> list[int]:
        body = {
            "inputs": [
                {"name": "input", "shape": [1, 5, 384], "datatype": "FP32",
                 "data": hidden[0].ravel().tolist()}
            ],
            "outputs": [{"name": "attention_weights"}],
            "parameters": parameters,
        }  # fmt: skip
        r = httpx.post(f"{minilm_server.url}/v2/models/{NAME}/attention", json=body, timeout=60)
        assert r.status_code == 200, r.text
        [out] = r.json()["outputs"]
        return out["shape"]

    assert weights(layer=3) == [1, 12, 5, 5]
    assert weights() == [6, 1, 12, 5, 5]


def test_model_without_tokenizer_refuses_embeddings(demo_server):
    response = post(demo_server, {"input": "hello", "model": "mha"})
    assert response.status_code == 400
    assert "has no tokenizer" in response.json()["error"]["message"]


def test_model_path_helper_prints_the_directory():
    import subprocess
    import sys

    path = minilm_dir()
    out = subprocess.run(
        [sys.executable, "-m", "service.text"], capture_output=True, text=True, check=True
    )
    assert Path(out.stdout.strip()) == path
    assert (path / "tokenizer.json").is_file() and (path / "model.safetensors").is_file()
