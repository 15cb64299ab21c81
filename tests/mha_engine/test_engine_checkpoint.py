"""save_model/load_model round trips, and every bad checkpoint fails at load with a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import FP32, engine_from, make_mha
from safetensors.torch import save_file
from test_engine_encoder_parity import make_encoder
from torch import nn

import mha_engine
from mha_engine import CheckpointError, load_model, save_model


def _write(tmp_path, config, state, fmt="safetensors"):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(state, str(tmp_path / "model.safetensors"))
    else:
        torch.save(state, tmp_path / fmt)
    return tmp_path


@pytest.mark.parametrize(
    "module",
    [
        make_mha(12, 3, add_bias_kv=True, add_zero_attn=True),
        make_mha(12, 2, bias=False, kdim=5, vdim=7),
        nn.MultiheadAttention(12, 3, batch_first=False).eval(),
        make_encoder(norm_first=True, activation="gelu").layers[0],
        make_encoder(num_layers=2, final_norm=True, bias=False),
    ],
    ids=["mha_bias_kv", "mha_kdim_vdim", "mha_seq_first", "encoder_layer", "encoder_stack"],
)
def test_save_load_round_trip(tmp_path, module):
    save_model(module, tmp_path)
    model = load_model(tmp_path, device="cpu", dtype="float32")
    assert json.loads((tmp_path / "config.json").read_text())["architecture"] == model.architecture
    x = torch.randn(2, 5, 12 if isinstance(module, nn.MultiheadAttention) else 16)
    with torch.no_grad():
        if isinstance(module, nn.MultiheadAttention):
            kv = torch.randn(2, 4, module.kdim), torch.randn(2, 4, module.vdim)
            if module.batch_first:
                want = module(x, *kv)[0]
            else:
                t = [a.transpose(0, 1) for a in (x, *kv)]
                want = module(*t)[0].transpose(0, 1)
            got = model(x, *kv)[0]
        else:
            want, got = module(x), model(x)
    torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("fmt", ["model.pt", "pytorch_model.bin"])
def test_torch_save_state_dict_loads(tmp_path, fmt):
    mha = make_mha(12, 3)
    config = {"architecture": "multihead_attention", "embed_dim": 12, "num_heads": 3}
    _write(tmp_path, config, mha.state_dict(), fmt)
    model = load_model(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32)
    x = torch.randn(2, 5, 12)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], mha(x, x, x)[0], **FP32)


def test_bare_encoder_layer_state_dict_loads(tmp_path):
    layer = make_encoder().layers[0]
    config = {
        "architecture": "transformer_encoder",
        "d_model": 16,
        "nhead": 4,
        "dim_feedforward": 32,
        "num_layers": 1,
    }
    model = load_model(_write(tmp_path, config, layer.state_dict()), device="cpu")
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), layer(x), **FP32)


def test_public_attributes_and_dtype_names():
    model = mha_engine.build_demo_model(device="cpu", dtype="bfloat16")
    assert (model.architecture, model.embed_dim, model.num_heads, model.head_dim) == (
        "transformer_encoder",
        512,
        8,
        64,
    )
    assert (model.kdim, model.vdim, model.num_layers) == (512, 512, 1)
    assert model.is_cross_attention_capable is False
    assert model.device == torch.device("cpu") and model.dtype == torch.bfloat16
    assert model.config.d_model == 512
    with pytest.raises(AttributeError):
        model.embed_dim = 3
    mha = engine_from(make_mha(12, 3, kdim=5, vdim=7))
    assert (mha.architecture, mha.kdim, mha.vdim, mha.num_layers) == (
        "multihead_attention",
        5,
        7,
        1,
    )
    assert mha.is_cross_attention_capable is True


def test_unsupported_dtype_name_is_refused(tmp_path):
    save_model(make_mha(12, 3), tmp_path)
    with pytest.raises(ValueError, match=r"unsupported dtype 'int4'; use one of .*'int8'"):
        load_model(tmp_path, dtype="int4")
    assert load_model(tmp_path, dtype=torch.float16).dtype == torch.float16


def test_demo_model_is_seeded_and_matches_demo_module():
    x = torch.randn(2, 9, 512)
    model, module = mha_engine.build_demo_model(), mha_engine.demo_module()
    with torch.no_grad():
        torch.testing.assert_close(model(x), module(x), **FP32)
    torch.testing.assert_close(mha_engine.build_demo_model(seed=0)(x), model(x), atol=0, rtol=0)
    assert not torch.allclose(mha_engine.build_demo_model(seed=1)(x), model(x))
    state = torch.get_rng_state()
    mha_engine.demo_module(3)
    assert torch.equal(state, torch.get_rng_state())


MHA_CONFIG = {"architecture": "multihead_attention", "embed_dim": 12, "num_heads": 3}


def _good_state():
    return {k: v.clone() for k, v in make_mha(12, 3).state_dict().items()}


def test_missing_and_unexpected_keys(tmp_path):
    state = _good_state()
    del state["out_proj.bias"]
    state["extra.weight"] = torch.zeros(2)
    with pytest.raises(
        CheckpointError,
        match=r"missing keys \['out_proj.bias'\].*unexpected keys \['extra.weight'\]",
    ):
        load_model(_write(tmp_path, MHA_CONFIG, state))


def test_wrong_shape_names_key_and_shapes(tmp_path):
    state = _good_state()
    state["out_proj.weight"] = torch.zeros(12, 10)
    with pytest.raises(
        CheckpointError, match=r"out_proj.weight: expected shape \(12, 12\), got \(12, 10\)"
    ):
        load_model(_write(tmp_path, MHA_CONFIG, state))


def test_non_floating_tensor(tmp_path):
    state = _good_state()
    state["in_proj_bias"] = torch.zeros(36, dtype=torch.int64)
    with pytest.raises(
        CheckpointError, match=r"in_proj_bias: expected a floating point tensor, got torch\.int64"
    ):
        load_model(_write(tmp_path, MHA_CONFIG, state))


@pytest.mark.parametrize(
    "config,match",
    [
        (dict(MHA_CONFIG, num_heads=5), "embed_dim 12 is not divisible by num_heads 5"),
        (dict(MHA_CONFIG, architecture="lstm"), "unknown architecture 'lstm'"),
        (dict(MHA_CONFIG, embed_dim=-4), "embed_dim must be a positive integer"),
        (
            {
                "architecture": "transformer_encoder",
                "d_model": 16,
                "nhead": 4,
                "dim_feedforward": 8,
                "activation": "silu",
            },
            r"activation must be one of \(.relu., .gelu., .gelu_tanh.\)",
        ),
    ],
)
def test_bad_config(tmp_path, config, match):
    with pytest.raises(CheckpointError, match=match):
        load_model(_write(tmp_path, config, _good_state()))


def test_not_a_safetensors_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MHA_CONFIG))
    (tmp_path / "model.safetensors").write_bytes(b"\x80\x04this is not safetensors" * 10)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load_model(tmp_path)


def test_missing_files_and_bad_json(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(MHA_CONFIG))
    with pytest.raises(CheckpointError, match="has none of the weight files"):
        load_model(tmp_path)


class _Payload:
    """Unpickling this would create a marker file: proves torch.load never ran arbitrary code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickle_bearing_pt_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    state = dict(_good_state(), payload=_Payload(marker))
    (tmp_path / "config.json").write_text(json.dumps(MHA_CONFIG))
    torch.save(state, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"refused by torch.load\(weights_only=True\)"):
        load_model(tmp_path)
    assert not marker.exists()


def test_pt_holding_non_state_dict(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MHA_CONFIG))
    torch.save([torch.zeros(3)], tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="must hold a state dict"):
        load_model(tmp_path)
