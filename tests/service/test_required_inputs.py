"""`optional_inputs: false` (mha-serve.json, a load's config, or --no-optional-inputs): the model
configuration and metadata list only the required inputs, a request sending another gets 400 /
INVALID_ARGUMENT naming it, and Triton's perf_analyzer, which refuses optional inputs in its
--shared-memory system mode, measures such a model through system shared memory."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from torch import nn
from tritonclient.utils import InferenceServerException

import mha_engine
from service.__main__ import parse_settings
from tests.inprocess import asgi_client
from tests.service.test_triton_statistics import EMBED_DIM, NAME, measure
from tests.service.test_triton_statistics import input_data as input_data  # a fixture
from tests.service.test_triton_statistics import perf_analyzer as perf_analyzer  # a fixture
from tests.support import FP32_TOL, Server, free_port, run_server

FULL = "full"  # the same kind of model with its optional inputs declared (the default)
HIDDEN = "input(s) ['key_padding_mask'] not accepted"


@pytest.fixture(scope="module")
def module() -> nn.MultiheadAttention:
    torch.manual_seed(11)
    return nn.MultiheadAttention(EMBED_DIM, 4, batch_first=True).eval()


@pytest.fixture(scope="module")
def server(tmp_path_factory, module) -> Iterator[tuple[Server, str]]:
    """NAME with mha-serve.json's optional_inputs false, and FULL without the setting."""
    root = tmp_path_factory.mktemp("required-inputs")
    repo = root / "repository"
    for name in (NAME, FULL):
        mha_engine.save_model(module, repo / name / "1")
    (repo / NAME / "mha-serve.json").write_text(json.dumps({"optional_inputs": False}))
    port = free_port()
    with run_server(root, "--model-repository", str(repo), "--grpc-port", str(port)) as http:
        yield http, f"127.0.0.1:{port}"


def _inputs(x: np.ndarray, mask: np.ndarray | None, kind) -> list:
    items = [kind.InferInput("input", list(x.shape), "FP32")]
    items[0].set_data_from_numpy(x)
    if mask is not None:
        items.append(kind.InferInput("key_padding_mask", list(mask.shape), "BOOL"))
        items[1].set_data_from_numpy(mask)
    return items


def test_config_and_metadata_list_only_the_required_inputs(server) -> None:
    http, address = server
    h, g = thttp.InferenceServerClient(http.address), tgrpc.InferenceServerClient(address)
    assert [i["name"] for i in h.get_model_metadata(NAME)["inputs"]] == ["input"]
    assert [i.name for i in g.get_model_metadata(NAME).inputs] == ["input"]
    (declared,) = h.get_model_config(NAME)["input"]
    assert declared["name"] == "input" and not declared.get("optional", False)
    assert [i.name for i in g.get_model_config(NAME).config.input] == ["input"]
    full = h.get_model_config(FULL)["input"]
    assert [(i["name"], i.get("optional", False)) for i in full] == [
        ("input", False),
        ("key", True),
        ("value", True),
        ("key_padding_mask", True),
    ]


def test_a_hidden_input_is_refused_naming_it_and_the_rest_computes(server, module) -> None:
    http, address = server
    h, g = thttp.InferenceServerClient(http.address), tgrpc.InferenceServerClient(address)
    x = np.random.default_rng(2).standard_normal((2, 5, EMBED_DIM)).astype(np.float32)
    mask = np.zeros((2, 5), bool)
    with pytest.raises(InferenceServerException) as info:
        h.infer(NAME, _inputs(x, mask, thttp))
    assert info.value.status() == "400"
    assert HIDDEN in info.value.message() and "optional_inputs" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        g.infer(NAME, _inputs(x, mask, tgrpc))
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and HIDDEN in info.value.message()
    with torch.no_grad():
        expected = module(*[torch.from_numpy(x)] * 3, need_weights=False)[0].numpy()
    for client, kind in ((h, thttp), (g, tgrpc)):  # the same connection, still usable
        got = client.infer(NAME, _inputs(x, None, kind)).as_numpy("output")
        np.testing.assert_allclose(got, expected, **FP32_TOL)
    assert h.infer(FULL, _inputs(x, mask, thttp)).as_numpy("output").shape == x.shape


def test_the_server_flag_hides_a_decoders_masks(tmp_path) -> None:
    """--no-optional-inputs (Settings.optional_inputs) for every model: a decoder declares tgt
    and memory only and refuses its masks by name."""
    assert parse_settings(["--no-optional-inputs"]).optional_inputs is False
    torch.manual_seed(3)
    layer = nn.TransformerDecoderLayer(16, 4, 32, batch_first=True)
    mha_engine.save_model(nn.TransformerDecoder(layer, 1), tmp_path / "dec")

    async def main() -> None:
        async with asgi_client(model_dir=[tmp_path / "dec"], optional_inputs=False) as client:
            meta = (await client.get("/v2/models/dec")).json()
            assert [i["name"] for i in meta["inputs"]] == ["tgt", "memory"]
            config = (await client.get("/v2/models/dec/config")).json()
            assert [(i["name"], i["optional"]) for i in config["input"]] == [
                ("tgt", False),
                ("memory", False),
            ]
            floats = [{"name": n, "shape": [1, 2, 16], "datatype": "FP32", "data": [0.5] * 32}
                      for n in ("tgt", "memory")]  # fmt: skip
            mask = {"name": "tgt_key_padding_mask", "shape": [1, 2], "datatype": "BOOL",
                    "data": [False, False]}  # fmt: skip
            response = await client.post("/v2/models/dec/infer", json={"inputs": [*floats, mask]})
            assert response.status_code == 400
            assert "['tgt_key_padding_mask'] not accepted" in response.json()["error"]
            response = await client.post("/v2/models/dec/infer", json={"inputs": floats})
            assert response.status_code == 200, response.text

    asyncio.run(main())


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_through_system_shared_memory(
    perf_analyzer, server, input_data, protocol
) -> None:
    """perf_analyzer --shared-memory system for a few bounded seconds: inputs and outputs in
    its own registered regions, rc 0 and a throughput line (measure)."""
    http, address = server
    url = http.address if protocol == "http" else address
    options = ("-i", protocol, "--shared-memory", "system", "--input-data", str(input_data))
    measure(perf_analyzer, url, *options)
    assert "Traceback" not in http.log()


def test_perf_analyzer_refuses_the_model_with_optional_inputs(
    perf_analyzer, server, input_data
) -> None:
    """The control: the same model with its optional inputs declared is refused by
    perf_analyzer's shared-memory mode, so the setting is what makes the test above pass."""
    http, _ = server
    binary, env = perf_analyzer
    cmd = [str(binary), "-m", FULL, "-u", http.address, "--shared-memory", "system",
           "--input-data", str(input_data), "--concurrency-range", "1",
           "--max-trials", "1"]  # fmt: skip
    got = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert got.returncode != 0
    assert "does not support optional inputs" in got.stdout + got.stderr
