"""Decoder models over OIP in process: PyTorch's input names in metadata and Triton's config, 400s
naming the input for bad requests, and the debug endpoint's self/cross weights per head."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from torch import nn

import mha_engine
from tests.inprocess import asgi_client
from tests.mha_engine.decoder_helpers import perturb_norms, pytorch_layer_weights

FP32_TOL = {"atol": 1e-5, "rtol": 1.3e-6}  # PyTorch's own fp32 tolerances
D, H = 16, 4


@pytest.fixture(scope="module")
def decoder() -> nn.TransformerDecoder:
    torch.manual_seed(3)
    layer = nn.TransformerDecoderLayer(D, H, 32, batch_first=True, norm_first=True)
    return perturb_norms(nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(D)))


@pytest.fixture(scope="module")
def transformer() -> nn.Transformer:
    torch.manual_seed(4)
    return perturb_norms(nn.Transformer(D, H, 1, 2, 32, batch_first=True))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, decoder, transformer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoders")
    mha_engine.save_model(decoder, root / "dec")
    mha_engine.save_model(transformer, root / "tr")
    return {"dec": root / "dec", "tr": root / "tr"}


def call(model_dir: Path, check: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    """Run `check` against the real app serving `model_dir` (debug endpoint on), in process."""

    async def main() -> None:
        async with asgi_client(model_dir=[model_dir], debug_endpoint=True) as client:
            await check(client)

    asyncio.run(main())


def tensor(name: str, array: np.ndarray) -> dict:
    datatype = "BOOL" if array.dtype == np.bool_ else "FP32"
    return {
        "name": name,
        "shape": list(array.shape),
        "datatype": datatype,
        "data": array.ravel().tolist(),
    }


def body(tensors: dict[str, np.ndarray], **parameters) -> dict:
    return {"inputs": [tensor(n, a) for n, a in tensors.items()], "parameters": parameters}


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def outputs(response) -> dict[str, np.ndarray]:
    found = {}
    for o in response.json()["outputs"]:
        found[o["name"]] = np.asarray(o["data"], dtype=np.float32).reshape(o["shape"])
    return found


def test_metadata_and_config_use_pytorch_names(model_dirs):
    async def check(dec_client, tr_client) -> None:
        for client, name, floats, masks in (
            (
                dec_client,
                "dec",
                ["tgt", "memory"],
                ["tgt_key_padding_mask", "memory_key_padding_mask"],
            ),
            (
                tr_client,
                "tr",
                ["src", "tgt"],
                ["src_key_padding_mask", "tgt_key_padding_mask", "memory_key_padding_mask"],
            ),
        ):
            meta = (await client.get(f"/v2/models/{name}")).json()
            assert [t["name"] for t in meta["inputs"]] == floats + masks
            assert all(t["shape"] == [-1, -1, D] for t in meta["inputs"][: len(floats)])
            assert {t["datatype"] for t in meta["inputs"][len(floats) :]} == {"BOOL"}
            config = (await client.get(f"/v2/models/{name}/config")).json()
            required = [i["name"] for i in config["input"] if not i["optional"]]
            assert required == floats
            assert meta["properties"]["architecture"] in ("transformer_decoder", "transformer")

    async def both(dec_client) -> None:
        async with asgi_client(model_dir=[model_dirs["tr"]]) as tr_client:
            await check(dec_client, tr_client)

    call(model_dirs["dec"], both)


def test_decoder_infer_matches_pytorch_with_masks(model_dirs, decoder):
    async def check(dec_client) -> None:
        tgt, mem = rand(2, 5, D, seed=1), rand(2, 7, D, seed=2)
        tgt_kpm = np.zeros((2, 5), dtype=bool)
        tgt_kpm[1, 3:] = True
        mem_kpm = np.zeros((2, 7), dtype=bool)
        mem_kpm[0, 4:] = True
        tensors = {
            "tgt": tgt,
            "memory": mem,
            "tgt_key_padding_mask": tgt_kpm,
            "memory_key_padding_mask": mem_kpm,
        }
        r = await dec_client.post("/v2/models/dec/infer", json=body(tensors, tgt_is_causal=True))
        assert r.status_code == 200, r.text
        with torch.no_grad():
            want = decoder(
                torch.from_numpy(tgt),
                torch.from_numpy(mem),
                tgt_mask=nn.Transformer.generate_square_subsequent_mask(5),
                tgt_is_causal=True,
                tgt_key_padding_mask=torch.from_numpy(tgt_kpm),
                memory_key_padding_mask=torch.from_numpy(mem_kpm),
            )
        torch.testing.assert_close(torch.from_numpy(outputs(r)["output"]), want, **FP32_TOL)

    call(model_dirs["dec"], check)


BAD = [
    ({"tgt": rand(1, 3, D)}, "missing input 'memory'"),
    ({"tgt": rand(2, 3, D), "memory": rand(1, 4, D)}, "'memory' has batch size 1"),
    ({"tgt": rand(1, 3, D), "memory": rand(1, 4, D + 1)}, "input 'memory' has last dimension"),
    ({"tgt": rand(1, 3, D - 2), "memory": rand(1, 4, D)}, "input 'tgt' has last dimension"),
    ({"tgt": rand(3, D), "memory": rand(1, 4, D)}, "'memory' must have the same rank"),
    ({"input": rand(1, 3, D)}, "unknown input(s) ['input']"),
    (
        {
            "tgt": rand(1, 3, D),
            "memory": rand(1, 4, D),
            "memory_key_padding_mask": np.ones((1, 4), bool),
        },
        "'memory_key_padding_mask' ignores every position",
    ),
    (
        {
            "tgt": rand(1, 3, D),
            "memory": rand(1, 4, D),
            "tgt_key_padding_mask": np.zeros((1, 4), bool),
        },
        "'tgt_key_padding_mask' has shape [1, 4]",
    ),
    (
        {"tgt": rand(1, 3, D), "memory": rand(1, 4, D), "memory_key_padding_mask": rand(1, 4)},
        "'memory_key_padding_mask' must be BOOL",
    ),
]


@pytest.mark.parametrize("tensors,message", BAD)
def test_bad_decoder_inputs_answer_400_naming_the_input(model_dirs, tensors, message):
    async def check(dec_client) -> None:
        r = await dec_client.post("/v2/models/dec/infer", json=body(tensors))
        assert r.status_code == 400
        assert message in r.json()["error"]
        ok = await dec_client.post(
            "/v2/models/dec/infer", json=body({"tgt": rand(1, 2, D), "memory": rand(1, 3, D)})
        )
        assert ok.status_code == 200  # the connection and the model keep serving

    call(model_dirs["dec"], check)


def test_bad_transformer_inputs_and_causal_parameter(model_dirs):
    async def check(tr_client) -> None:
        r = await tr_client.post("/v2/models/tr/infer", json=body({"tgt": rand(1, 3, D)}))
        assert r.status_code == 400 and "missing input 'src'" in r.json()["error"]
        r = await tr_client.post(
            "/v2/models/tr/infer", json=body({"src": rand(2, 4, D), "tgt": rand(3, 3, D)})
        )
        assert r.status_code == 400 and "'src' has batch size 2; 'tgt' has 3" in r.json()["error"]
        tgt_kpm = np.zeros((1, 3), dtype=bool)
        tgt_kpm[0, 0] = True
        tensors = {"src": rand(1, 4, D), "tgt": rand(1, 3, D), "tgt_key_padding_mask": tgt_kpm}
        r = await tr_client.post("/v2/models/tr/infer", json=body(tensors, tgt_is_causal=True))
        assert r.status_code == 400 and "hides the first target position" in r.json()["error"]
        r = await tr_client.post(
            "/v2/models/tr/infer",
            json=body({"src": rand(1, 4, D), "tgt": rand(1, 3, D)}, tgt_is_causal="yes"),
        )
        assert r.status_code == 400 and "'tgt_is_causal' must be true or false" in r.json()["error"]

    call(model_dirs["tr"], check)


def test_debug_weights_equal_pytorch_self_and_cross(model_dirs, decoder):
    async def check(dec_client) -> None:
        tgt, mem = rand(2, 4, D, seed=5), rand(2, 6, D, seed=6)
        mem_kpm = np.zeros((2, 6), dtype=bool)
        mem_kpm[1, 5:] = True
        tensors = {"tgt": tgt, "memory": mem, "memory_key_padding_mask": mem_kpm}
        r = await dec_client.post(
            "/v2/models/dec/attention", json=body(tensors, tgt_is_causal=True)
        )
        assert r.status_code == 200, r.text
        got = outputs(r)
        assert got["attention_weights"].shape == (2, 2, H, 4, 4)  # (L, B, H, T, T)
        assert got["cross_attention_weights"].shape == (2, 2, H, 4, 6)  # (L, B, H, T, S)
        causal = nn.Transformer.generate_square_subsequent_mask(4)
        want = pytorch_layer_weights(
            decoder.layers,
            torch.from_numpy(tgt),
            torch.from_numpy(mem),
            causal,
            torch.from_numpy(mem_kpm),
        )
        for i, (sw, cw) in enumerate(want):
            torch.testing.assert_close(
                torch.from_numpy(got["attention_weights"][i]), sw, **FP32_TOL
            )
            torch.testing.assert_close(
                torch.from_numpy(got["cross_attention_weights"][i]), cw, **FP32_TOL
            )
        r = await dec_client.post(
            "/v2/models/dec/attention", json=body(tensors, tgt_is_causal=True, layer=1)
        )
        one = outputs(r)
        torch.testing.assert_close(
            torch.from_numpy(one["cross_attention_weights"]), want[1][1], **FP32_TOL
        )
        info = (await dec_client.get("/debug/info")).json()
        assert info["decoder_inputs"] == ["tgt", "memory"] and info["weight_layers"] == 2
        heads = (await dec_client.get("/v2/models/dec/heads")).json()["layers"]
        assert len(heads) == 2 and len(heads[0]["cross_attn"]["head_share"]) == H

    call(model_dirs["dec"], check)


def test_transformer_debug_weights_and_output(model_dirs, transformer):
    async def check(tr_client) -> None:
        src, tgt = rand(1, 5, D, seed=7), rand(1, 3, D, seed=8)
        tensors = {"src": src, "tgt": tgt}
        r = await tr_client.post("/v2/models/tr/attention", json=body(tensors, tgt_is_causal=True))
        assert r.status_code == 200, r.text
        got = outputs(r)
        assert got["encoder_attention_weights"].shape == (1, 1, H, 5, 5)
        assert got["cross_attention_weights"].shape == (2, 1, H, 3, 5)
        causal = nn.Transformer.generate_square_subsequent_mask(3)
        with torch.no_grad():
            want = transformer(
                torch.from_numpy(src), torch.from_numpy(tgt), tgt_mask=causal, tgt_is_causal=True
            )
            memory = transformer.encoder(torch.from_numpy(src))
        torch.testing.assert_close(torch.from_numpy(got["output"]), want, **FP32_TOL)
        layers = pytorch_layer_weights(
            transformer.decoder.layers, torch.from_numpy(tgt), memory, causal, None
        )
        torch.testing.assert_close(
            torch.from_numpy(got["cross_attention_weights"][1]), layers[1][1], **FP32_TOL
        )
        r = await tr_client.post(
            "/v2/models/tr/attention", json=body(tensors, layer=2)
        )  # two decoder layers: 0..1
        assert r.status_code == 400 and "parameter 'layer' is 2" in r.json()["error"]

    call(model_dirs["tr"], check)
