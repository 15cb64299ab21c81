"""forward_packed: one packed entry point, one plan per call, opt-in bucketing."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import FP32, engine_from, make_mha
from test_engine_encoder_parity import make_encoder

from mha_engine import varlen
from mha_engine.varlen import cumulative, make_plan

EXACT = {"atol": 0.0, "rtol": 0.0}
LENGTHS = [5, 9, 5, 1, 12]


def _packed_mask(lens, masked):
    """Packed (M,) bool mask: sequence i (in `masked`) hides its last key when longer than 1."""
    parts = []
    for i, n in enumerate(lens):
        m = torch.zeros(n, dtype=torch.bool)
        if i in masked and n > 1:
            m[-1] = True
        parts.append(m)
    return torch.cat(parts)


def test_encoder_packed_equals_varlen_and_per_sequence_calls():
    enc = make_encoder(num_layers=2, final_norm=True)
    model = engine_from(enc)
    x = torch.randn(sum(LENGTHS), 16)
    kpm = _packed_mask(LENGTHS, {1, 4})
    causal = [False, True, False, True, False]
    out = model.forward_packed(x, torch.tensor(cumulative(LENGTHS)), key_padding_mask=kpm,
                               is_causal=causal)  # fmt: skip
    seqs, masks = list(x.split(LENGTHS)), list(kpm.split(LENGTHS))
    listed = model.forward_varlen(seqs, key_padding_mask=masks, is_causal=causal)
    torch.testing.assert_close(out, torch.cat(listed), **EXACT)
    for got, s, m, c in zip(out.split(LENGTHS), seqs, masks, causal, strict=True):
        want = model(s[None], src_key_padding_mask=m[None], is_causal=c)[0]
        torch.testing.assert_close(got, want, **FP32)


def test_mha_cross_attention_packed():
    mha = make_mha(12, 3, kdim=5, vdim=5)
    model = engine_from(mha)
    q_lens, kv_lens = [4, 2, 6], [3, 7, 1]
    q, kv = torch.randn(sum(q_lens), 12), torch.randn(sum(kv_lens), 5)
    out = model.forward_packed(q, cumulative(q_lens), kv, kv, cumulative(kv_lens))
    starts_q, starts_k = cumulative(q_lens), cumulative(kv_lens)
    for i in range(3):
        qi = q[starts_q[i] : starts_q[i + 1]][None]
        ki = kv[starts_k[i] : starts_k[i + 1]][None]
        with torch.no_grad():
            want = mha(qi, ki, ki, need_weights=False)[0][0]
        torch.testing.assert_close(out[starts_q[i] : starts_q[i + 1]], want, **FP32)


def test_one_plan_per_call_reused_by_every_layer(monkeypatch):
    """A 3-layer encoder plans once and makes (layers x groups) SDPA calls (grouped path)."""
    monkeypatch.setenv("MHA_ENGINE_CPU_ATTENTION", "sdpa")
    model = engine_from(make_encoder(num_layers=3))
    plans, sdpa_calls = [], []
    real_plan, real_sdpa = varlen.make_plan, F.scaled_dot_product_attention

    def counting_plan(*args, **kwargs):
        plans.append(real_plan(*args, **kwargs))
        return plans[-1]

    def counting_sdpa(*args, **kwargs):
        sdpa_calls.append(args[0].shape)
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr("mha_engine.models.make_plan", counting_plan)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    model.forward_packed(torch.randn(sum(LENGTHS), 16), cumulative(LENGTHS))
    assert len(plans) == 1
    assert plans[0].num_sdpa_calls == 4  # lengths 5 (x2), 9, 1, 12
    assert len(sdpa_calls) == 3 * 4


def test_all_false_mask_is_no_mask():
    model = engine_from(make_encoder())
    x, cu = torch.randn(sum(LENGTHS), 16), cumulative(LENGTHS)
    none = model.forward_packed(x, cu)
    all_false = model.forward_packed(x, cu, key_padding_mask=torch.zeros(len(x), dtype=torch.bool))
    zeros = model.forward_packed(x, cu, key_padding_mask=torch.zeros(len(x)))
    torch.testing.assert_close(all_false, none, **EXACT)
    torch.testing.assert_close(zeros, none, **EXACT)


@pytest.mark.parametrize("budget", [0.1, 0.5, 2.0])
def test_bucket_padding_bound_on_wasted_attention_flops(budget):
    rng = random.Random(budget)
    lens = [rng.randint(16, 256) for _ in range(32)]
    exact = make_plan(lens)
    plan = make_plan(lens, bucket_padding=budget)
    assert plan.num_sdpa_calls < exact.num_sdpa_calls
    covered = []
    for g in plan.groups:
        members = _member_lengths(g)  # self-attention: T_i == S_i
        assert g.size * g.tgt_len * g.src_len <= (1 + budget) * sum(n * n for n in members)
        covered += members
    assert sorted(covered) == sorted(lens)


def _member_lengths(g) -> list[int]:
    """Token count of each sequence in a group (padded groups list their real rows)."""
    if g.real is None:
        return [g.tgt_len] * g.size
    per_row = (g.real // g.tgt_len).tolist()  # bucket position of every real query row
    return [per_row.count(i) for i in range(g.size)]


def test_bucketed_outputs_match_exact_closely_with_fewer_calls():
    """Opt-in bucketing: fp32 tolerance (not bit-exact: masked padding changes SDPA's sums)."""
    model = engine_from(make_encoder(num_layers=2, norm_first=True))
    rng = random.Random(3)
    lens = [rng.randint(1, 40) for _ in range(24)]
    x, cu = torch.randn(sum(lens), 16), cumulative(lens)
    kpm = _packed_mask(lens, {0, 5, 7})
    causal = [i % 3 == 0 for i in range(len(lens))]
    exact = model.forward_packed(x, cu, key_padding_mask=kpm, is_causal=causal)
    bucketed = model.forward_packed(x, cu, key_padding_mask=kpm, is_causal=causal,
                                    bucket_padding=0.5)  # fmt: skip
    torch.testing.assert_close(bucketed, exact, **FP32)
    assert make_plan(lens, bucket_padding=0.5).num_sdpa_calls < make_plan(lens).num_sdpa_calls


def test_mha_cross_attention_bucketed_with_extra_keys():
    mha = make_mha(12, 3, add_bias_kv=True, add_zero_attn=True)
    model = engine_from(mha)
    q_lens, kv_lens = [4, 6, 5, 3], [7, 6, 8, 2]
    q, kv = torch.randn(sum(q_lens), 12), torch.randn(sum(kv_lens), 12)
    args = (q, cumulative(q_lens), kv, kv, cumulative(kv_lens))
    torch.testing.assert_close(
        model.forward_packed(*args, bucket_padding=1.0), model.forward_packed(*args), **FP32
    )


def test_packed_argument_errors():
    model = engine_from(make_mha(12, 3))
    x = torch.randn(6, 12)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at the token count"):
        model.forward_packed(x, [0, 4])
    with pytest.raises(ValueError, match="must not decrease"):
        model.forward_packed(x, [0, 4, 2, 6])
    with pytest.raises(ValueError, match=r"query must be packed \(tokens, 12\)"):
        model.forward_packed(x[None], [0, 6])
    with pytest.raises(ValueError, match="key_padding_mask shape"):
        model.forward_packed(x, [0, 6], key_padding_mask=torch.zeros(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="need a key"):
        model.forward_packed(x, [0, 6], cu_seqlens_k=[0, 6])
    with pytest.raises(ValueError, match="bucket_padding"):
        model.forward_packed(x, [0, 6], bucket_padding=-1)
    encoder = engine_from(make_encoder())
    with pytest.raises(ValueError, match="self-attention only"):
        encoder.forward_packed(torch.randn(4, 16), [0, 4], key=torch.randn(4, 16))
