"""The engine as nn.Modules: PyTorch's state-dict names, save_model of any loaded model, .to().

Round trips are bit-exact (atol=0, rtol=0): saving writes the loaded weights unchanged and
loading runs the same kernels on them.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from engine_helpers import FP32, engine_from, make_mha
from test_engine_encoder_parity import make_encoder
from test_hf_bert import _batch, make_hf, save_hf
from torch import nn

import mha_engine
from mha_engine import (
    MultiheadAttentionConfig,
    TextEncoderConfig,
    TransformerEncoderConfig,
    load_model,
    save_model,
)
from mha_engine.checkpoint import model_from_state_dict
from mha_engine.layouts import KNOWN_LAYOUTS, AttentionKeys

EXACT = {"atol": 0.0, "rtol": 0.0}
E, H = 8, 2


def _same_outputs(a, b, x, *rest):
    """Dense and varlen outputs of two models on the same inputs, bit for bit."""
    out_a, out_b = a(x, *rest), b(x, *rest)
    if isinstance(out_a, tuple):
        out_a, out_b = out_a[0], out_b[0]
    torch.testing.assert_close(out_b, out_a, **EXACT)
    if not rest:
        for u, v in zip(a.forward_varlen(list(x)), b.forward_varlen(list(x)), strict=True):
            torch.testing.assert_close(v, u, **EXACT)


MODULES = {
    "mha": lambda: make_mha(12, 3),
    "mha_bias_kv_zero_attn": lambda: make_mha(12, 3, add_bias_kv=True, add_zero_attn=True),
    "mha_no_bias": lambda: make_mha(12, 4, bias=False),
    "mha_kdim_eq_vdim": lambda: make_mha(12, 3, kdim=5, vdim=5),
    "mha_kdim_vdim": lambda: make_mha(12, 3, kdim=5, vdim=7),
    "encoder_pre_norm_gelu": lambda: make_encoder(activation="gelu", norm_first=True),
    "encoder_stack_final_norm": lambda: make_encoder(num_layers=2, final_norm=True),
    "encoder_no_bias": lambda: make_encoder(bias=False),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_state_dict_has_pytorch_names_both_ways(name):
    """engine.core.state_dict() loads strictly into a fresh PyTorch module of the same config,
    and that module gives the engine's numbers."""
    module = MODULES[name]()
    model = engine_from(module)
    state = model.core.state_dict()
    assert set(state) == set(module.state_dict())
    fresh = MODULES[name]()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(state, strict=True)
    if isinstance(module, nn.MultiheadAttention):
        x = torch.randn(2, 5, 12)
        kv = torch.randn(2, 4, module.kdim) if module.kdim != 12 else x
        kv_v = torch.randn(2, 4, module.vdim) if module.vdim != 12 else kv
        with torch.no_grad():
            want = fresh(x, kv, kv_v, need_weights=False)[0]
        torch.testing.assert_close(model(x, kv, kv_v)[0], want, **FP32)
    else:
        x = torch.randn(2, 5, 16)
        with torch.no_grad():
            want = fresh(x)
        torch.testing.assert_close(model(x), want, **FP32)


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_of_a_loaded_model_is_exact(tmp_path, name, dtype):
    module = MODULES[name]()
    model = engine_from(module, dtype)
    save_model(model, tmp_path)
    again = load_model(tmp_path, device="cpu", dtype=dtype)
    assert again.config == model.config
    if isinstance(module, nn.MultiheadAttention):
        x = torch.randn(3, 5, 12)
        kv = torch.randn(3, 4, module.kdim)
        kv_v = kv if module.kdim == module.vdim else torch.randn(3, 4, module.vdim)
        if module.kdim == 12:
            _same_outputs(model, again, x)
        else:
            _same_outputs(model, again, x, kv, kv_v)
    else:
        _same_outputs(model, again, torch.randn(3, 5, 16))


def _layout_state(keys: AttentionKeys, gen: torch.Generator) -> dict[str, torch.Tensor]:
    rows = {keys.qkv: 3 * E} if keys.fused else {keys.q: E, keys.k: E, keys.v: E}
    rows[keys.out] = E
    state = {}
    for module, n in rows.items():
        state[f"{module}.weight"] = torch.randn(n, E, generator=gen)
        state[f"{module}.bias"] = torch.randn(n, generator=gen)
    return state


LAYOUTS = [*KNOWN_LAYOUTS, AttentionKeys(qkv="qkv", out="proj", qkv_packing="per_head")]


@pytest.mark.parametrize("keys", LAYOUTS, ids=[k.describe() for k in LAYOUTS])
def test_every_custom_layout_saves_and_reloads_exactly(tmp_path, keys):
    config = {"architecture": "multihead_attention", "embed_dim": E, "num_heads": H}
    if keys.qkv_packing == "per_head":
        config["attention_keys"] = {"qkv": keys.qkv, "out": keys.out, "qkv_packing": "per_head"}
    state = _layout_state(keys, torch.Generator().manual_seed(len(keys.describe())))
    model = model_from_state_dict(config, state, "cpu")
    assert model.config.attention_layout == keys.describe()
    save_model(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "attention_layout" not in saved  # the saved weights are in PyTorch's names
    again = load_model(tmp_path, device="cpu")
    _same_outputs(model, again, torch.randn(2, 6, E))


def test_grouped_query_model_saves_and_reloads_exactly(tmp_path):
    config = {"architecture": "multihead_attention", "embed_dim": 16, "num_heads": 4}
    config["num_kv_heads"] = 2
    gen = torch.Generator().manual_seed(5)
    state = {
        "in_proj_weight": torch.randn(16 + 2 * 8, 16, generator=gen),
        "in_proj_bias": torch.randn(16 + 2 * 8, generator=gen),
        "out_proj.weight": torch.randn(16, 16, generator=gen),
        "out_proj.bias": torch.randn(16, generator=gen),
    }
    model = model_from_state_dict(config, state, "cpu")
    save_model(model, tmp_path)
    again = load_model(tmp_path, device="cpu")
    assert again.num_kv_heads == 2
    _same_outputs(model, again, torch.randn(2, 6, 16))


def _write_st_settings(directory, pooling: str, normalize: bool, max_len: int) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append({"idx": 2, "path": "2", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    flags = {
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
    }
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len}))


@pytest.mark.parametrize("model_type", ["bert", "roberta", "distilbert", "mpnet"])
def test_text_model_saves_as_a_hugging_face_directory(tmp_path, model_type):
    """A loaded BERT-family model saves as an HF directory: load_model gives identical numbers,
    and transformers loads it into the original model's function."""
    import transformers

    ref = make_hf(model_type, hidden_act="gelu_new" if model_type == "bert" else "gelu")
    source = save_hf(ref, tmp_path / "source")
    _write_st_settings(source, "cls", True, 20)
    model = load_model(source, device="cpu")
    save_model(model, tmp_path / "saved")
    again = load_model(tmp_path / "saved", device="cpu")
    assert again.config == model.config
    assert (again.pooling, again.normalize, again.max_seq_len) == ("cls", True, 20)
    ids, mask = _batch([7, 3, 12])
    torch.testing.assert_close(again.encode(ids, mask), model.encode(ids, mask), **EXACT)
    seqs = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    torch.testing.assert_close(again.embed_varlen(seqs), model.embed_varlen(seqs), **EXACT)
    reloaded = transformers.AutoModel.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        got = reloaded(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, **EXACT)


def test_to_dtype_equals_loading_in_that_dtype(tmp_path):
    module = make_encoder(num_layers=2, final_norm=True)
    model = engine_from(module)
    model.to(dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.device == torch.device("cpu")
    _same_outputs(engine_from(module, torch.bfloat16), model, torch.randn(3, 5, 16))
    model.to(torch.float32)  # back to fp32: the bf16-rounded weights, now in fp32
    assert model.dtype == torch.float32
    assert model(torch.randn(2, 3, 16)).dtype == torch.float32


def test_dtype_follows_a_replaced_weight_or_module():
    """device/dtype are read from a cached weight: replacing that weight, or a module on its
    path, is noticed (the cache is checked per call, not trusted)."""
    model = engine_from(make_mha(16, 2))
    assert model.dtype == torch.float32
    first = next(name for name, t in model.core.named_parameters() if t.is_floating_point())
    *path, attr = first.split(".")
    owner = model.core.get_submodule(".".join(path))
    setattr(owner, attr, nn.Parameter(owner._parameters[attr].detach().to(torch.float16)))
    assert model.dtype == torch.float16  # the weight object was replaced
    parent = model.core.get_submodule(".".join(path[:-1])) if len(path) > 1 else model.core
    replacement = type(owner)(owner.in_features, owner.out_features).to(torch.bfloat16)
    setattr(parent, path[-1], replacement)
    assert model.dtype == torch.bfloat16  # a module on the path was replaced
    model.to(torch.float32)  # in place: the same objects, the cached weight shows the change
    assert model.dtype == torch.float32


def test_text_model_to_dtype_keeps_float32_embeddings(tmp_path):
    source = save_hf(make_hf("bert"), tmp_path)
    model = load_model(source, device="cpu").to(dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert model.embeddings.word_embeddings.weight.dtype == torch.float32
    bf16 = load_model(source, device="cpu", dtype="bfloat16")
    ids, mask = _batch([7, 3, 12])
    torch.testing.assert_close(model.encode(ids, mask), bf16.encode(ids, mask), **EXACT)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_cuda_moves_every_weight():  # unverified on a GPU: no CUDA device in CI
    model = engine_from(make_encoder())
    x = torch.randn(2, 5, 16)
    want = model(x)
    model.to(device="cuda")
    assert model.device.type == "cuda"
    assert all(p.is_cuda for p in model.parameters())
    torch.testing.assert_close(model(x.cuda()).cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "config",
    [
        MultiheadAttentionConfig(12, 3, num_kv_heads=1, kdim=5, vdim=7, add_bias_kv=True),
        TransformerEncoderConfig(16, 4, 32, num_layers=2, activation="gelu", final_norm=True),
        TextEncoderConfig(
            32, 4, 48, model_type="roberta", vocab_size=99, max_position_embeddings=40,
            pad_token_id=1, position_offset=2, pooling="cls", normalize=True,
        ),
    ],
    ids=["mha", "encoder", "text"],
)  # fmt: skip
def test_configs_round_trip_through_json_and_are_frozen(config):
    data = json.loads(json.dumps(config.to_dict()))
    assert type(config).from_dict(data) == config
    assert mha_engine.config_from_dict(data) == config or isinstance(config, TextEncoderConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 3


def test_config_validation_names_the_field():
    with pytest.raises(mha_engine.CheckpointError, match=r"config\.num_heads must be a positive"):
        MultiheadAttentionConfig(12, 0)
    with pytest.raises(mha_engine.CheckpointError, match="not divisible by num_kv_heads"):
        MultiheadAttentionConfig(12, 3, num_kv_heads=2)
    with pytest.raises(mha_engine.CheckpointError, match=r"config\.activation"):
        TransformerEncoderConfig(16, 4, 32, activation="swish")
    text = TextEncoderConfig(16, 4, 32, model_type="bert", vocab_size=9, max_position_embeddings=8)
    assert text.max_seq_len == 8  # defaults to the position table


def test_models_are_frozen_inference_modules():
    model = engine_from(make_encoder())
    assert isinstance(model, nn.Module) and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert isinstance(model, mha_engine.ServedModel)
    assert isinstance(model.encoder.layers[0].self_attn.in_proj, nn.Linear)
    assert isinstance(model.encoder.layers[0].linear1, nn.Linear)
