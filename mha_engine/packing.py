"""forward_varlen's inputs, lists of per-sequence tensors, checked and packed into the (N, E)
tensors and lengths the packed forwards take (see varlen.py for the packed layout)."""

from __future__ import annotations

import torch
from torch import Tensor

from .masks import additive_mask


def pack_varlen(
    query: list[Tensor],
    key: list[Tensor] | None,
    value: list[Tensor] | None,
    key_padding_mask: list[Tensor | None] | None,
    is_causal: list[bool] | bool,
) -> tuple[Tensor, list[int], Tensor | None, Tensor | None, list[int], Tensor | None, list[bool]]:
    """forward_varlen's lists as packed tensors: (q, q_lens, k, v, kv_lens, kpm, causal).

    k and v are None for self-attention (key and value omitted); sequences without a mask get
    an all-False slice of the packed mask, which make_plan treats as unmasked.
    """
    n = len(query)
    self_attn = key is None and value is None
    keys = query if key is None else key
    values = keys if value is None else value
    masks = [None] * n if key_padding_mask is None else list(key_padding_mask)
    causal = [bool(is_causal)] * n if isinstance(is_causal, bool) else list(is_causal)
    for name, items in (("key", keys), ("value", values), ("key_padding_mask", masks)):
        if len(items) != n:
            raise ValueError(f"{name} has {len(items)} items, query has {n}")
    if len(causal) != n:
        raise ValueError(f"is_causal has {len(causal)} items, query has {n}")
    for i, (q, k, v, m) in enumerate(zip(query, keys, values, masks, strict=True)):
        if q.dim() != 2 or k.dim() != 2 or v.dim() != 2:
            raise ValueError(f"item {i}: query/key/value must be 2-D (T, E)")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"item {i}: key has {k.shape[0]} rows, value {v.shape[0]}")
        if m is not None and tuple(m.shape) != (k.shape[0],):
            raise ValueError(f"key_padding_mask[{i}] shape {tuple(m.shape)} != {(k.shape[0],)}")
    q_lens, kv_lens = [t.shape[0] for t in query], [t.shape[0] for t in keys]
    kpm = None
    given = [m for m in masks if m is not None]
    if given:
        device = given[0].device
        if all(m.dtype == torch.bool for m in given):
            parts = [
                torch.zeros(s, dtype=torch.bool, device=device) if m is None else m
                for m, s in zip(masks, kv_lens, strict=True)
            ]
        else:  # some additive float masks: every mask as float32 additive (-inf = ignore)
            parts = [
                torch.zeros(s, device=device)
                if m is None
                else additive_mask(m, torch.float32, "key_padding_mask")
                for m, s in zip(masks, kv_lens, strict=True)
            ]
        kpm = torch.cat([p.to(device) for p in parts])  # (M,)
    if self_attn:
        return torch.cat(query), q_lens, None, None, kv_lens, kpm, causal
    k = torch.cat(keys)
    v = k if value is key or value is None else torch.cat(values)
    return torch.cat(query), q_lens, k, v, kv_lens, kpm, causal


def check_packed(x: Tensor, width: int, name: str) -> None:
    """Raise ValueError naming `name` unless x is (tokens, width)."""
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{name} must be packed (tokens, {width}), got {tuple(x.shape)}")
