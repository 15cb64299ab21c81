"""Packed decoders: two cu_seqlens (target, memory), parity with padded PyTorch on real rows,
bit-exact batch invariance (a sequence packed with others equals it alone), argument errors."""

from __future__ import annotations

import pytest
import torch
from decoder_helpers import make_decoder, make_transformer, trailing_padding
from engine_helpers import FP32, engine_from
from torch import nn

from mha_engine.varlen import cumulative

D, H = 24, 4
TGT_LENS = [5, 1, 9, 5, 3]
MEM_LENS = [7, 4, 2, 7, 11]


def _padded(seqs: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(seqs, batch_first=True)  # (B, L, E)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_decoder_equals_padded_pytorch_on_real_rows(norm_first, causal):
    dec = make_decoder(D, H, 48, num_layers=2, norm_first=norm_first, final_norm=True)
    model = engine_from(dec)
    tgts = [torch.randn(n, D) for n in TGT_LENS]
    mems = [torch.randn(n, D) for n in MEM_LENS]
    out = model.forward_packed(
        torch.cat(tgts),
        cumulative(TGT_LENS),
        torch.cat(mems),
        cumulative(MEM_LENS),
        tgt_is_causal=causal,
    )  # (N, E)
    T = max(TGT_LENS)
    kwargs = {
        "tgt_key_padding_mask": trailing_padding(TGT_LENS, T),
        "memory_key_padding_mask": trailing_padding(MEM_LENS, max(MEM_LENS)),
    }
    if causal:
        kwargs.update(
            tgt_mask=nn.Transformer.generate_square_subsequent_mask(T), tgt_is_causal=True
        )
    with torch.no_grad():
        want = dec(_padded(tgts), _padded(mems), **kwargs)  # (B, T, E)
    real = ~kwargs["tgt_key_padding_mask"]
    torch.testing.assert_close(out, want[real], **FP32)


def test_packed_transformer_equals_padded_pytorch_on_real_rows():
    ref = make_transformer(D, H, 2, 2, 48, norm_first=True)  # no nested-tensor encoder path
    model = engine_from(ref)
    srcs = [torch.randn(n, D) for n in MEM_LENS]
    tgts = [torch.randn(n, D) for n in TGT_LENS]
    out = model.forward_packed(
        torch.cat(srcs),
        cumulative(MEM_LENS),
        torch.cat(tgts),
        cumulative(TGT_LENS),
        tgt_is_causal=True,
    )
    T = max(TGT_LENS)
    src_kpm = trailing_padding(MEM_LENS, max(MEM_LENS))
    tgt_kpm = trailing_padding(TGT_LENS, T)
    with torch.no_grad():
        want = ref(
            _padded(srcs),
            _padded(tgts),
            tgt_mask=nn.Transformer.generate_square_subsequent_mask(T),
            tgt_is_causal=True,
            src_key_padding_mask=src_kpm,
            tgt_key_padding_mask=tgt_kpm,
            memory_key_padding_mask=src_kpm,
        )
    torch.testing.assert_close(out, want[~tgt_kpm], **FP32)
    alone = model.forward_varlen(srcs[2:3], tgts[2:3], tgt_is_causal=True)[0]
    assert torch.equal(alone, out[sum(TGT_LENS[:2]) : sum(TGT_LENS[:3])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_batch_invariance_is_bit_exact(dtype):
    """Each sequence's output is the same bits alone as packed with any batch-mates."""
    model = engine_from(make_decoder(D, H, 48, num_layers=2, final_norm=True), dtype)
    tgts = [torch.randn(n, D) for n in TGT_LENS]
    mems = [torch.randn(n, D) for n in MEM_LENS]
    causal = [True, False, True, True, False]
    batch = model.forward_varlen(tgts, mems, tgt_is_causal=causal)
    for i in range(len(tgts)):
        alone = model.forward_varlen([tgts[i]], [mems[i]], tgt_is_causal=causal[i])[0]
        assert torch.equal(alone, batch[i]), f"sequence {i} differs alone"
    shuffled = model.forward_varlen(tgts[::-1], mems[::-1], tgt_is_causal=causal[::-1])
    for a, b in zip(batch, shuffled[::-1], strict=True):
        assert torch.equal(a, b)


def test_packed_padding_masks_hide_keys():
    """Packed masks (N,) / (M,): masking a memory's last keys equals dropping them."""
    model = engine_from(make_decoder(D, H, 48, num_layers=2))
    tgt, mem = torch.randn(6, D), torch.randn(9, D)
    mem_kpm = torch.zeros(9, dtype=torch.bool)
    mem_kpm[6:] = True
    tgt_kpm = torch.zeros(6, dtype=torch.bool)
    tgt_kpm[4:] = True
    masked = model.forward_packed(
        tgt, [0, 6], mem, [0, 9], tgt_key_padding_mask=tgt_kpm, memory_key_padding_mask=mem_kpm
    )
    dense = model(
        tgt[None],
        mem[None],
        tgt_key_padding_mask=tgt_kpm[None],
        memory_key_padding_mask=mem_kpm[None],
    )[0]
    torch.testing.assert_close(masked, dense, **FP32)
    dropped = model.forward_packed(tgt, [0, 6], mem[:6], [0, 6], tgt_key_padding_mask=tgt_kpm)
    torch.testing.assert_close(masked, dropped, **FP32)
    unmasked = model.forward_packed(tgt, [0, 6], mem, [0, 9])
    assert not torch.allclose(masked, unmasked)


def test_cross_attention_projects_memory_once_per_layer(monkeypatch):
    """Per layer: one Q GEMM on the targets, one fused K/V GEMM (in_proj rows [K; V]) on the
    packed memory."""
    from mha_engine import attention

    model = engine_from(make_decoder(D, H, 48, num_layers=2))
    calls = []
    real = attention.linear_rows

    def spy(linear, x, start, stop):
        calls.append((tuple(x.shape), start, stop))
        return real(linear, x, start, stop)

    monkeypatch.setattr(attention, "linear_rows", spy)
    tgt, mem = torch.randn(18, D), torch.randn(17, D)  # above fused.MIN_ROWS: no padding
    model.forward_packed(tgt, [0, 3, 18], mem, [0, 6, 17])
    assert calls == [((18, D), 0, D), ((17, D), D, 3 * D)] * 2


def test_packed_argument_errors_name_the_input():
    model = engine_from(make_decoder(D, H, 48))
    tgt, mem = torch.randn(8, D), torch.randn(13, D)
    with pytest.raises(ValueError, match="memory"):
        model.forward_packed(tgt, [0, 3, 8], mem, [0, 13])
    with pytest.raises(ValueError, match="memory"):
        model.forward_packed(tgt, [0, 8], torch.randn(13, D + 2), [0, 13])
    with pytest.raises(ValueError, match="cu_seqlens_memory"):
        model.forward_packed(tgt, [0, 8], mem, [0, 12])
    with pytest.raises(ValueError, match="tgt"):
        model.forward_packed(torch.randn(8, D, 1), [0, 8], mem, [0, 13])
    tr = engine_from(make_transformer(D, H, 1, 1, 48))
    with pytest.raises(ValueError, match="src"):
        tr.forward_packed(torch.randn(5, D - 1), [0, 5], tgt, [0, 8])


def test_int8_decoder_close_to_fp32_and_batch_invariant(tmp_path):
    """dtype="int8" quantizes every Linear, cross-attention's row blocks included. Measured on
    this decoder (LayerNorm outputs O(1)): max |int8 - fp32| 0.027."""
    from mha_engine import load_model, save_model
    from mha_engine.quantize import int8_unsupported_reason

    if int8_unsupported_reason("cpu") is not None:
        pytest.skip(str(int8_unsupported_reason("cpu")))
    save_model(make_decoder(32, 4, 64, num_layers=2, final_norm=True), tmp_path)
    q = load_model(tmp_path, device="cpu", dtype="int8")
    f = load_model(tmp_path, device="cpu")
    assert q.precision == "int8"
    tgts = [torch.randn(n, 32) for n in (5, 13, 3)]
    mems = [torch.randn(n, 32) for n in (7, 2, 20)]
    got, want = q.forward_varlen(tgts, mems, True), f.forward_varlen(tgts, mems, True)
    assert max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)) < 0.1
    for i in range(3):
        assert torch.equal(q.forward_varlen([tgts[i]], [mems[i]], True)[0], got[i])
