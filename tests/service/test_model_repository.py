"""Several models in one server: a Triton-style repository plus --model-dir, each model with its
own batcher, statistics and metrics label, over HTTP and gRPC with the unmodified tritonclient."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from torch import nn

import mha_engine
from service.__main__ import parse_settings
from service.runtime.repository import RepositoryError, model_settings, model_sources
from tests.support import FP32_TOL, ROOT, Server, free_port, run_server


def _mha(embed_dim: int, heads: int, seed: int) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    return nn.MultiheadAttention(embed_dim, heads, batch_first=True).eval()


def _encoder(seed: int) -> nn.TransformerEncoderLayer:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
    return layer.eval()


def _run(module: nn.Module, x: np.ndarray) -> torch.Tensor:
    q = torch.from_numpy(x)
    if isinstance(module, nn.MultiheadAttention):
        return module(q, q, q, need_weights=False)[0].detach()
    return module(q).detach()


# -- which models are served ------------------------------------------------------------------
def test_repository_serves_each_model_at_its_latest_version(tmp_path: Path) -> None:
    for model, versions in (("b", ["1", "10", "2", "notes"]), ("a", ["003"])):
        for version in versions:
            (tmp_path / model / version).mkdir(parents=True)
    (tmp_path / "README.md").write_text("not a model")
    settings = parse_settings(["--model-repository", str(tmp_path)])
    sources = model_sources(settings)
    assert [(s.name, s.version, s.path) for s in sources] == [
        ("a", "3", tmp_path / "a" / "003"),
        ("b", "10", tmp_path / "b" / "10"),
    ]


def test_model_dir_repeats_and_names_must_be_unique(tmp_path: Path) -> None:
    settings = parse_settings(["--model-dir", "/m/x", "--model-dir", "/m/y"])
    assert [(s.name, str(s.path)) for s in model_sources(settings)] == [
        ("x", "/m/x"),
        ("y", "/m/y"),
    ]
    (tmp_path / "x" / "1").mkdir(parents=True)
    clash = parse_settings(["--model-dir", "/m/x", "--model-repository", str(tmp_path)])
    with pytest.raises(RepositoryError, match="x"):
        model_sources(clash)
    with pytest.raises(RepositoryError, match="--model-name"):
        model_sources(parse_settings(["--model-dir", "/m/x,/m/y", "--model-name", "z"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RepositoryError, match="no version directory"):
        model_sources(parse_settings(["--model-repository", str(tmp_path)]))


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_beam": 3}, "unknown setting(s) ['max_beam']"),
        ({"version_policy": {"newest": {}}}, 'use one of {"latest": {"num_versions": N}}'),
        ({"version_policy": {"all": {}, "latest": {}}}, "is not valid"),
        ({"version_policy": {"latest": {"num_versions": 0}}}, "num_versions must be an integer"),
        ({"version_policy": {"specific": {"versions": []}}}, "must be a non-empty list"),
        ({"version_policy": {"specific": {"versions": [1, 2]}}}, "version(s) [2] that have no"),
        ({"max_seq_len": 99999}, "max_batch_tokens"),  # the server's own cross-field check
        ({"optional_inputs": "maybe"}, "optional_inputs: Input should be a valid boolean"),
        ({"batch_delay_policy": "sometimes"}, "batch_delay_policy: Input should be 'adaptive'"),
        ([1, 2], "JSON object"),
    ],
)
def test_a_models_settings_file_is_checked_at_start(tmp_path: Path, content, fragment) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "mha-serve.json").write_text(json.dumps(content))
    with pytest.raises(RepositoryError) as info:
        model_sources(parse_settings(["--model-repository", str(tmp_path)]))
    assert fragment in str(info.value)


def test_a_bad_repository_stops_the_server_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "lonely").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "service", "--model-repository", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "'lonely'" in result.stderr and "Traceback" not in result.stderr


def test_a_models_settings_file_sets_its_batch_delay_policy(tmp_path: Path) -> None:
    """batch_delay_policy is a model's own setting, like max_batch_delay_ms."""
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "mha-serve.json").write_text(json.dumps({"batch_delay_policy": "fixed"}))
    settings = parse_settings(["--model-repository", str(tmp_path)])
    (source,) = model_sources(settings)
    assert settings.batch_delay_policy == "adaptive"
    assert model_settings(settings, source).batch_delay_policy == "fixed"


# -- a real server with three models -------------------------------------------------------------
MODULES = {
    "attn": _mha(48, 4, seed=3),  # version 3 of the repository's attn
    "enc": _encoder(seed=5),
    "extra": _mha(16, 2, seed=7),  # from --model-dir
}
WIDTH = {"attn": 48, "enc": 32, "extra": 16}
ENC_SETTINGS = {"max_batch_size": 4, "max_batch_delay_ms": 5, "max_seq_len": 64}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    root = tmp_path_factory.mktemp("repo")
    mha_engine.save_model(_mha(48, 4, seed=1), root / "repository" / "attn" / "1")
    mha_engine.save_model(MODULES["attn"], root / "repository" / "attn" / "3")
    mha_engine.save_model(MODULES["enc"], root / "repository" / "enc" / "1")
    (root / "repository" / "enc" / "mha-serve.json").write_text(json.dumps(ENC_SETTINGS))
    mha_engine.save_model(MODULES["extra"], root / "extra")
    port = free_port()
    args = ("--model-repository", str(root / "repository"), "--model-dir", str(root / "extra"))
    with run_server(root, *args, "--grpc-port", str(port)) as http:
        yield http, f"127.0.0.1:{port}"


def _http_infer(server: Server, model: str, x: np.ndarray, version: str = "") -> np.ndarray:
    item = thttp.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    client = thttp.InferenceServerClient(server.address)
    return client.infer(model, [item], model_version=version).as_numpy("output")


def _grpc_infer(address: str, model: str, x: np.ndarray) -> np.ndarray:
    item = tgrpc.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    return tgrpc.InferenceServerClient(address).infer(model, [item]).as_numpy("output")


def test_every_model_has_its_metadata_and_config(server) -> None:
    http, address = server
    client, grpc_client = (
        thttp.InferenceServerClient(http.address),
        tgrpc.InferenceServerClient(address),
    )
    for name, width in WIDTH.items():
        assert client.is_model_ready(name) and grpc_client.is_model_ready(name)
        meta = client.get_model_metadata(name)
        assert meta["inputs"][0]["shape"] == [-1, -1, width]
        assert meta["versions"] == (["3"] if name == "attn" else ["1"])
        config = grpc_client.get_model_config(name).config
        assert (config.name, list(config.input[0].dims)) == (name, [-1, width])
    info = {s: http.metric("mha_model_info", model=s) for s in WIDTH}
    assert info == dict.fromkeys(WIDTH, 1.0)


def test_each_model_computes_its_own_numbers_over_both_protocols(server) -> None:
    http, address = server
    for i, (name, module) in enumerate(MODULES.items()):
        x = np.random.default_rng(i).standard_normal((2, 7, WIDTH[name])).astype(np.float32)
        want = _run(module, x)
        for got in (_http_infer(http, name, x), _grpc_infer(address, name, x)):
            torch.testing.assert_close(torch.from_numpy(np.array(got)), want, **FP32_TOL)
    x = np.zeros((1, 2, 48), np.float32)
    assert _http_infer(http, "attn", x, version="3").shape == (1, 2, 48)
    with pytest.raises(Exception, match="no version '1'"):
        _http_infer(http, "attn", x, version="1")


def test_statistics_and_metrics_are_per_model(server) -> None:
    http, address = server
    client = thttp.InferenceServerClient(http.address)

    def counts() -> dict[str, int]:
        stats = client.get_inference_statistics()["model_stats"]
        return {s["name"]: s["inference_count"] for s in stats}

    before = counts()
    requests = http.metric("mha_requests_total", model="enc", protocol="grpc", status="200")
    sequences = http.metric("mha_sequences_processed_total", model="extra")
    _grpc_infer(address, "enc", np.ones((3, 4, 32), np.float32))
    _http_infer(http, "extra", np.ones((2, 4, 16), np.float32))
    after = counts()
    assert set(after) == set(WIDTH)
    assert {k: after[k] - before[k] for k in after} == {"attn": 0, "enc": 3, "extra": 2}
    assert (
        http.metric("mha_requests_total", model="enc", protocol="grpc", status="200")
        == requests + 1
    )
    assert http.metric("mha_sequences_processed_total", model="extra") == sequences + 2
    grpc_stats = tgrpc.InferenceServerClient(address).get_inference_statistics("enc")
    assert [s.name for s in grpc_stats.model_stats] == ["enc"]


def test_a_models_settings_file_sets_its_own_limits(server) -> None:
    http, address = server
    client = thttp.InferenceServerClient(http.address)
    enc, attn = client.get_model_config("enc"), client.get_model_config("attn")
    assert enc["max_batch_size"] == 4 and attn["max_batch_size"] == 32
    assert enc["dynamic_batching"] == {
        "preferred_batch_size": [4],
        "max_queue_delay_microseconds": 5000,
    }
    assert http.metric("mha_queue_capacity_sequences", model="enc") == 1024
    with pytest.raises(Exception, match="at most 4 per request"):
        _grpc_infer(address, "enc", np.ones((5, 2, 32), np.float32))
    with pytest.raises(Exception, match="over the limit of 64"):
        _http_infer(http, "enc", np.ones((1, 65, 32), np.float32))
    assert _http_infer(http, "attn", np.ones((5, 65, 48), np.float32)).shape == (5, 65, 48)


def test_load_and_unload_need_explicit_mode(server) -> None:
    http, address = server
    client = thttp.InferenceServerClient(http.address)
    assert "model_repository" not in client.get_server_metadata()["extensions"]
    states = {row["name"]: row["state"] for row in client.get_model_repository_index()}
    assert states == dict.fromkeys(WIDTH, "READY")
    with pytest.raises(Exception, match="--model-control-mode explicit"):
        client.unload_model("enc")
    with pytest.raises(tgrpc.InferenceServerException) as info:
        tgrpc.InferenceServerClient(address).load_model("enc")
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert client.is_model_ready("enc")
