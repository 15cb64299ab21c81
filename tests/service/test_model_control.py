"""--model-control-mode explicit on a real server: Triton's repository index, load and unload
over HTTP and gRPC (unmodified tritonclient), while another model serves under load."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from torch import nn
from tritonclient.utils import InferenceServerException

import mha_engine
from tests.support import FP32_TOL, Server, free_port, run_server


def _encoder() -> nn.TransformerEncoderLayer:
    torch.manual_seed(11)
    return nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True).eval()


ENCODER = _encoder()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str, Path]]:
    root = tmp_path_factory.mktemp("control")
    repo = root / "repository"
    torch.manual_seed(2)
    mha_engine.save_model(nn.MultiheadAttention(48, 4, batch_first=True), repo / "attn" / "1")
    mha_engine.save_model(ENCODER, repo / "enc" / "1")
    port = free_port()
    args = ("--model-repository", str(repo), "--model-control-mode", "explicit")
    with run_server(root, *args, "--grpc-port", str(port)) as http:
        yield http, f"127.0.0.1:{port}", repo


class Traffic:
    """Requests to `attn` over HTTP and gRPC, back to back on two threads, until stopped."""

    def __init__(self, http: Server, address: str) -> None:
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        x = np.ones((1, 8, 48), np.float32)
        self.threads = [
            threading.Thread(target=self._loop, args=(thttp, http.address, x)),
            threading.Thread(target=self._loop, args=(tgrpc, address, x)),
        ]

    def _loop(self, module, address: str, x: np.ndarray) -> None:
        client = module.InferenceServerClient(address)
        item = module.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        while not self.stop.is_set():
            try:
                assert client.infer("attn", [item]).as_numpy("output").shape == x.shape
                self.ok += 1
            except Exception as exc:
                self.failures.append(repr(exc))

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


def _states(client) -> dict[str, str]:
    return {row["name"]: row["state"] for row in client.get_model_repository_index()}


def test_index_lists_every_model_and_the_extension_is_offered(server) -> None:
    http, address, _ = server
    client = thttp.InferenceServerClient(http.address)
    assert _states(client) == {"attn": "READY", "enc": "READY"}
    assert "model_repository" in client.get_server_metadata()["extensions"]
    index = tgrpc.InferenceServerClient(address).get_model_repository_index(as_json=True)
    assert {m["name"]: m["state"] for m in index["models"]} == {"attn": "READY", "enc": "READY"}


def test_unload_and_load_while_another_model_serves(server) -> None:
    http, address, _ = server
    client = thttp.InferenceServerClient(http.address)
    grpc_client = tgrpc.InferenceServerClient(address)
    x = np.random.default_rng(0).standard_normal((2, 5, 32)).astype(np.float32)
    item = thttp.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    with Traffic(http, address) as traffic:
        client.unload_model("enc")
        assert _states(client) == {"attn": "READY", "enc": "UNAVAILABLE"}
        with pytest.raises(InferenceServerException) as info:
            grpc_client.get_model_metadata("enc")
        assert info.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(InferenceServerException, match="unknown model 'enc'"):
            client.infer("enc", [item])
        with pytest.raises(InferenceServerException) as info:
            grpc_client.unload_model("enc")
        assert info.value.status() == "StatusCode.NOT_FOUND"
        grpc_client.load_model("enc")  # over gRPC this time
        assert _states(client) == {"attn": "READY", "enc": "READY"}
        got = client.infer("enc", [item]).as_numpy("output")
        client.load_model("attn")  # a reload: the new copy replaces the old, which drains
    assert traffic.failures == [] and traffic.ok > 0, traffic.failures[:3]
    torch.testing.assert_close(
        torch.from_numpy(np.array(got)), ENCODER(torch.from_numpy(x)).detach(), **FP32_TOL
    )


def test_a_bad_model_fails_its_load_and_the_server_goes_on(server) -> None:
    http, address, repo = server
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "config.json").write_text(json.dumps({"architecture": "nope"}))
    client = thttp.InferenceServerClient(http.address)
    assert _states(client)["broken"] == "UNAVAILABLE"
    with pytest.raises(InferenceServerException, match="loading model 'broken' failed"):
        client.load_model("broken")
    with pytest.raises(InferenceServerException) as info:
        tgrpc.InferenceServerClient(address).load_model("broken")
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as info:
        client.load_model("missing")
    assert info.value.status() == "404"
    item = thttp.InferInput("input", [1, 3, 48], "FP32")
    item.set_data_from_numpy(np.ones((1, 3, 48), np.float32))
    assert client.infer("attn", [item]).as_numpy("output").shape == (1, 3, 48)
    (repo / "broken" / "1" / "config.json").unlink()
    (repo / "broken" / "1").rmdir()
    (repo / "broken").rmdir()


def test_the_last_model_is_not_unloaded(server) -> None:
    http, _, _ = server
    client = thttp.InferenceServerClient(http.address)
    client.unload_model("enc")
    try:
        with pytest.raises(InferenceServerException, match="only model loaded"):
            client.unload_model("attn")
    finally:
        client.load_model("enc")
