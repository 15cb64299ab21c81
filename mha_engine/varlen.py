"""Variable-length batches without padding: pack tokens, group sequences of equal shape for SDPA.

Projections, out_proj and the FFN run once on the packed (N, E) tokens; attention runs once per
group of sequences sharing (T, S, is_causal, has_mask), stacked to (G, H, T, head_dim).
No row of any GEMM or SDPA call depends on padding, so outputs are batch invariant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .attention import FusedAttention


@dataclass
class Group:
    """Sequences attended together: packed row indices of their queries and keys."""

    tgt_len: int
    src_len: int
    is_causal: bool
    q_rows: Tensor | slice  # (G*T,) indices into the packed queries, or one contiguous slice
    kv_rows: Tensor | slice  # (G*S,) indices into the packed keys/values
    key_padding_mask: Tensor | None  # (G, S) bool or float, or None
    size: int


@dataclass
class Plan:
    """Packing layout of one varlen call, reused by every layer of an encoder."""

    q_offsets: list[int]
    q_lens: list[int]
    groups: list[Group]


def _rows(offsets: list[int], length: int, device: torch.device) -> Tensor | slice:
    if len(offsets) == 1:
        return slice(offsets[0], offsets[0] + length)
    starts = torch.tensor(offsets, dtype=torch.long, device=device)
    return (starts[:, None] + torch.arange(length, device=device)).reshape(-1)  # (G*T,)


def _offsets(lens: list[int]) -> list[int]:
    out, total = [], 0
    for n in lens:
        out.append(total)
        total += n
    return out


def make_plan(
    q_lens: list[int],
    kv_lens: list[int],
    is_causal: list[bool],
    key_padding_mask: list[Tensor | None],
    device: torch.device,
) -> Plan:
    """Group sequence indices by (T, S, is_causal, has_mask), preserving first-seen order."""
    q_off, kv_off = _offsets(q_lens), _offsets(kv_lens)
    buckets: dict[tuple[int, int, bool, bool], list[int]] = {}
    for i, (t, s, c, m) in enumerate(
        zip(q_lens, kv_lens, is_causal, key_padding_mask, strict=True)
    ):
        if m is not None and tuple(m.shape) != (s,):
            raise ValueError(f"key_padding_mask[{i}] shape {tuple(m.shape)} != {(s,)}")
        buckets.setdefault((t, s, bool(c), m is not None), []).append(i)
    groups = []
    for (t, s, c, has_mask), members in buckets.items():
        mask = torch.stack([key_padding_mask[i] for i in members]) if has_mask else None
        groups.append(
            Group(
                tgt_len=t,
                src_len=s,
                is_causal=c,
                q_rows=_rows([q_off[i] for i in members], t, device),
                kv_rows=_rows([kv_off[i] for i in members], s, device),
                key_padding_mask=None if mask is None else mask.to(device),
                size=len(members),
            )
        )
    return Plan(q_offsets=q_off, q_lens=q_lens, groups=groups)


def _take(x: Tensor, rows: Tensor | slice, size: int, length: int) -> Tensor:
    part = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)  # (G*L, C)
    return part.view(size, length, x.shape[-1])  # (G, L, C)


def packed_attention(
    attn: FusedAttention, query: Tensor, key: Tensor, value: Tensor, plan: Plan
) -> Tensor:
    """Attention block on packed tokens: one in_proj, one SDPA per group, one out_proj."""
    E = attn.embed_dim
    fused = key is query and value is query and attn.in_proj is not None
    if fused:
        qkv = attn.in_proj(query)  # (N, E + 2KV): one GEMM for Q, K, V
    else:
        q, k, v = attn.project(query, key, value)  # (N, E), (M, KV), (M, KV)
    merged = query.new_empty(query.shape[0], E)  # (N, E) merged heads
    for g in plan.groups:
        if fused:
            part = _take(qkv, g.q_rows, g.size, g.tgt_len)  # (G, T, E + 2KV)
            gq, gk, gv = attn.split_qkv(part)
        else:
            gq = _take(q, g.q_rows, g.size, g.tgt_len)  # (G, T, E)
            gk = _take(k, g.kv_rows, g.size, g.src_len)  # (G, S, KV)
            gv = _take(v, g.kv_rows, g.size, g.src_len)  # (G, S, KV)
        y, _ = attn.attend(gq, gk, gv, g.key_padding_mask, None, g.is_causal)  # (G, T, E)
        y = y.reshape(-1, E)  # (G*T, E)
        if isinstance(g.q_rows, slice):
            merged[g.q_rows] = y
        else:
            merged.index_copy_(0, g.q_rows, y)
    return attn.out_proj(merged)  # (N, E)


def split(packed: Tensor, plan: Plan) -> list[Tensor]:
    """Cut packed (N, E) outputs back into the caller's (T_i, E) sequences."""
    return list(packed.split(plan.q_lens))


def normalise_varlen_args(
    query: list[Tensor],
    key: list[Tensor] | None,
    value: list[Tensor] | None,
    key_padding_mask: list[Tensor | None] | None,
    is_causal: list[bool] | bool,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor | None], list[bool]]:
    """Fill defaults (key/value = query, no masks) and check the list lengths agree."""
    n = len(query)
    key = query if key is None else key
    value = key if value is None else value
    key_padding_mask = [None] * n if key_padding_mask is None else list(key_padding_mask)
    causal = [bool(is_causal)] * n if isinstance(is_causal, bool) else list(is_causal)
    for name, items in (("key", key), ("value", value), ("key_padding_mask", key_padding_mask)):
        if len(items) != n:
            raise ValueError(f"{name} has {len(items)} items, query has {n}")
    if len(causal) != n:
        raise ValueError(f"is_causal has {len(causal)} items, query has {n}")
    for i, (q, k, v) in enumerate(zip(query, key, value, strict=True)):
        if q.dim() != 2 or k.dim() != 2 or v.dim() != 2:
            raise ValueError(f"item {i}: query/key/value must be 2-D (T, E)")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"item {i}: key has {k.shape[0]} rows, value {v.shape[0]}")
    return query, key, value, key_padding_mask, causal
