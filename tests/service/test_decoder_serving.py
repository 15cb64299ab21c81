"""A served nn.TransformerDecoder and nn.Transformer through the unmodified tritonclient (HTTP
and gRPC), against real servers on loopback, one process and --workers 2: PyTorch's input
names, BOOL padding masks, tgt_is_causal as a request parameter, PyTorch's numbers."""

from __future__ import annotations

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
from tests.mha_engine.decoder_helpers import perturb_norms
from tests.support import Server, free_port, run_server

FP32_TOL = {"atol": 1e-5, "rtol": 1.3e-6}  # PyTorch's own fp32 tolerances
D, H = 32, 4


@pytest.fixture(scope="module")
def modules() -> dict[str, nn.Module]:
    torch.manual_seed(21)
    layer = nn.TransformerDecoderLayer(D, H, 64, batch_first=True, activation="gelu")
    dec = perturb_norms(nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(D)))
    tr = perturb_norms(nn.Transformer(D, H, 2, 1, 48, batch_first=True, norm_first=True))
    return {"dec": dec, "tr": tr}


def _serve(root: Path, modules: dict[str, nn.Module], *extra: str):
    for name, module in modules.items():
        mha_engine.save_model(module, root / name)
    port = free_port()
    args = ["--grpc-port", str(port), *extra]
    for name in modules:
        args += ["--model-dir", str(root / name)]
    return port, run_server(root, *args)


@pytest.fixture(scope="module")
def server(tmp_path_factory, modules) -> Iterator[tuple[Server, int]]:
    port, running = _serve(tmp_path_factory.mktemp("decoders"), modules)
    with running as http:
        yield http, port


@pytest.fixture(scope="module")
def workers(tmp_path_factory, modules) -> Iterator[tuple[Server, int]]:
    port, running = _serve(tmp_path_factory.mktemp("decoder-workers"), modules, "--workers", "2")
    with running as http:
        yield http, port


def rand(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def trailing(lengths: list[int], total: int) -> np.ndarray:
    return np.arange(total)[None, :] >= np.asarray(lengths)[:, None]  # (B, total) bool


def decoder_case() -> tuple[dict[str, np.ndarray], dict]:
    """Inputs of the decoder (with both padding masks) and PyTorch's forward arguments."""
    tgt, mem = rand(1, 3, 6, D), rand(2, 3, 9, D)
    arrays = {
        "tgt": tgt,
        "memory": mem,
        "tgt_key_padding_mask": trailing([6, 4, 5], 6),
        "memory_key_padding_mask": trailing([9, 3, 7], 9),
    }
    return arrays, {k: torch.from_numpy(v) for k, v in arrays.items()}


def transformer_case() -> tuple[dict[str, np.ndarray], dict]:
    src_kpm = trailing([8, 5], 8)
    arrays = {
        "src": rand(3, 2, 8, D),
        "tgt": rand(4, 2, 5, D),
        "src_key_padding_mask": src_kpm,
        "memory_key_padding_mask": src_kpm,
    }
    return arrays, {k: torch.from_numpy(v) for k, v in arrays.items()}


def expected(module: nn.Module, torch_args: dict) -> np.ndarray:
    T = torch_args["tgt"].shape[1]
    with torch.no_grad():
        out = module(
            **torch_args,
            tgt_mask=nn.Transformer.generate_square_subsequent_mask(T),
            tgt_is_causal=True,
        )
    return out.numpy()


def infer(client_module, client, model: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
    inputs = []
    for name, array in arrays.items():
        item = client_module.InferInput(
            name, list(array.shape), "BOOL" if array.dtype == bool else "FP32"
        )
        item.set_data_from_numpy(array)
        inputs.append(item)
    result = client.infer(model, inputs, parameters={"tgt_is_causal": True})
    return result.as_numpy("output")


CASES = {"dec": decoder_case, "tr": transformer_case}


@pytest.mark.parametrize("model", ["dec", "tr"])
def test_tritonclient_http_and_grpc_give_pytorch_numbers(server, modules, model):
    http, port = server
    arrays, torch_args = CASES[model]()
    want = expected(modules[model], torch_args)
    http_client = thttp.InferenceServerClient(http.address)
    grpc_client = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
    for module, client in ((thttp, http_client), (tgrpc, grpc_client)):
        got = infer(module, client, model, arrays)
        assert got.shape == want.shape
        # padded target rows are computed too, as PyTorch does: every row compares
        np.testing.assert_allclose(got, want, **FP32_TOL)
    meta = grpc_client.get_model_metadata(model, as_json=True)
    names = [t["name"] for t in meta["inputs"]]
    assert names[:2] == (["tgt", "memory"] if model == "dec" else ["src", "tgt"])


def test_bad_inputs_over_http_and_grpc_name_the_input(server):
    http, port = server
    for module, client in (
        (thttp, thttp.InferenceServerClient(http.address)),
        (tgrpc, tgrpc.InferenceServerClient(f"127.0.0.1:{port}")),
    ):
        with pytest.raises(InferenceServerException) as info:
            infer(module, client, "dec", {"tgt": rand(5, 1, 3, D)})
        assert "missing input 'memory'" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            infer(module, client, "dec", {"tgt": rand(5, 2, 3, D), "memory": rand(6, 1, 4, D)})
        assert "'memory' has batch size 1" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            infer(module, client, "tr", {"src": rand(5, 1, 3, D + 1), "tgt": rand(6, 1, 4, D)})
        assert "input 'src' has last dimension" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        infer(thttp, thttp.InferenceServerClient(http.address), "dec", {"tgt": rand(5, 1, 3, D)})
    assert info.value.status() == "400"


@pytest.mark.parametrize("model", ["dec", "tr"])
def test_workers_carry_decoder_inputs_and_masks(workers, modules, model):
    """--workers 2: the masks and both sequence sets cross to the engine process intact."""
    http, port = workers
    arrays, torch_args = CASES[model]()
    want = expected(modules[model], torch_args)
    for module, client in (
        (thttp, thttp.InferenceServerClient(http.address)),
        (tgrpc, tgrpc.InferenceServerClient(f"127.0.0.1:{port}")),
    ):
        got = infer(module, client, model, arrays)
        np.testing.assert_allclose(got, want, **FP32_TOL)
