"""tritonclient against a real server: outputs equal the PyTorch module the model came from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from torch import nn

import mha_engine
from tests.support import FP32_TOL, Server, run_server


def infer(
    server: Server,
    model: str,
    tensors: dict[str, np.ndarray],
    binary: bool,
    datatype: str = "FP32",
    **parameters: object,
) -> triton.InferResult:
    client = triton.InferenceServerClient(server.address)
    inputs = []
    for name, array in tensors.items():
        dt = "BOOL" if array.dtype == np.bool_ else datatype
        item = triton.InferInput(name, list(array.shape), dt)
        item.set_data_from_numpy(array, binary_data=binary)
        inputs.append(item)
    outputs = [triton.InferRequestedOutput("output", binary_data=binary)]
    return client.infer(model, inputs, outputs=outputs, parameters=parameters or None)


def test_demo_model_binary_and_json_match_pytorch(demo_server: Server) -> None:
    x = np.random.default_rng(0).standard_normal((3, 20, 512)).astype(np.float32)
    expected = mha_engine.demo_module().eval()(torch.from_numpy(x)).detach()
    for binary in (True, False):
        got = infer(demo_server, "mha", {"input": x}, binary).as_numpy("output")
        assert got.dtype == np.float32 and got.shape == (3, 20, 512)
        torch.testing.assert_close(torch.from_numpy(got), expected, **FP32_TOL)


def test_tritonclient_defaults_binary_everywhere(demo_server: Server) -> None:
    """No requested outputs: tritonclient asks for binary_data_output and must get binary back."""
    x = np.random.default_rng(3).standard_normal((1, 5, 512)).astype(np.float32)
    client = triton.InferenceServerClient(demo_server.address)
    item = triton.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    result = client.infer("mha", [item])
    assert result.get_output("output")["parameters"]["binary_data_size"] == x.nbytes
    expected = mha_engine.demo_module().eval()(torch.from_numpy(x)).detach()
    torch.testing.assert_close(torch.from_numpy(result.as_numpy("output")), expected, **FP32_TOL)


def test_unbatched_input_and_padding_mask(demo_server: Server) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 9, 512)).astype(np.float32)
    mask = np.zeros((2, 9), dtype=bool)
    mask[0, 6:] = True
    module = mha_engine.demo_module().eval()
    expected = module(torch.from_numpy(x), src_key_padding_mask=torch.from_numpy(mask)).detach()
    got = infer(demo_server, "mha", {"input": x, "key_padding_mask": mask}, True).as_numpy("output")
    # PyTorch's nested-tensor fast path returns 0 at padded query positions; compare real tokens.
    torch.testing.assert_close(torch.from_numpy(got)[0, :6], expected[0, :6], **FP32_TOL)
    torch.testing.assert_close(torch.from_numpy(got)[1], expected[1], **FP32_TOL)

    single = infer(demo_server, "mha", {"input": x[1]}, True).as_numpy("output")
    assert single.shape == (9, 512)
    torch.testing.assert_close(torch.from_numpy(single), expected[1], **FP32_TOL)


def test_is_causal_parameter(demo_server: Server) -> None:
    x = np.random.default_rng(5).standard_normal((2, 7, 512)).astype(np.float32)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(7)
    module = mha_engine.demo_module().eval()
    expected = module(torch.from_numpy(x), mask=causal, is_causal=True).detach()
    got = infer(demo_server, "mha", {"input": x}, True, is_causal=True).as_numpy("output")
    torch.testing.assert_close(torch.from_numpy(got), expected, **FP32_TOL)


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_half_precision_inputs_come_back_in_their_type(demo_server: Server, datatype: str) -> None:
    np_type = np.float16 if datatype == "FP16" else ml_dtypes.bfloat16
    x = np.random.default_rng(6).standard_normal((2, 8, 512)).astype(np_type)
    got = infer(demo_server, "mha", {"input": x}, True, datatype=datatype).as_numpy("output")
    assert got.dtype == np_type and got.shape == (2, 8, 512)
    # Reference: the fp32 module on the same (rounded) inputs; the output is rounded once more.
    expected = mha_engine.demo_module().eval()(torch.from_numpy(x.astype(np.float32))).detach()
    tol = {"atol": 1e-2, "rtol": 1e-2} if datatype == "BF16" else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(torch.from_numpy(got.astype(np.float32)), expected, **tol)


@pytest.fixture(scope="module")
def cross_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, nn.Module]]:
    """An nn.MultiheadAttention with kdim/vdim, add_bias_kv and 5 heads, saved and served."""
    torch.manual_seed(0)
    module = nn.MultiheadAttention(60, 5, kdim=48, vdim=40, add_bias_kv=True, batch_first=True)
    module.eval()
    model_dir: Path = tmp_path_factory.mktemp("models") / "cross"
    mha_engine.save_model(module, model_dir)
    with run_server(model_dir.parent, "--model-dir", str(model_dir)) as server:
        yield server, module


@pytest.mark.parametrize("binary", [True, False])
def test_cross_attention_model_matches_pytorch(cross_server, binary: bool) -> None:
    server, module = cross_server
    rng = np.random.default_rng(7)
    q = rng.standard_normal((3, 6, 60)).astype(np.float32)
    k = rng.standard_normal((3, 11, 48)).astype(np.float32)
    v = rng.standard_normal((3, 11, 40)).astype(np.float32)
    mask = np.zeros((3, 11), dtype=bool)
    mask[1, 8:] = True
    tensors = {"input": q, "key": k, "value": v, "key_padding_mask": mask}
    got = infer(server, "cross", tensors, binary).as_numpy("output")
    expected, _ = module(
        *(torch.from_numpy(a) for a in (q, k, v)),
        key_padding_mask=torch.from_numpy(mask),
        need_weights=False,
    )
    torch.testing.assert_close(torch.from_numpy(got), expected.detach(), **FP32_TOL)


def test_cross_model_metadata_lists_key_and_value(cross_server) -> None:
    server, _ = cross_server
    meta = triton.InferenceServerClient(server.address).get_model_metadata("cross")
    shapes = {t["name"]: t["shape"] for t in meta["inputs"]}
    assert shapes["key"] == [-1, -1, 48] and shapes["value"] == [-1, -1, 40]


def test_bf16_server_against_fp32_reference(tmp_path: Path) -> None:
    torch.manual_seed(1)
    module = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(64, 4, 128, batch_first=True),
        num_layers=2,
        enable_nested_tensor=False,
    ).eval()
    model_dir = tmp_path / "enc"
    mha_engine.save_model(module, model_dir)
    x = np.random.default_rng(8).standard_normal((2, 10, 64)).astype(np.float32)
    with run_server(tmp_path, "--model-dir", str(model_dir), "--dtype", "bfloat16") as server:
        meta = triton.InferenceServerClient(server.address).get_model_metadata("enc")
        assert meta["inputs"][0]["datatype"] == "BF16"
        got = infer(server, "enc", {"input": x}, True).as_numpy("output")
    assert got.dtype == np.float32  # answered in the request's datatype
    expected = module(torch.from_numpy(x)).detach()
    # bf16 keeps 8 mantissa bits; two layers of GEMMs + LayerNorm measured ≤ 0.03 abs error here.
    torch.testing.assert_close(torch.from_numpy(got), expected, atol=6e-2, rtol=2e-2)
