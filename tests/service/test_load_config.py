"""Load with a configuration (--model-control-mode explicit) on a real server, with the
unmodified tritonclient over HTTP and gRPC: the config overrides the model's mha-serve.json for
that load (batching limits, delay, queue, dtype, optional inputs, version policy), the next plain
load goes back to the file, and a bad config is refused naming the field (400 /
INVALID_ARGUMENT) with nothing changed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from torch import nn
from tritonclient.utils import InferenceServerException

import mha_engine
from tests.support import Server, free_port, run_server

EMBED_DIM = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    root = tmp_path_factory.mktemp("load-config")
    repo = root / "repository"
    torch.manual_seed(5)
    for version in (1, 2):
        mha_engine.save_model(
            nn.MultiheadAttention(EMBED_DIM, 4, batch_first=True), repo / "attn" / str(version)
        )
    (repo / "attn" / "mha-serve.json").write_text(json.dumps({"max_batch_size": 8}))
    port = free_port()
    args = ("--model-repository", str(repo), "--model-control-mode", "explicit")
    with run_server(root, *args, "--grpc-port", str(port)) as http:
        yield http, f"127.0.0.1:{port}"


@pytest.fixture
def clients(server) -> Iterator[tuple[thttp.InferenceServerClient, tgrpc.InferenceServerClient]]:
    http, address = server
    h = thttp.InferenceServerClient(http.address, network_timeout=120)
    yield h, tgrpc.InferenceServerClient(address)
    h.load_model("attn")  # back to mha-serve.json for the next test


def _batching(client: thttp.InferenceServerClient) -> tuple[int, int]:
    config = client.get_model_config("attn")
    return config["max_batch_size"], config["dynamic_batching"]["max_queue_delay_microseconds"]


def _infer(client: thttp.InferenceServerClient) -> np.ndarray:
    x = np.ones((1, 3, EMBED_DIM), np.float32)
    item = thttp.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    return client.infer("attn", [item]).as_numpy("output")


def test_config_overrides_the_file_for_that_load_only(clients):
    h, g = clients
    assert _batching(h) == (8, 2000)  # mha-serve.json's max_batch_size, the server's delay
    config = {"max_batch_size": 4, "dynamic_batching": {"max_queue_delay_microseconds": 500}}
    h.load_model("attn", config=json.dumps(config))
    assert _batching(h) == (4, 500)
    g.load_model("attn", config=json.dumps({"max_batch_delay_ms": 0.25, "max_queue": 64}))
    assert _batching(h) == (8, 250)  # a new config: over the file, not over the last config
    assert _infer(h).shape == (1, 3, EMBED_DIM)
    h.load_model("attn")  # no config: the file again
    assert _batching(h) == (8, 2000)


def test_config_can_leave_out_the_optional_inputs(clients):
    """optional_inputs false for one load: config and metadata list `input` only and a mask is
    refused naming it; the next plain load declares them again."""
    h, g = clients
    g.load_model("attn", config=json.dumps({"optional_inputs": False}))
    assert [i["name"] for i in h.get_model_config("attn")["input"]] == ["input"]
    assert [i.name for i in g.get_model_metadata("attn").inputs] == ["input"]
    x, mask = np.ones((1, 3, EMBED_DIM), np.float32), np.zeros((1, 3), bool)
    items = [thttp.InferInput("input", list(x.shape), "FP32"),
             thttp.InferInput("key_padding_mask", list(mask.shape), "BOOL")]  # fmt: skip
    items[0].set_data_from_numpy(x)
    items[1].set_data_from_numpy(mask)
    with pytest.raises(InferenceServerException) as info:
        h.infer("attn", items)
    assert info.value.status() == "400" and "['key_padding_mask'] not accepted" in str(info.value)
    assert _infer(h).shape == (1, 3, EMBED_DIM)
    h.load_model("attn")
    names = [i["name"] for i in h.get_model_metadata("attn")["inputs"]]
    assert names == ["input", "key", "value", "key_padding_mask"]
    assert h.infer("attn", items).as_numpy("output").shape == (1, 3, EMBED_DIM)


def test_config_version_policy_and_dtype(clients):
    h, g = clients
    assert h.get_model_metadata("attn")["versions"] == ["2"]
    g.load_model("attn", config=json.dumps({"version_policy": {"all": {}}, "dtype": "bfloat16"}))
    meta = h.get_model_metadata("attn")
    assert meta["versions"] == ["1", "2"]
    assert meta["inputs"][0]["datatype"] == "BF16"
    assert h.is_model_ready("attn", "1") and h.is_model_ready("attn", "2")
    h.load_model("attn")
    assert h.get_model_metadata("attn")["versions"] == ["2"]
    assert not h.is_model_ready("attn", "1")


BAD = [
    ({"max_batch_size": 0}, "model 'attn' load config: max_batch_size: Input should be greater"),
    ({"max_batch_size": 64, "max_queue": 32}, "max_queue (32) must be >= max_batch_size (64)"),
    ({"dtype": "float64"}, "dtype: Input should be"),
    ({"input": []}, "unsupported field(s) ['config.input']"),
    ({"threads": 2}, "unsupported field(s) ['config.threads']"),
    ({"name": "other"}, "'name' is 'other'; it must be 'attn'"),
    ({"dynamic_batching": {"max_queue_delay_microseconds": -1}},
     "'dynamic_batching.max_queue_delay_microseconds' must be an integer >= 0"),
    ({"dynamic_batching": {"preferred_batch_size": [4]}},
     "unsupported field(s) ['dynamic_batching.preferred_batch_size']"),
    ({"max_queue": 64, "dynamic_batching": {"default_queue_policy": {"max_queue_size": 9}}},
     "sets ['max_queue'] twice"),
    ({"version_policy": {"specific": {"versions": [9]}}}, "names version(s) [9] that have no"),
    ({"version_policy": {"newest": {}}}, "version_policy {\"newest\": {}} is not valid"),
    ({"optional_inputs": "maybe"}, "optional_inputs: Input should be a valid boolean"),
]  # fmt: skip


@pytest.mark.parametrize("config, words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_config_is_refused_naming_the_field(clients, config, words):
    h, g = clients
    with pytest.raises(InferenceServerException) as info:
        h.load_model("attn", config=json.dumps(config))
    assert info.value.status() == "400" and words in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        g.load_model("attn", config=json.dumps(config))
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert words in info.value.message()
    assert _batching(h) == (8, 2000)  # nothing changed
    assert h.get_model_metadata("attn")["versions"] == ["2"]


def test_config_must_be_a_json_object_string_and_files_are_refused(server, clients):
    http, _ = server
    h, g = clients
    with pytest.raises(InferenceServerException, match="'config' parameter is not valid JSON"):
        h.load_model("attn", config="{max_batch_size: 4")
    with pytest.raises(InferenceServerException, match="'config' must be a JSON object"):
        g.load_model("attn", config="[1, 2]")
    url = f"{http.url}/v2/repository/models/attn/load"
    response = httpx.post(url, json={"parameters": {"config": {"max_batch_size": 4}}})
    assert response.status_code == 400
    assert "'config' parameter must be a JSON string, got dict" in response.json()["error"]
    files = {"config": "{}", "file:1/model.safetensors": "AAAA"}
    response = httpx.post(url, json={"parameters": files})
    assert response.status_code == 400
    assert "['file:1/model.safetensors'] are not supported" in response.json()["error"]
    with pytest.raises(InferenceServerException) as info:
        g.load_model("attn", config="{}", files={"1/model.safetensors": b"x"})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
