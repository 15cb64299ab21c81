"""Several text models on one real server, each reached through its own mount
(/models/{name}/...): the unmodified huggingface_hub InferenceClient's text_classification and
feature_extraction against an embedding model, a classifier and a reranker served together, with
transformers' numbers; TEI's /health, SageMaker's /ping and /invocations, open probes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.service.test_text_routing import PASSAGES, QUERY, TOL, logits, mean_pooled, models
from tests.support import Server, run_server

pytest.importorskip("transformers")
hub = pytest.importorskip("huggingface_hub")

KEY = "mount-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
__all__ = ["models"]  # the fixture: three tiny text models (emb, clf, rr) built offline


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, models) -> Iterator[Server]:
    dirs = [str(directory) for _, directory in models.values()]
    args = [arg for d in dirs for arg in ("--model-dir", d)]
    root = tmp_path_factory.mktemp("mounts")
    with run_server(root, *args, "--grpc-port", "0", env={"MHA_API_KEY": KEY}) as s:
        yield s


@pytest.fixture
def inference_client(monkeypatch):
    # Other tests set HF_HUB_OFFLINE (no downloads); these clients only talk to 127.0.0.1.
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    return lambda url: hub.InferenceClient(base_url=url, api_key=KEY)


def post(server: Server, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def test_inference_client_reaches_each_model_through_its_mount(server, models, inference_client):
    (emb, emb_dir), (clf, clf_dir), (rr, rr_dir) = models.values()
    got = inference_client(f"{server.url}/models/emb").feature_extraction(PASSAGES[0])
    want = mean_pooled(emb, emb_dir, PASSAGES[:1])
    np.testing.assert_allclose(np.asarray(got).reshape(1, -1), want, **TOL)

    labels = inference_client(f"{server.url}/models/clf").text_classification("good movie")
    want = softmax(logits(clf, clf_dir, ["good movie"], pairs=False)[0])
    names = clf.config.id2label
    assert [x.label for x in labels] == [names[int(i)] for i in np.argsort(-want, kind="stable")]
    np.testing.assert_allclose([x.score for x in labels], np.sort(want)[::-1], **TOL)

    (score,) = inference_client(f"{server.url}/models/rr").text_classification("good movie")
    raw = logits(rr, rr_dir, ["good movie"], pairs=False)[0, 0].astype(np.float64)
    assert score.label == "score"
    np.testing.assert_allclose(score.score, 1 / (1 + np.exp(-raw)), **TOL)


def test_each_mount_serves_its_model_routes_and_refuses_others(server, models):
    (_, _), (_, _), (rr, rr_dir) = models.values()
    ranked = post(server, "/models/rr/rerank", {"query": QUERY, "texts": PASSAGES})
    assert ranked.status_code == 200, ranked.text
    raw = logits(rr, rr_dir, [(QUERY, p) for p in PASSAGES], pairs=True)[:, 0]
    want = 1 / (1 + np.exp(-raw.astype(np.float64)))
    assert [r["index"] for r in ranked.json()] == list(np.argsort(-want, kind="stable"))
    embed = post(server, "/models/emb/embed", {"inputs": PASSAGES})
    assert embed.json() == post(server, "/embed", {"inputs": PASSAGES}).json()
    info = httpx.get(f"{server.url}/models/clf/info", headers=AUTH, timeout=10).json()
    assert info["model_id"] == "clf" and "classifier" in info["model_type"]

    wrong = post(server, "/models/emb/rerank", {"query": QUERY, "texts": PASSAGES})
    assert wrong.status_code == 424
    assert wrong.json()["error_type"] == "Backend"
    assert "'emb' is an embedding model, which offers /embed" in wrong.json()["error"]
    unknown = post(server, "/models/nope/embed", {"inputs": "a"})
    assert unknown.status_code == 404
    assert "unknown model 'nope'" in unknown.json()["error"]
    assert unknown.json()["error_type"] == "Validation"
    bad = post(server, "/models/clf/predict", {"inputs": "a", "colour": 1})
    assert bad.status_code == 400 and "colour" in bad.json()["error"]


def test_invocations_route_by_the_models_kind(server):
    body = {"inputs": PASSAGES[:2]}
    assert post(server, "/invocations", body).json() == post(server, "/embed", body).json()
    for path in ("/models/emb/invocations", "/models/emb/"):
        assert post(server, path, body).json() == post(server, "/embed", body).json()
    single = {"inputs": "good movie"}
    predicted = post(server, "/models/clf/invocations", single)
    assert predicted.json() == post(server, "/models/clf/predict", single).json()
    ranks = {"query": QUERY, "texts": PASSAGES}
    reranked = post(server, "/models/rr/invocations", ranks)
    assert reranked.json() == post(server, "/models/rr/rerank", ranks).json()
    assert all("text" not in r for r in reranked.json())
    wrong = post(server, "/models/rr/invocations", single)  # a reranker takes query + texts
    assert wrong.status_code == 400 and "query" in wrong.json()["error"]


def test_health_and_ping_are_open_probes(server):
    for path in ("/health", "/ping"):
        response = httpx.get(f"{server.url}{path}", timeout=10)  # no API key
        assert response.status_code == 200  # TEI's clients read the status; infinity's the body
        assert set(response.json()) == {"unix"} and abs(response.json()["unix"] - time.time()) < 60
        assert httpx.head(f"{server.url}{path}", timeout=10).status_code == 200
    per_model = httpx.get(f"{server.url}/models/rr/health", headers=AUTH, timeout=10)
    assert per_model.status_code == 200
    assert httpx.get(f"{server.url}/models/rr/health", timeout=10).status_code == 401
    missing = httpx.get(f"{server.url}/models/nope/health", headers=AUTH, timeout=10)
    assert missing.status_code == 404 and "unknown model 'nope'" in missing.json()["error"]
    assert httpx.post(f"{server.url}/invocations", json={}, timeout=10).status_code == 401
