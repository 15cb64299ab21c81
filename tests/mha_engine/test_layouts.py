"""Attention modules written the way tutorials and reference repos write them load and match.

Each module below is written in its source's style (separate W_q/W_k/W_v/W_o, fc_out, the
Annotated Transformer's linears, q_proj/…/out_proj, gpt-fast's wqkv/wo and wq/wk/wv/wo, a
per-head packed qkv_proj, timm's qkv/proj). Its state dict is saved as is, with a
multihead_attention config.json, and the loaded engine model must give the module's numbers.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import FP32
from safetensors.torch import save_file
from torch import nn

from mha_engine import CheckpointError, load_model

E, H = 16, 4
HD = E // H


def _heads(x, n):  # (B, T, n*HD) -> (B, n, T, HD)
    return x.view(x.shape[0], x.shape[1], n, HD).transpose(1, 2)


def _merge(x):  # (B, H, T, HD) -> (B, T, E)
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)


def _keep_mask(key_padding_mask):
    """Tutorial masks: (B, 1, 1, S) with 1 = attend, from PyTorch's True = ignore."""
    return None if key_padding_mask is None else (~key_padding_mask)[:, None, None, :]


class ScratchMHA(nn.Module):
    """'Transformer from scratch' tutorials: W_q/W_k/W_v and W_o (or fc_out), -1e9 masking."""

    def __init__(self, d_model=E, num_heads=H, out_name="W_o", kdim=None, vdim=None):
        super().__init__()
        self.d_k = d_model // num_heads
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(kdim or d_model, d_model)
        self.W_v = nn.Linear(vdim or d_model, d_model)
        self.out_name = out_name
        setattr(self, out_name, nn.Linear(d_model, d_model))

    def forward(self, Q, K, V, key_padding_mask=None):
        q, k, v = _heads(self.W_q(Q), H), _heads(self.W_k(K), H), _heads(self.W_v(V), H)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        mask = _keep_mask(key_padding_mask)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        return getattr(self, self.out_name)(_merge(torch.softmax(scores, dim=-1) @ v))


class EinsumSelfAttention(nn.Module):
    """queries/keys/values + fc_out, einsum style (fc_out tutorials)."""

    def __init__(self):
        super().__init__()
        self.values, self.keys, self.queries = (nn.Linear(E, E) for _ in range(3))
        self.fc_out = nn.Linear(E, E)

    def forward(self, x, key_padding_mask=None):
        B, T, _ = x.shape
        q = self.queries(x).reshape(B, T, H, HD)
        k = self.keys(x).reshape(B, T, H, HD)
        v = self.values(x).reshape(B, T, H, HD)
        energy = torch.einsum("nqhd,nkhd->nhqk", q, k) / HD**0.5
        if key_padding_mask is not None:
            energy = energy.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        out = torch.einsum("nhql,nlhd->nqhd", torch.softmax(energy, dim=3), v)
        return self.fc_out(out.reshape(B, T, E))


class AnnotatedMHA(nn.Module):
    """The Annotated Transformer: clones(nn.Linear(d_model, d_model), 4)."""

    def __init__(self):
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(E, E) for _ in range(4)])

    def forward(self, query, key, value, key_padding_mask=None):
        inputs = zip(self.linears[:3], (query, key, value), strict=True)
        q, k, v = (_heads(lin(x), H) for lin, x in inputs)
        scores = q @ k.transpose(-2, -1) / math.sqrt(HD)
        mask = _keep_mask(key_padding_mask)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        return self.linears[-1](_merge(scores.softmax(dim=-1) @ v))


class ProjAttention(nn.Module):
    """fairseq / BART style: q_proj, k_proj, v_proj, out_proj, scaling applied to q."""

    def __init__(self):
        super().__init__()
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = (nn.Linear(E, E) for _ in range(4))

    def forward(self, x, key_padding_mask=None):
        q = _heads(self.q_proj(x) * HD**-0.5, H)
        k, v = _heads(self.k_proj(x), H), _heads(self.v_proj(x), H)
        scores = q @ k.transpose(-2, -1)
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        return self.out_proj(_merge(scores.softmax(-1) @ v))


class GptFastAttention(nn.Module):
    """gpt-fast: fused wqkv (or wq/wk/wv) without bias, n_local_heads K/V heads, wo."""

    def __init__(self, n_head=H, n_local_heads=H, fused=True):
        super().__init__()
        self.n_head, self.n_local_heads = n_head, n_local_heads
        self.kv_size = n_local_heads * HD
        if fused:
            self.wqkv = nn.Linear(E, E + 2 * self.kv_size, bias=False)
        else:
            self.wq = nn.Linear(E, E, bias=False)
            self.wk = nn.Linear(E, self.kv_size, bias=False)
            self.wv = nn.Linear(E, self.kv_size, bias=False)
        self.wo = nn.Linear(E, E, bias=False)

    def forward(self, x, key_padding_mask=None, is_causal=False):
        if hasattr(self, "wqkv"):
            q, k, v = self.wqkv(x).split([E, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = _heads(q, self.n_head)
        k, v = _heads(k, self.n_local_heads), _heads(v, self.n_local_heads)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        mask = _keep_mask(key_padding_mask)
        if is_causal:
            T = x.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            mask = causal if mask is None else mask & causal
        return self.wo(_merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


class PerHeadQKV(nn.Module):
    """UvA deep-learning tutorial: qkv_proj output reshaped (B, T, H, 3*HD), chunked; o_proj."""

    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(E, 3 * E)
        self.o_proj = nn.Linear(E, E)

    def forward(self, x, key_padding_mask=None):
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).reshape(B, T, H, 3 * HD).permute(0, 2, 1, 3)
        q, k, v = qkv.chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(HD)
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], -9e15)
        return self.o_proj(_merge(F.softmax(scores, dim=-1) @ v))


class TimmAttention(nn.Module):
    """timm ViT: qkv (bias off by default) reshaped (B, N, 3, H, HD); proj with bias."""

    def __init__(self, qkv_bias=False):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E, bias=qkv_bias)
        self.proj = nn.Linear(E, E)

    def forward(self, x, key_padding_mask=None):
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, H, HD).permute(2, 0, 3, 1, 4).unbind(0)
        mask = _keep_mask(key_padding_mask)
        return self.proj(_merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


def _seeded(module: nn.Module, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module.eval()


def _save(tmp_path, module: nn.Module, **config):
    config = {"architecture": "multihead_attention", "embed_dim": E, "num_heads": H, **config}
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path


B, T = 3, 7


def _inputs():
    x = torch.randn(B, T, E)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, 5:] = True
    kpm[2, 2] = True
    return x, kpm


def _check_self_attention(model, reference):
    """Engine batched (with padding mask) and varlen outputs equal `reference(x, kpm)`."""
    x, kpm = _inputs()
    with torch.no_grad():
        want = reference(x, kpm)
    got, _ = model(x, key_padding_mask=kpm)
    torch.testing.assert_close(got, want, **FP32)
    with torch.no_grad():
        unmasked = reference(x, None)
    outs = model.forward_varlen(list(x))
    for out, w in zip(outs, unmasked, strict=True):
        torch.testing.assert_close(out, w, **FP32)


SELF_ATTENTION_CASES = {  # the layout as the loader describes it -> (module, how to call it)
    "W_q/W_k/W_v/W_o": (lambda: ScratchMHA(), lambda m: lambda x, k: m(x, x, x, k)),
    "W_q/W_k/W_v/fc_out": (
        lambda: ScratchMHA(out_name="fc_out"),
        lambda m: lambda x, k: m(x, x, x, k),
    ),
    "queries/keys/values/fc_out": (EinsumSelfAttention, lambda m: m),
    "linears.0/linears.1/linears.2/linears.3": (
        AnnotatedMHA,
        lambda m: lambda x, k: m(x, x, x, k),
    ),
    "q_proj/k_proj/v_proj/out_proj": (ProjAttention, lambda m: m),
    "wqkv/wo (concat)": (lambda: GptFastAttention(fused=True), lambda m: m),
    "wq/wk/wv/wo": (lambda: GptFastAttention(fused=False), lambda m: m),
}


@pytest.mark.parametrize("layout", list(SELF_ATTENTION_CASES))
def test_detected_layouts_match_their_module(tmp_path, layout):
    build, call = SELF_ATTENTION_CASES[layout]
    module = _seeded(build())
    model = load_model(_save(tmp_path, module), device="cpu")
    assert model.config.attention_layout == layout
    _check_self_attention(model, call(module))


def test_cross_attention_with_other_key_value_widths(tmp_path):
    module = _seeded(ScratchMHA(kdim=5, vdim=7))
    model = load_model(_save(tmp_path, module, kdim=5, vdim=7), device="cpu")
    q, k, v = torch.randn(B, T, E), torch.randn(B, 9, 5), torch.randn(B, 9, 7)
    kpm = torch.zeros(B, 9, dtype=torch.bool)
    kpm[0, 6:] = True
    with torch.no_grad():
        want = module(q, k, v, kpm)
    torch.testing.assert_close(model(q, k, v, key_padding_mask=kpm)[0], want, **FP32)


def test_gpt_fast_grouped_query_causal(tmp_path):
    module = _seeded(GptFastAttention(n_head=H, n_local_heads=2, fused=True))
    model = load_model(_save(tmp_path, module, num_kv_heads=2), device="cpu")
    x, _ = _inputs()
    with torch.no_grad():
        want = module(x, None, is_causal=True)
    torch.testing.assert_close(model(x, is_causal=True)[0], want, **FP32)


def test_per_head_packed_qkv_needs_and_uses_the_key_map(tmp_path):
    module = _seeded(PerHeadQKV())
    key_map = {"qkv": "qkv_proj", "out": "o_proj", "qkv_packing": "per_head"}
    model = load_model(_save(tmp_path, module, attention_keys=key_map), device="cpu")
    _check_self_attention(model, module)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_key_map_for_unlisted_names_and_mixed_bias(tmp_path, qkv_bias):
    """timm's `proj` is not a detected name; its qkv has no bias while proj has one."""
    module = _seeded(TimmAttention(qkv_bias=qkv_bias))
    with pytest.raises(CheckpointError, match="unrecognised attention layout"):
        load_model(_save(tmp_path, module), device="cpu")
    model = load_model(
        _save(tmp_path, module, attention_keys={"qkv": "qkv", "out": "proj"}), device="cpu"
    )
    assert model.config.bias is True  # the missing qkv bias was filled with zeros
    _check_self_attention(model, module)


def test_no_bias_layout_has_no_bias(tmp_path):
    model = load_model(_save(tmp_path, _seeded(GptFastAttention())), device="cpu")
    assert model.config.bias is False


# -- errors ------------------------------------------------------------------------------------


def test_unrecognised_layout_lists_keys_and_layouts_tried(tmp_path):
    state = {"c_attn.weight": torch.zeros(3 * E, E), "c_proj.weight": torch.zeros(E, E)}
    (tmp_path / "config.json").write_text(
        json.dumps({"architecture": "multihead_attention", "embed_dim": E, "num_heads": H})
    )
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_model(tmp_path)
    message = str(info.value)
    assert "keys found ['c_attn.weight', 'c_proj.weight']" in message
    for tried in ("in_proj_weight", "W_q/W_k/W_v", "wq/wk/wv", "q_proj/k_proj/v_proj", "wqkv"):
        assert tried in message
    assert "fc_out" in message and "attention_keys" in message


def test_ambiguous_layout_asks_for_a_key_map(tmp_path):
    module = ScratchMHA()
    module.fc_out = nn.Linear(E, E)  # both W_o and fc_out: which one is the output?
    with pytest.raises(CheckpointError, match=r"ambiguous attention layout.*attention_keys"):
        load_model(_save(tmp_path, module))
    key_map = {"q": "W_q", "k": "W_k", "v": "W_v", "out": "W_o"}
    unexpected = r"unexpected keys \['fc_out\.bias', 'fc_out\.weight'\]"
    with pytest.raises(CheckpointError, match=unexpected):
        load_model(_save(tmp_path, module, attention_keys=key_map))


def test_layout_shape_error_names_the_source_key(tmp_path):
    module = ScratchMHA()
    module.W_k = nn.Linear(E, 12)
    with pytest.raises(
        CheckpointError, match=r"W_k\.weight: expected shape \(16, 16\), got \(12, 16\)"
    ):
        load_model(_save(tmp_path, module))


@pytest.mark.parametrize(
    "key_map,match",
    [
        ({"q": "W_q", "k": "W_k", "v": "W_v"}, "needs 'out'"),
        ({"q": "W_q", "qkv": "x", "out": "W_o"}, "either 'q', 'k' and 'v' or one fused 'qkv'"),
        ({"qkv": "x", "out": "o", "qkv_packing": "zigzag"}, "qkv_packing must be one of"),
        ({"qkv": "x", "out": "o", "scale": "s"}, r"unknown field\(s\) \['scale'\]"),
        (["W_q"], "must be an object"),
    ],
)
def test_bad_key_map(tmp_path, key_map, match):
    with pytest.raises(CheckpointError, match=match):
        load_model(_save(tmp_path, ScratchMHA(), attention_keys=key_map))
