"""Attention on packed tokens along a varlen Plan: the CUDA varlen kernel (flash /
memory-efficient) where one call can do the plan, else cpu_varlen's compiled kernel for the
sequences it takes and one SDPA call per group for the rest (per sequence where SDPA would not be
batch invariant: SMALL_QUERIES, banded_attention); a layer's score bias per sequence length
(varlen.AttnBias) rides along. The plan itself (groups, lengths, policy) is varlen.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import cpu_varlen
from .cuda_varlen import varlen_attention
from .eager import eager_only
from .fused import MIN_ROWS, linear
from .varlen import AttnBias, Group, LocalWindow, Plan, take

if TYPE_CHECKING:
    from .attention import FusedAttention

# CPU SDPA is not batch invariant for calls with few queries on more keys (torch 2.13, AMD EPYC:
# of 1,360 fp32 shapes probed, every one that differed between a batch of 3 and the first
# sequence alone had 1-3 queries and 8+ keys; e.g. a 1-token target on 300 memory tokens differs
# by 7e-9; bf16 never did). Its GEMMs are small-row ones, which differ up to 15 rows on an AMX Xeon
# (fused.py), so groups of fewer queries than MIN_ROWS, and than keys, run one SDPA call per
# sequence (cheap at such sizes).
SMALL_QUERIES = MIN_ROWS


def varlen_capable(attn: FusedAttention) -> bool:
    """The block can run the CUDA varlen kernel: fused Q/K/V, no extra keys or GQA, flash-sized
    heads."""
    return (
        attn.in_proj is not None
        and attn.extra_keys == 0
        and not attn.is_gqa
        and attn.head_dim % 8 == 0
        and attn.head_dim <= 256
    )


def use_varlen(
    attn: FusedAttention, query: Tensor, plan: Plan, attn_bias: AttnBias | None = None
) -> bool:
    """The CUDA varlen kernel applies: on the GPU, a plan one call can do, no score bias, no
    extra keys, flash-sized heads; GQA only through flash (half precisions), and without empty
    query sequences (flash's single-query GQA path reshapes the queries to one row per
    sequence)."""
    return (
        query.is_cuda
        and plan.varlen_ok
        and attn_bias is None
        and attn.extra_keys == 0
        and attn.head_dim % 8 == 0
        and attn.head_dim <= 256
        and (
            not attn.is_gqa
            or (query.dtype in (torch.float16, torch.bfloat16) and 0 not in plan.q_lens)
        )
    )


def packed_attention(
    attn: FusedAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    plan: Plan,
    residual: Tensor | None = None,
    attn_bias: AttnBias | None = None,
) -> Tensor:
    """Attention block on packed tokens: one in_proj, one varlen kernel call (CUDA: flash;
    CPU: cpu_varlen for short sequences), else one SDPA per group, one out_proj (plus
    `residual`, fused into out_proj)."""
    fused = key is query and value is query and attn.in_proj is not None
    if fused:
        qkv = linear(attn.in_proj, query)  # (N, E + 2KV): one GEMM for Q, K, V
        q, k, v = attn.split_qkv(qkv)
    else:
        q, k, v = attn.project(query, key, value)  # (N, E), (M, KV), (M, KV)
    merged = attend_packed(attn, plan, q, k, v, qkv if fused else None, attn_bias)  # (N, E)
    return linear(attn.out_proj, merged, residual=residual)  # (N, E)


def attend_packed(
    attn: FusedAttention,
    plan: Plan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qkv: Tensor | None = None,
    attn_bias: AttnBias | None = None,
) -> Tensor:
    """Merged heads (N, E) of projected packed q (N, E), k, v (M, KV) (views of `qkv` where
    given): the CUDA varlen kernel where it applies, else cpu_varlen's kernel and SDPA groups."""
    if use_varlen(attn, q, plan, attn_bias):
        return varlen_attention(
            q, k, v, plan.cu_seqlens, max(plan.q_lens), attn.num_heads, attn.head_dim,
            is_causal=plan.causal, cu_seqlens_k=plan.cu_seqlens_k, max_len_k=max(plan.kv_lens),
        )  # fmt: skip
    if q.is_cuda:
        attn.cuda_grouped_calls += 1  # masks, mixed causal flags, fp32 GQA, extra keys, bias
    return cpu_or_grouped_attention(attn, plan, q, k, v, qkv, attn_bias)  # (N, E)


@eager_only
def cpu_or_grouped_attention(
    attn: FusedAttention,
    plan: Plan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qkv: Tensor | None,
    attn_bias: AttnBias | None = None,
) -> Tensor:
    """Merged heads (N, E): cpu_varlen's kernel for the sequences it takes (short, unmasked,
    no score bias; decided per sequence, never by batch-mates), grouped SDPA calls for the
    rest."""
    projections = {"qkv": qkv} if qkv is not None else {"q": q, "k": k, "v": v}
    if attn.extra_keys == 0 and cpu_varlen.usable(q, k, v):
        biased = ()
        if attn_bias is not None:
            pairs = zip(plan.q_lens, plan.kv_lens, strict=True)
            biased = tuple(attn_bias(t, s) is not None for t, s in pairs)
        modes, others = plan.cpu_split(cpu_varlen.max_len(q.dtype), biased)
        if modes is not None:  # some sequence for the kernel
            merged = cpu_varlen.varlen_attention(
                q, k, v, plan.cu_seqlens, plan.cu_seqlens_k, modes, plan.q_lens, plan.kv_lens,
                attn.num_heads, attn.num_kv_heads, attn.head_dim,
            )  # fmt: skip
            if others:
                grouped_attention(
                    attn, plan, groups=others, merged=merged, attn_bias=attn_bias, **projections
                )
            return merged
    return grouped_attention(attn, plan, attn_bias=attn_bias, **projections)


@eager_only
def grouped_attention(
    attn: FusedAttention,
    plan: Plan,
    qkv: Tensor | None = None,
    q: Tensor | None = None,
    k: Tensor | None = None,
    v: Tensor | None = None,
    groups: list[Group] | None = None,
    merged: Tensor | None = None,
    attn_bias: AttnBias | None = None,
) -> Tensor:
    """One SDPA call per group of the plan (or of `groups`), each with its (T, S)'s score bias
    (one per sequence for few queries on more keys, SMALL_QUERIES, and for LocalWindow groups);
    merged heads (N, E) of the packed queries, written into `merged` where given.

    Never compiled: torch.compile would unroll the loop over groups and guard on every
    length, recompiling for each new set of lengths. Compiled models run the per-token parts
    (projections, norms, FFN) compiled with a dynamic token count and this loop eagerly.
    """
    E = attn.embed_dim
    fused = qkv is not None
    rows = qkv.shape[0] if fused else q.shape[0]
    if merged is None:
        merged = (qkv if fused else q).new_empty(rows, E)  # (N, E) merged heads
    for g in plan.groups if groups is None else groups:
        if fused:
            part = take(qkv, g.q_rows).view(g.size, g.tgt_len, -1)  # (G, T, E + 2KV)
            gq, gk, gv = attn.split_qkv(part)
        else:
            gq = take(q, g.q_rows).view(g.size, g.tgt_len, -1)  # (G, T, E)
            gk = take(k, g.kv_rows).view(g.size, g.src_len, -1)  # (G, S, KV)
            gv = take(v, g.kv_rows).view(g.size, g.src_len, -1)  # (G, S, KV)
        bias = None if attn_bias is None else attn_bias(g.tgt_len, g.src_len)
        if isinstance(bias, LocalWindow):
            y = banded_attention(attn, gq, gk, gv, g.key_padding_mask, bias)  # (G, T, E)
        elif g.size > 1 and g.tgt_len < min(SMALL_QUERIES, g.src_len):  # see SMALL_QUERIES
            y = attend_each(attn, gq, gk, gv, g.key_padding_mask, g.is_causal, bias)
        else:
            y, _ = attn.attend(gq, gk, gv, g.key_padding_mask, None, g.is_causal, attn_bias=bias)
        y = y.reshape(-1, E)  # (G*T, E)
        if g.real is not None:  # padded bucket: keep the real query rows only
            merged.index_copy_(0, g.out_rows, y.index_select(0, g.real))
        elif isinstance(g.q_rows, slice):
            merged[g.q_rows] = y
        else:
            merged.index_copy_(0, g.q_rows, y)
    return merged


def banded_attention(
    attn: FusedAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    local: LocalWindow,
) -> Tensor:
    """Bidirectional sliding-window attention of (G, T, E) queries on (G, S, KV) keys/values:
    each block of queries against the keys within the window of any of them, a (block, keys)
    band mask, so the cost grows with T * (block + 2 window), not T * S; merged heads (G, T, E).

    One sequence per SDPA call: CPU SDPA is not batch invariant when a call has fewer queries
    than keys (measured on torch 2.13: 3 queries on 11 keys give other bits in a batch of 2 than
    alone), which every interior block has. So each sequence's numbers depend on it alone.
    Interior blocks share one band mask (the same offsets)."""
    T, S, w = q.shape[1], k.shape[1], local.window
    out = q.new_empty(q.shape[0], T, attn.embed_dim)  # (G, T, E)
    bands: dict[tuple[int, int, int], Tensor] = {}
    for start in range(0, T, local.block):
        stop = min(T, start + local.block)
        k0, k1 = max(0, start - w), min(S, stop + w)
        shape = (stop - start, k0 - start, k1 - start)  # the mask depends on offsets only
        if shape not in bands:
            bands[shape] = band_bias(range(start, stop), range(k0, k1), w, q.dtype, q.device)
        kpm = None if key_padding_mask is None else key_padding_mask[:, k0:k1]
        out[:, start:stop] = attend_each(
            attn, q[:, start:stop], k[:, k0:k1], v[:, k0:k1], kpm, False, bands[shape]
        )
    return out


def attend_each(
    attn: FusedAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    attn_bias: Tensor | None,
) -> Tensor:
    """FusedAttention.attend of (G, T, E) queries on (G, S, KV) keys/values one sequence per
    SDPA call, for the shapes where a batched call would not be batch invariant; (G, T, E)."""
    return torch.cat([
        attn.attend(q[i : i + 1], k[i : i + 1], v[i : i + 1],
                    None if key_padding_mask is None else key_padding_mask[i : i + 1],
                    None, is_causal, attn_bias=attn_bias)[0]
        for i in range(q.shape[0])
    ])  # fmt: skip


# queries per block of a long sequence's sliding-window attention (ModernBERT, Gemma 3)
BLOCK = LocalWindow.block


def sliding_window(window: int) -> AttnBias:
    """AttnBias of a sliding layer on packed sequences: None where no key is farther than the
    window (the layer runs as a full one), else a LocalWindow (attention by query blocks)."""
    local = LocalWindow(window, BLOCK)
    return lambda tgt_len, src_len: None if max(tgt_len, src_len) - 1 <= window else local


def layer_window(reach: int, x: Tensor, plan: Plan | None) -> Tensor | AttnBias | None:
    """A sliding layer's band for its input x: per sequence length on packed rows (a plan:
    sliding_window), else one (T, T) mask for the dense batch (None: no key out of reach)."""
    if plan is not None:
        return sliding_window(reach)
    T = x.shape[-2]
    return band_bias(range(T), range(T), reach, x.dtype, x.device) if reach < T - 1 else None


def band_bias(
    queries: range, keys: range, window: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Additive (1, 1, queries, keys) mask hiding the keys more than `window` positions from
    their query (positions within the sequence)."""
    rows = torch.arange(queries.start, queries.stop, device=device)[:, None]  # (b, 1)
    far = (torch.arange(keys.start, keys.stop, device=device)[None, :] - rows).abs() > window
    bias = torch.zeros(far.shape, dtype=dtype, device=device)
    return bias.masked_fill_(far, float("-inf"))[None, None]
