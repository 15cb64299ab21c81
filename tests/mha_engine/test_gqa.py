"""Grouped-query attention (num_kv_heads < num_heads) against a reference that repeats K/V heads.

The reference below projects K/V to num_kv_heads heads and repeats each one explicitly for its
group of query heads, then runs a plain softmax; the engine uses SDPA's enable_gqa (or its
expand fallback) and must give the same outputs and attention weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import FP32
from safetensors.torch import save_file
from torch import nn

import mha_engine.attention as attention
from mha_engine import CheckpointError, load_model

E = 16


class RepeatKVAttention(nn.Module):
    """GQA written out: K/V heads repeated with repeat_interleave, explicit softmax."""

    def __init__(self, num_heads, num_kv_heads, kdim=E, vdim=E, bias_kv=False, zero_attn=False):
        super().__init__()
        self.h, self.h_kv, self.hd = num_heads, num_kv_heads, E // num_heads
        kv = num_kv_heads * self.hd
        self.q_proj = nn.Linear(E, E)
        self.k_proj = nn.Linear(kdim, kv)
        self.v_proj = nn.Linear(vdim, kv)
        self.out_proj = nn.Linear(E, E)
        self.bias_k = nn.Parameter(torch.randn(1, 1, kv)) if bias_kv else None
        self.bias_v = nn.Parameter(torch.randn(1, 1, kv)) if bias_kv else None
        self.zero_attn = zero_attn

    def forward(self, query, key, value, key_padding_mask=None, is_causal=False):
        B, T, _ = query.shape
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        S = k.shape[1]
        kpm = torch.zeros(B, S, dtype=torch.bool) if key_padding_mask is None else key_padding_mask
        extra = []
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(B, 1, -1)], 1)
            v = torch.cat([v, self.bias_v.expand(B, 1, -1)], 1)
            extra.append(torch.zeros(B, 1, dtype=torch.bool))
        if self.zero_attn:
            k = torch.cat([k, k.new_zeros(B, 1, k.shape[-1])], 1)
            v = torch.cat([v, v.new_zeros(B, 1, v.shape[-1])], 1)
            extra.append(torch.zeros(B, 1, dtype=torch.bool))
        kpm = torch.cat([kpm, *extra], 1)  # appended keys are always visible
        q = q.view(B, T, self.h, self.hd).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, -1, self.h_kv, self.hd).transpose(1, 2)  # (B, Hkv, S', hd)
        v = v.view(B, -1, self.h_kv, self.hd).transpose(1, 2)
        k = k.repeat_interleave(self.h // self.h_kv, dim=1)  # (B, H, S', hd)
        v = v.repeat_interleave(self.h // self.h_kv, dim=1)
        scores = q @ k.transpose(-2, -1) / self.hd**0.5  # (B, H, T, S')
        scores = scores.masked_fill(kpm[:, None, None, :], float("-inf"))
        if is_causal:
            causal = torch.ones(T, scores.shape[-1], dtype=torch.bool).triu(1)
            scores = scores.masked_fill(causal, float("-inf"))
        weights = scores.softmax(-1)
        y = (weights @ v).transpose(1, 2).reshape(B, T, E)
        return self.out_proj(y), weights


def make_reference(num_heads, num_kv_heads, seed=0, **kwargs):
    torch.manual_seed(seed)
    module = RepeatKVAttention(num_heads, num_kv_heads, **kwargs)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module.eval()


def save_pytorch_names(module: RepeatKVAttention, path, **config):
    """PyTorch's in_proj layout (Q/K/V rows stacked) with a num_kv_heads config."""
    m = module
    state = {"out_proj.weight": m.out_proj.weight, "out_proj.bias": m.out_proj.bias}
    if m.k_proj.in_features == E and m.v_proj.in_features == E:
        state["in_proj_weight"] = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])
    else:
        state.update(
            q_proj_weight=m.q_proj.weight,
            k_proj_weight=m.k_proj.weight,
            v_proj_weight=m.v_proj.weight,
        )
    state["in_proj_bias"] = torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias])
    if m.bias_k is not None:
        state.update(bias_k=m.bias_k, bias_v=m.bias_v)
    config = {
        "architecture": "multihead_attention",
        "embed_dim": E,
        "num_heads": m.h,
        "num_kv_heads": m.h_kv,
        **config,
    }
    (path / "config.json").write_text(json.dumps(config))
    state = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(state, str(path / "model.safetensors"))
    return path


B, T = 3, 6
HEADS = [(4, 1), (4, 2), (8, 2), (8, 4), (4, 4)]


def _kpm(S=T):
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, S - 2 :] = True
    kpm[2, 3] = True  # not key 0: a causal row 0 would have no key left
    return kpm


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_self_attention_matches_repeated_kv_reference(tmp_path, heads, kv_heads, is_causal):
    ref = make_reference(heads, kv_heads)
    model = load_model(save_pytorch_names(ref, tmp_path), device="cpu")
    assert (model.num_heads, model.num_kv_heads) == (heads, kv_heads)
    x, kpm = torch.randn(B, T, E), _kpm()
    with torch.no_grad():
        want, want_w = ref(x, x, x, kpm, is_causal)
    got, _ = model(x, key_padding_mask=kpm, is_causal=is_causal)
    torch.testing.assert_close(got, want, **FP32)
    out, weights = model.attention_weights(x, key_padding_mask=kpm, is_causal=is_causal)
    torch.testing.assert_close(out, want, **FP32)
    torch.testing.assert_close(weights, want_w, **FP32)
    outs = model.forward_varlen(list(x), key_padding_mask=list(kpm), is_causal=is_causal)
    for o, w in zip(outs, want, strict=True):
        torch.testing.assert_close(o, w, **FP32)


def test_expand_fallback_equals_enable_gqa(tmp_path, monkeypatch):
    ref = make_reference(8, 2)
    model = load_model(save_pytorch_names(ref, tmp_path), device="cpu")
    x, kpm = torch.randn(B, T, E), _kpm()
    fast, _ = model(x, key_padding_mask=kpm)
    monkeypatch.setattr(attention, "SDPA_HAS_GQA", False)
    expanded, _ = model(x, key_padding_mask=kpm)
    torch.testing.assert_close(expanded, fast, **FP32)


@pytest.mark.parametrize("bias_kv,zero_attn", [(True, False), (False, True), (True, True)])
def test_cross_attention_with_extra_keys(tmp_path, bias_kv, zero_attn):
    ref = make_reference(4, 2, kdim=5, vdim=7, bias_kv=bias_kv, zero_attn=zero_attn)
    path = save_pytorch_names(
        ref, tmp_path, kdim=5, vdim=7, add_bias_kv=bias_kv, add_zero_attn=zero_attn
    )
    model = load_model(path, device="cpu")
    q, k, v, kpm = torch.randn(B, T, E), torch.randn(B, 9, 5), torch.randn(B, 9, 7), _kpm(9)
    with torch.no_grad():
        want, want_w = ref(q, k, v, kpm)
    got, weights = model.attention_weights(q, k, v, key_padding_mask=kpm)
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(weights, want_w, **FP32)
    torch.testing.assert_close(model(q, k, v, key_padding_mask=kpm)[0], want, **FP32)
    outs = model.forward_varlen(list(q), list(k), list(v), key_padding_mask=list(kpm))
    for o, w in zip(outs, want, strict=True):
        torch.testing.assert_close(o, w, **FP32)


def test_bf16_gqa_stays_close(tmp_path):
    ref = make_reference(8, 2)
    model = load_model(save_pytorch_names(ref, tmp_path), device="cpu", dtype="bfloat16")
    x = torch.randn(B, T, E)
    with torch.no_grad():
        want, _ = ref(x, x, x)
    got, _ = model(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)


def test_diagnostics_name_gqa_as_a_fast_path_blocker(tmp_path):
    model = load_model(save_pytorch_names(make_reference(4, 2), tmp_path), device="cpu")
    assert "num_kv_heads" in model.diagnostics()["pytorch_fast_path_blockers"]


def test_heads_not_divisible_by_kv_heads(tmp_path):
    path = save_pytorch_names(make_reference(4, 2), tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, num_kv_heads=3)))
    with pytest.raises(CheckpointError, match="num_heads 4 is not divisible by num_kv_heads 3"):
        load_model(path)


def test_kv_projection_sized_for_num_kv_heads(tmp_path):
    """A K/V projection of full width with num_kv_heads=2 is caught with both shapes."""
    path = save_pytorch_names(make_reference(4, 4), tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, num_kv_heads=2)))
    with pytest.raises(
        CheckpointError, match=r"in_proj_weight: expected shape \(32, 16\), got \(48, 16\)"
    ):
        load_model(path)
