"""Engine MultiheadAttention equals nn.MultiheadAttention for every option it has."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_helpers import FP32, engine_from, make_mha

B, T, S, E = 2, 5, 7, 12
MASKS = [
    "none",
    "kpm_bool",
    "kpm_float",
    "attn2d_bool",
    "attn2d_float",
    "attn3d_bool",
    "attn3d_float",
    "kpm_and_attn",
    "causal",
    "causal_kpm",
]
DIMS = {"same": (None, None), "kv8": (8, 8), "k8v10": (8, 10)}
MODULE_OPTIONS = list(itertools.product([2, 3], [True, False], [False, True], [False, True], DIMS))


def _inputs(dims: str, mode: str, tgt: int, src: int):
    kdim, vdim = DIMS[dims]
    query = torch.randn(B, tgt, E)
    if mode == "self":
        return query, query, query
    key = torch.randn(B, src, kdim or E)
    value = key if mode == "kv_shared" else torch.randn(B, src, vdim or E)
    return query, key, value


def _masks(kind: str, heads: int, tgt: int, src: int):
    """(engine kwargs, reference kwargs); no row is fully masked so PyTorch has no NaN."""
    kpm = torch.rand(B, src) < 0.4
    kpm[:, 0] = False
    attn = torch.rand(tgt, src) < 0.4
    attn[:, 0] = False
    attn3 = torch.rand(B * heads, tgt, src) < 0.4
    attn3[..., 0] = False
    causal = torch.ones(tgt, src, dtype=torch.bool).triu(1)
    table = {
        "none": {},
        "kpm_bool": {"key_padding_mask": kpm},
        "kpm_float": {"key_padding_mask": torch.randn(B, src)},
        "attn2d_bool": {"attn_mask": attn},
        "attn2d_float": {"attn_mask": torch.randn(tgt, src)},
        "attn3d_bool": {"attn_mask": attn3},
        "attn3d_float": {"attn_mask": torch.randn(B * heads, tgt, src)},
        "kpm_and_attn": {"key_padding_mask": kpm, "attn_mask": attn3},
        "causal": {"attn_mask": causal},
        "causal_kpm": {"attn_mask": causal, "key_padding_mask": kpm},
    }
    ref = table[kind]
    eng = dict(ref)
    if kind.startswith("causal"):
        eng.pop("attn_mask")  # the engine builds the causal mask from is_causal alone
        eng["is_causal"] = True
    return eng, ref


@pytest.mark.parametrize("heads,bias,bias_kv,zero_attn,dims", MODULE_OPTIONS)
@pytest.mark.parametrize("mask_kind", MASKS)
def test_mha_matches_pytorch(heads, bias, bias_kv, zero_attn, dims, mask_kind):
    kdim, vdim = DIMS[dims]
    mha = make_mha(
        E, heads, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kdim, vdim=vdim
    )
    model = engine_from(mha)
    modes = ["self", "kv_shared", "cross"] if dims == "same" else ["kv_shared", "cross"]
    if dims == "k8v10":
        modes = ["cross"]
    for mode in modes:
        src = T if mode == "self" else S
        query, key, value = _inputs(dims, mode, T, src)
        eng_kw, ref_kw = _masks(mask_kind, heads, T, src)
        with torch.no_grad():
            for need, avg in [(False, True), (True, True), (True, False)]:
                want, want_w = mha(
                    query, key, value, need_weights=need, average_attn_weights=avg, **ref_kw
                )
                got, got_w = model(
                    query, key, value, need_weights=need, average_attn_weights=avg, **eng_kw
                )
                torch.testing.assert_close(got, want, **FP32, msg=f"{mode} need_weights={need}")
                if need:
                    torch.testing.assert_close(got_w, want_w, **FP32)
                else:
                    assert got_w is None


@pytest.mark.parametrize("heads", [2, 3])
def test_unbatched_inputs_match_pytorch(heads):
    mha = make_mha(E, heads, add_bias_kv=True)
    model = engine_from(mha)
    query, key = torch.randn(T, E), torch.randn(S, E)
    kpm = torch.tensor([False, True, False, True, False, False, True])
    attn = torch.randn(heads, T, S)
    with torch.no_grad():
        want, want_w = mha(
            query, key, key, key_padding_mask=kpm, attn_mask=attn, average_attn_weights=False
        )
    got, got_w = model(
        query,
        key,
        key,
        key_padding_mask=kpm,
        attn_mask=attn,
        need_weights=True,
        average_attn_weights=False,
    )
    assert got.shape == (T, E) and got_w.shape == (heads, T, S + 1)
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(got_w, want_w, **FP32)
    fast, none = model(query, key, key, key_padding_mask=kpm, attn_mask=attn)
    assert none is None
    torch.testing.assert_close(fast, want, **FP32)


def test_batch_first_false_module_exports_same_function():
    torch.manual_seed(0)
    seq_first = torch.nn.MultiheadAttention(E, 3, batch_first=False).eval()
    model = engine_from(seq_first)
    x = torch.randn(B, T, E)
    with torch.no_grad():
        want, _ = seq_first(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1))
    torch.testing.assert_close(model(x)[0], want.transpose(0, 1), **FP32)


def test_fully_masked_row_gives_zeros_where_pytorch_gives_nan():
    mha = make_mha(E, 3)
    model = engine_from(mha)
    x = torch.randn(B, T, E)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1] = True  # every key of sequence 1 is padding
    with torch.no_grad():
        want, want_w = mha(x, x, x, key_padding_mask=kpm)
    assert torch.isnan(want[1]).all()
    got, got_w = model(x, key_padding_mask=kpm, need_weights=True)
    assert not torch.isnan(got).any() and not torch.isnan(got_w).any()
    assert (got_w[1] == 0).all()
    # zero attention leaves only out_proj.bias for the dead rows, in both paths
    torch.testing.assert_close(got[1], mha.out_proj.bias.detach().expand(T, E), **FP32)
    torch.testing.assert_close(model(x, key_padding_mask=kpm)[0], got, **FP32)
    torch.testing.assert_close(got[0], want[0], **FP32)
    torch.testing.assert_close(got_w[0], want_w[0], **FP32)


def test_attention_weights_method_shapes_and_layer_check():
    mha = make_mha(E, 3)
    model = engine_from(mha)
    x = torch.randn(B, T, E)
    _, w = model.attention_weights(x)
    assert w.shape == (B, 3, T, T)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, 3, T), **FP32)
    _, w_avg = model.attention_weights(x, layer=0, average_attn_weights=True)
    torch.testing.assert_close(w_avg, w.mean(1), **FP32)
    with pytest.raises(ValueError, match="layer"):
        model.attention_weights(x, layer=1)


def test_bf16_engine_close_to_fp32_reference():
    mha = make_mha(64, 4)
    model = engine_from(mha, torch.bfloat16)
    x = torch.randn(B, 16, 64)
    with torch.no_grad():
        want, _ = mha(x, x, x, need_weights=False)
    got, _ = model(x)
    assert got.dtype == torch.bfloat16
    # bf16 keeps 8 mantissa bits (eps 7.8e-3); measured max abs error 0.013 over 20 seeds here.
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=1.6e-2)
