"""Engine transformer encoders equal nn.TransformerEncoderLayer / nn.TransformerEncoder."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_helpers import FP32, engine_from
from torch import nn

B, T, D = 3, 6, 16


def make_encoder(
    nhead=4,
    activation="relu",
    norm_first=False,
    bias=True,
    num_layers=1,
    final_norm=False,
    eps=1e-5,
    nested=False,
):
    torch.manual_seed(7)
    layer = nn.TransformerEncoderLayer(
        D,
        nhead,
        32,
        dropout=0.1,
        activation=activation,
        layer_norm_eps=eps,
        batch_first=True,
        norm_first=norm_first,
        bias=bias,
    )
    norm = nn.LayerNorm(D, eps=eps, bias=bias) if final_norm else None
    enc = nn.TransformerEncoder(layer, num_layers, norm=norm, enable_nested_tensor=nested)
    with torch.no_grad():  # LayerNorm starts at weight 1, bias 0: perturb so it is tested
        for name, p in enc.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return enc.eval()


def _mask_case(kind: str, nhead: int):
    """(engine kwargs, reference kwargs) for nn.TransformerEncoder.forward."""
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, 4:] = True
    kpm[2, 2] = True
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    table = {
        "none": ({}, {}),
        "kpm": ({"src_key_padding_mask": kpm}, {"src_key_padding_mask": kpm}),
        "float_mask": ({"mask": torch.randn(T, T)},) * 2,
        "mask3d": ({"mask": torch.randn(B * nhead, T, T)},) * 2,
        "causal": ({"is_causal": True}, {"mask": causal, "is_causal": True}),
        "causal_kpm": (
            {"is_causal": True, "src_key_padding_mask": kpm},
            {"mask": causal, "is_causal": True, "src_key_padding_mask": kpm.float() * -1e9},
        ),
    }
    eng, ref = table[kind]
    return dict(eng), dict(ref)


OPTIONS = list(itertools.product([False, True], ["relu", "gelu"], [True, False], [False, True]))


@pytest.mark.parametrize("norm_first,activation,bias,final_norm", OPTIONS)
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize(
    "mask_kind", ["none", "kpm", "float_mask", "mask3d", "causal", "causal_kpm"]
)
def test_encoder_matches_pytorch(norm_first, activation, bias, final_norm, num_layers, mask_kind):
    enc = make_encoder(4, activation, norm_first, bias, num_layers, final_norm, eps=1e-6)
    model = engine_from(enc)
    x = torch.randn(B, T, D)
    eng_kw, ref_kw = _mask_case(mask_kind, 4)
    if mask_kind == "causal_kpm":  # float -1e9 padding vs engine's bool -inf: same softmax
        eng_kw["src_key_padding_mask"] = ref_kw["src_key_padding_mask"].bool()
    # Measured on torch 2.13 CPU: the encoder-layer fast path returns NaN for a float src_mask,
    # so float-mask references use PyTorch's slow (documented) path.
    slow = mask_kind in ("float_mask", "mask3d")
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(previous and not slow)
    try:
        with torch.no_grad():
            want = enc(x, **ref_kw)
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)
    assert not want.isnan().any()
    torch.testing.assert_close(model(x, **eng_kw), want, **FP32)
    out, weights = model.attention_weights(x, **eng_kw)
    torch.testing.assert_close(out, want, **FP32)
    assert weights.shape == (num_layers, B, 4, T, T)


def test_single_layer_odd_heads_and_unbatched():
    enc = make_encoder(nhead=1)
    layer = enc.layers[0]
    model = engine_from(layer)  # a lone TransformerEncoderLayer exports as num_layers=1
    assert model.num_layers == 1 and model.config.final_norm is False
    x = torch.randn(T, D)
    with torch.no_grad():
        torch.testing.assert_close(model(x), layer(x), **FP32)
    enc3 = nn.TransformerEncoderLayer(D - 1, 3, 20, batch_first=True).eval()
    model3 = engine_from(enc3)
    x3 = torch.randn(B, T, D - 1)
    with torch.no_grad():
        torch.testing.assert_close(model3(x3), enc3(x3), **FP32)


def test_nested_tensor_reference_agrees_on_real_tokens():
    """PyTorch's nested fast path zeroes padded rows; the engine computes them, real rows agree."""
    enc = make_encoder(nested=True, num_layers=2)
    model = engine_from(enc)
    x = torch.randn(B, T, D)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[0, 3:] = True
    with torch.no_grad():
        want = enc(x, src_key_padding_mask=kpm)
    got = model(x, src_key_padding_mask=kpm)
    torch.testing.assert_close(got[~kpm], want[~kpm], **FP32)


def test_attention_weights_per_layer_match_pytorch_layer_weights():
    enc = make_encoder(num_layers=2, norm_first=True)
    model = engine_from(enc)
    x = torch.randn(B, T, D)
    _, weights = model.attention_weights(x)
    h = x
    with torch.no_grad():
        for i, layer in enumerate(enc.layers):
            normed = layer.norm1(h)
            _, want = layer.self_attn(normed, normed, normed, average_attn_weights=False)
            torch.testing.assert_close(weights[i], want, **FP32)
            h = layer(h)
    _, avg = model.attention_weights(x, layer=1, average_attn_weights=True)
    torch.testing.assert_close(avg, weights[1].mean(1), **FP32)
    with pytest.raises(ValueError, match="layer"):
        model.attention_weights(x, layer=2)


def test_bf16_encoder_close_to_fp32_reference():
    enc = make_encoder(num_layers=2)
    model = engine_from(enc, torch.bfloat16)
    x = torch.randn(B, T, D)
    with torch.no_grad():
        want = enc(x)
    # two bf16 layers, LayerNorm outputs O(1): measured max abs error 0.027 over 20 seeds.
    torch.testing.assert_close(model(x).float(), want, atol=8e-2, rtol=1.6e-2)
