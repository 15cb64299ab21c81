"""Engine decoders equal nn.TransformerDecoderLayer / nn.TransformerDecoder / nn.Transformer.

Every option (norm_first, relu/gelu, bias off, final norm, several layers) against every mask
(causal, both padding masks, float masks) at fp32 atol 1e-5 / rtol 1.3e-6, plus held-out
random configurations, attention weights per head and the unbatched form.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from decoder_helpers import (
    make_decoder,
    make_transformer,
    pytorch_layer_weights,
    trailing_padding,
)
from engine_helpers import FP32, engine_from
from torch import nn

B, T, S, D, H = 3, 5, 7, 16, 4


def _decoder_masks(kind: str):
    """(engine kwargs, reference kwargs) for nn.TransformerDecoder.forward."""
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    tgt_kpm = trailing_padding([T, 3, 4], T)
    mem_kpm = trailing_padding([S, 2, 5], S)
    table = {
        "none": ({}, {}),
        "causal": ({"tgt_is_causal": True}, {"tgt_mask": causal, "tgt_is_causal": True}),
        "causal_bool_mask": ({"tgt_mask": causal.isinf()}, {"tgt_mask": causal.isinf()}),
        "tgt_kpm": ({"tgt_key_padding_mask": tgt_kpm},) * 2,
        "memory_kpm": ({"memory_key_padding_mask": mem_kpm},) * 2,
        "causal_both_kpm": (
            {
                "tgt_is_causal": True,
                "tgt_key_padding_mask": tgt_kpm,
                "memory_key_padding_mask": mem_kpm,
            },
            {
                "tgt_mask": causal,
                "tgt_is_causal": True,
                "tgt_key_padding_mask": tgt_kpm,
                "memory_key_padding_mask": mem_kpm,
            },
        ),
        "float_masks": ({"tgt_mask": torch.randn(T, T), "memory_mask": torch.randn(T, S)},) * 2,
    }
    eng, ref = table[kind]
    return dict(eng), dict(ref)


def _reference(module: nn.Module, *args, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        want = module(*args, **kwargs)
    assert not want.isnan().any()
    return want


OPTIONS = list(itertools.product([False, True], ["relu", "gelu"], [True, False], [False, True]))
MASKS = ["none", "causal", "causal_bool_mask", "tgt_kpm", "memory_kpm", "causal_both_kpm"]


@pytest.mark.parametrize("norm_first,activation,bias,final_norm", OPTIONS)
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("mask_kind", [*MASKS, "float_masks"])
def test_decoder_matches_pytorch(norm_first, activation, bias, final_norm, num_layers, mask_kind):
    dec = make_decoder(
        D,
        H,
        num_layers=num_layers,
        activation=activation,
        norm_first=norm_first,
        bias=bias,
        final_norm=final_norm,
        eps=1e-6,
    )
    model = engine_from(dec)
    assert model.architecture == "transformer_decoder" and model.num_layers == num_layers
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    eng_kw, ref_kw = _decoder_masks(mask_kind)
    want = _reference(dec, x, mem, **ref_kw)
    torch.testing.assert_close(model(x, mem, **eng_kw), want, **FP32)
    out, weights = model.attention_weights(x, mem, **eng_kw)
    torch.testing.assert_close(out, want, **FP32)
    assert weights["self_attn"].shape == (num_layers, B, H, T, T)
    assert weights["cross_attn"].shape == (num_layers, B, H, T, S)


@pytest.mark.parametrize(
    "norm_first,activation,bias",
    list(itertools.product(*[[False, True], ["relu", "gelu"], [True, False]])),
)
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding"])
def test_transformer_matches_pytorch(norm_first, activation, bias, mask_kind):
    ref = make_transformer(D, H, 2, 3, activation=activation, norm_first=norm_first, bias=bias)
    model = engine_from(ref)
    assert model.architecture == "transformer" and model.num_layers == 5
    src, tgt = torch.randn(B, S, D), torch.randn(B, T, D)
    eng_kw, ref_kw = {}, {}
    if mask_kind in ("causal", "padding"):
        eng_kw["tgt_is_causal"] = True
        ref_kw.update(
            tgt_is_causal=True, tgt_mask=nn.Transformer.generate_square_subsequent_mask(T)
        )
    if mask_kind == "padding":
        src_kpm, tgt_kpm = trailing_padding([S, 3, 6], S), trailing_padding([2, T, 4], T)
        pads = {
            "src_key_padding_mask": src_kpm,
            "tgt_key_padding_mask": tgt_kpm,
            "memory_key_padding_mask": src_kpm,
        }
        eng_kw.update(pads)
        ref_kw.update(pads)
    want = _reference(ref, src, tgt, **ref_kw)
    torch.testing.assert_close(model(src, tgt, **eng_kw), want, **FP32)


@pytest.mark.parametrize("seed", range(6))
def test_random_configurations_match_pytorch(seed):
    """Held-out shapes: random heads, head_dim, feed-forward width, lengths and options."""
    rng = random.Random(1000 + seed)
    nhead, head_dim = rng.choice([1, 2, 3, 4, 6]), rng.choice([4, 8, 12])
    d_model, ff = nhead * head_dim, rng.choice([8, 24, 40])
    options = {
        "norm_first": rng.random() < 0.5,
        "activation": rng.choice(["relu", "gelu"]),
        "bias": rng.random() < 0.7,
    }
    b, t, s = rng.randint(1, 4), rng.randint(1, 9), rng.randint(1, 11)
    dec = make_decoder(
        d_model, nhead, ff, rng.randint(1, 3), final_norm=rng.random() < 0.5, seed=seed, **options
    )
    tr = make_transformer(
        d_model, nhead, rng.randint(1, 2), rng.randint(1, 2), ff, seed=seed, **options
    )
    x, mem = torch.randn(b, t, d_model), torch.randn(b, s, d_model)
    causal = nn.Transformer.generate_square_subsequent_mask(t)
    want = _reference(dec, x, mem, tgt_mask=causal, tgt_is_causal=True)
    torch.testing.assert_close(engine_from(dec)(x, mem, tgt_is_causal=True), want, **FP32)
    want = _reference(tr, mem, x, tgt_mask=causal, tgt_is_causal=True)
    torch.testing.assert_close(engine_from(tr)(mem, x, tgt_is_causal=True), want, **FP32)


@pytest.mark.parametrize("norm_first", [False, True])
def test_attention_weights_per_head_match_pytorch(norm_first):
    dec = make_decoder(D, H, num_layers=2, norm_first=norm_first, final_norm=True)
    model = engine_from(dec)
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    mem_kpm = trailing_padding([S, 3, 6], S)
    _, weights = model.attention_weights(
        x, mem, tgt_is_causal=True, memory_key_padding_mask=mem_kpm
    )
    for i, (sw, cw) in enumerate(pytorch_layer_weights(dec.layers, x, mem, causal, mem_kpm)):
        torch.testing.assert_close(weights["self_attn"][i], sw, **FP32)
        torch.testing.assert_close(weights["cross_attn"][i], cw, **FP32)
    _, one = model.attention_weights(x, mem, layer=1, average_attn_weights=True)
    _, every = model.attention_weights(x, mem)
    torch.testing.assert_close(one["cross_attn"], every["cross_attn"][1].mean(1), **FP32)
    with pytest.raises(ValueError, match="layer"):
        model.attention_weights(x, mem, layer=2)


def test_transformer_attention_weights_cover_encoder_and_decoder():
    ref = make_transformer(D, H, 2, 2)
    model = engine_from(ref)
    src, tgt = torch.randn(B, S, D), torch.randn(B, T, D)
    out, weights = model.attention_weights(src, tgt, tgt_is_causal=True)
    assert weights["encoder_self_attn"].shape == (2, B, H, S, S)
    assert weights["self_attn"].shape == (2, B, H, T, T)
    assert weights["cross_attn"].shape == (2, B, H, T, S)
    with torch.no_grad():
        memory = ref.encoder(src)
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    for i, (sw, cw) in enumerate(
        pytorch_layer_weights(ref.decoder.layers, tgt, memory, causal, None)
    ):
        torch.testing.assert_close(weights["self_attn"][i], sw, **FP32)
        torch.testing.assert_close(weights["cross_attn"][i], cw, **FP32)
    torch.testing.assert_close(out, model(src, tgt, tgt_is_causal=True), **FP32)


def test_lone_layer_and_unbatched_inputs():
    dec = make_decoder(D, 1, final_norm=False)
    layer = dec.layers[0]
    model = engine_from(layer)  # a lone TransformerDecoderLayer exports as num_layers=1
    assert model.num_layers == 1 and model.config.final_norm is False
    x, mem = torch.randn(T, D), torch.randn(S, D)
    want = _reference(layer, x, mem, tgt_key_padding_mask=torch.zeros(T, dtype=torch.bool))
    got = model(x, mem, tgt_key_padding_mask=torch.zeros(T, dtype=torch.bool))
    torch.testing.assert_close(got, want, **FP32)
    out, weights = model.attention_weights(x, mem)
    assert out.shape == (T, D) and weights["cross_attn"].shape == (1, 1, T, S)


def test_dense_input_errors_name_the_input():
    model = engine_from(make_decoder(D, H))
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    with pytest.raises(ValueError, match="memory"):
        model(x, torch.randn(B, S, D + 1))
    with pytest.raises(ValueError, match="batch size"):
        model(x, mem[:2])
    with pytest.raises(ValueError, match="tgt"):
        model(torch.randn(B, T, D - 1), mem)


def test_bf16_decoder_close_to_fp32_reference():
    dec = make_decoder(D, H, num_layers=2, final_norm=True)
    model = engine_from(dec, torch.bfloat16)
    x, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    want = _reference(dec, x, mem)
    # two bf16 decoder layers, LayerNorm outputs O(1): measured max abs error below 0.05.
    torch.testing.assert_close(model(x, mem).float(), want, atol=8e-2, rtol=1.6e-2)
