"""forward_varlen equals per-sequence calls and PyTorch; no sequence depends on batch-mates."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import FP32, engine_from, make_mha
from test_engine_encoder_parity import make_encoder

E = 12
LENGTHS = [5, 3, 5, 8, 1, 3, 5]  # repeats so several groups hold more than one sequence


def _kpm(length: int, i: int):
    if i % 3 != 1:
        return None
    mask = torch.zeros(length, dtype=torch.bool)
    mask[length // 2 + 1 :] = True
    return mask


@pytest.mark.parametrize(
    "bias_kv,zero_attn,heads", [(False, False, 2), (True, True, 3), (False, True, 3)]
)
def test_mha_self_attention_varlen(bias_kv, zero_attn, heads):
    mha = make_mha(E, heads, add_bias_kv=bias_kv, add_zero_attn=zero_attn)
    model = engine_from(mha)
    seqs = [torch.randn(n, E) for n in LENGTHS]
    masks = [_kpm(n, i) for i, n in enumerate(LENGTHS)]
    causal = [i % 2 == 0 for i in range(len(LENGTHS))]
    outs = model.forward_varlen(seqs, key_padding_mask=masks, is_causal=causal)
    assert [o.shape for o in outs] == [(n, E) for n in LENGTHS]
    for x, m, c, got in zip(seqs, masks, causal, outs, strict=True):
        alone, _ = model(x, key_padding_mask=m, is_causal=c)
        torch.testing.assert_close(got, alone, **FP32)
        attn_mask = torch.ones(len(x), len(x), dtype=torch.bool).triu(1) if c else None
        with torch.no_grad():
            want, _ = mha(x, x, x, key_padding_mask=m, attn_mask=attn_mask)
        torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("kdim,vdim,shared", [(None, None, True), (8, 8, True), (8, 10, False)])
def test_mha_cross_attention_varlen(kdim, vdim, shared):
    mha = make_mha(E, 3, kdim=kdim, vdim=vdim)
    model = engine_from(mha)
    src_lens = [4, 9, 4, 2, 9, 4, 6]
    queries = [torch.randn(n, E) for n in LENGTHS]
    keys = [torch.randn(s, kdim or E) for s in src_lens]
    values = keys if shared else [torch.randn(s, vdim or E) for s in src_lens]
    masks = [_kpm(s, i) for i, s in enumerate(src_lens)]
    outs = model.forward_varlen(queries, keys, values, key_padding_mask=masks)
    for q, k, v, m, got in zip(queries, keys, values, masks, outs, strict=True):
        with torch.no_grad():
            want, _ = mha(q, k, v, key_padding_mask=m)
        torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_varlen_matches_per_sequence(norm_first):
    enc = make_encoder(num_layers=2, norm_first=norm_first, final_norm=True)
    model = engine_from(enc)
    seqs = [torch.randn(n, 16) for n in LENGTHS]
    masks = [_kpm(n, i) for i, n in enumerate(LENGTHS)]
    outs = model.forward_varlen(seqs, key_padding_mask=masks, is_causal=True)
    for x, m, got in zip(seqs, masks, outs, strict=True):
        causal = torch.nn.Transformer.generate_square_subsequent_mask(len(x))
        with torch.no_grad():
            want = enc(x[None], mask=causal, src_key_padding_mask=None if m is None else m[None])
        torch.testing.assert_close(got, want[0][: len(x)], **FP32)
        torch.testing.assert_close(got, model(x, src_key_padding_mask=m, is_causal=True), **FP32)
    with pytest.raises(ValueError, match="self-attention only"):
        model.forward_varlen(seqs, key=seqs)


def test_batch_invariance():
    """The same sequence gives the same output alone, with other lengths, and with equal lengths."""
    model = engine_from(make_encoder(num_layers=2))
    target = torch.randn(7, 16)
    alone = model.forward_varlen([target])[0]
    mixed = model.forward_varlen([torch.randn(3, 16), target, torch.randn(11, 16)])[1]
    same_len = model.forward_varlen([torch.randn(7, 16), torch.randn(7, 16), target])[2]
    big = model.forward_varlen([torch.randn(n, 16) for n in range(1, 40)] + [target])[-1]
    for other in (mixed, same_len, big):
        torch.testing.assert_close(other, alone, **FP32)


def test_varlen_argument_errors():
    model = engine_from(make_mha(E, 3))
    seqs = [torch.randn(4, E), torch.randn(2, E)]
    with pytest.raises(ValueError, match="is_causal"):
        model.forward_varlen(seqs, is_causal=[True])
    with pytest.raises(ValueError, match="key_padding_mask"):
        model.forward_varlen(seqs, key_padding_mask=[torch.zeros(3, dtype=torch.bool), None])
