"""The unmodified `openai` client against a real server on all-MiniLM-L6-v2: embeddings from
strings and from token ids, /v1/models, and errors readable as `e.message` / `e.body` (OpenAI's
error shape on /v1 only; the OIP routes keep `{"error": "..."}`)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.service.test_embeddings import minilm_dir
from tests.support import Server, run_server

openai = pytest.importorskip("openai")

NAME = "all-MiniLM-L6-v2"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--model-dir", str(minilm_dir()), "--model-name", NAME]
    with run_server(tmp_path_factory.mktemp("openai"), *args, env={"MHA_API_KEY": KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_strings_and_token_ids_give_the_same_vectors(client):
    texts = ["This is an example sentence", "Each sentence is converted"]
    by_text = client.embeddings.create(model=NAME, input=texts)
    assert [d.index for d in by_text.data] == [0, 1]
    assert len(by_text.data[0].embedding) == 384
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tok.no_padding()  # the file pads to 128 for training
    ids = [e.ids for e in tok.encode_batch(texts)]
    by_ids = client.embeddings.create(model=NAME, input=ids)
    np.testing.assert_allclose(
        [d.embedding for d in by_ids.data], [d.embedding for d in by_text.data], atol=1e-6
    )
    tokens = sum(len(i) for i in ids)  # usage counts the tokens truly run, CLS/SEP included
    assert by_text.usage.prompt_tokens == by_text.usage.total_tokens == tokens
    assert by_ids.usage.prompt_tokens == tokens
    one = client.embeddings.create(model=NAME, input=ids[0])  # a single list of ids
    np.testing.assert_allclose(one.data[0].embedding, by_text.data[0].embedding, atol=1e-6)
    # the openai client's default encoding_format is base64: it decoded it above


def test_models_list_and_object(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert models.data[0].object == "model" and models.data[0].owned_by == "mha-serve"
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert "The model 'gpt-4' does not exist" in info.value.message
    assert info.value.body["param"] == "model"


ERRORS = [
    # (id, kwargs, exception, status, type, param, words)
    ("empty", {"input": [""]}, "BadRequestError", 400, "invalid_request_error", "input",
     "input[0] is an empty string"),
    ("bad id", {"input": [[101, 99999]]}, "BadRequestError", 400, "invalid_request_error", "input",
     "input[0][1] = 99999 is not a token id"),
    ("dimensions", {"input": "a", "dimensions": 64}, "BadRequestError", 400,
     "invalid_request_error", "dimensions", "declares no Matryoshka"),
]  # fmt: skip


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_errors_are_readable_by_the_client(client, case):
    _, kwargs, exc_name, status, kind, param, words = case
    with pytest.raises(getattr(openai, exc_name)) as info:
        client.embeddings.create(model=NAME, **kwargs)
    error = info.value
    assert error.status_code == status
    assert words in error.message, error.message
    assert "{" not in error.message  # the client found error.message, not a raw body dump
    assert error.body["type"] == kind and error.body["param"] == param
    assert error.body["code"] == "bad_input"


def test_wrong_model_and_wrong_key(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="text-embedding-3-small", input="a")
    assert "unknown model 'text-embedding-3-small'" in info.value.message
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as info:
        bad_key.embeddings.create(model=NAME, input="a")
    assert info.value.message == "Error code: 403 - wrong API key"
    assert info.value.body["code"] == "invalid_api_key"


def test_oip_routes_keep_their_error_shape(server):
    """One renderer, keyed by route prefix: /v2 errors stay `{"error": "<string>"}`."""
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.get(f"{server.url}/v2/models/nope", headers=headers, timeout=10)
    assert response.status_code == 404 and isinstance(response.json()["error"], str)
    response = httpx.get(f"{server.url}/v2/models/nope", timeout=10)  # no key: middleware
    assert response.status_code == 401 and isinstance(response.json()["error"], str)
    response = httpx.get(f"{server.url}/v1/models", timeout=10)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_dimensions_over_the_model_size(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=NAME, input="a", dimensions=385)
    assert "'dimensions' is 385, over this model's 384" in info.value.message


def test_matryoshka_model_shortens_and_renormalises(tmp_path, client):
    """The same weights, declared Matryoshka by `truncate_dim` in
    config_sentence_transformers.json: dimensions=128 gives the first 128 coordinates of the full
    vector at unit length."""
    import json

    source = minilm_dir()
    copy = tmp_path / "minilm-matryoshka"
    copy.mkdir()
    for item in source.iterdir():
        (copy / item.name).symlink_to(item)
    config = copy / "config_sentence_transformers.json"
    settings = json.loads(config.read_text())
    config.unlink()
    config.write_text(json.dumps({**settings, "truncate_dim": 128}))
    text = "A man is riding a horse."
    full = np.asarray(client.embeddings.create(model=NAME, input=text).data[0].embedding)
    args = ["--model-dir", str(copy), "--model-name", NAME]
    with run_server(tmp_path, *args) as server:
        short_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        short = short_client.embeddings.create(model=NAME, input=text, dimensions=128)
    got = np.asarray(short.data[0].embedding)
    assert got.shape == (128,)
    np.testing.assert_allclose(got, full[:128] / np.linalg.norm(full[:128]), atol=1e-6)
