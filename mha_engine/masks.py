"""Attention masks as PyTorch builds them: bool (True = ignore) or float masks made additive,
the causal mask, and key_padding_mask merged with attn_mask (shared by the batched and the
packed attention paths, so neither imports the other for them)."""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def additive_mask(mask: Tensor | None, dtype: torch.dtype, name: str) -> Tensor | None:
    """Turn a bool (True = ignore) or float mask into an additive float mask, like PyTorch."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, NEG_INF)
    if not torch.is_floating_point(mask):
        raise TypeError(f"{name} must be bool or floating point, got {mask.dtype}")
    return mask.to(dtype)


def causal_mask(tgt_len: int, src_len: int, device: torch.device) -> Tensor:
    """Bool (T, S) mask, True above the diagonal (top-left aligned, like SDPA's is_causal)."""
    return torch.ones(tgt_len, src_len, dtype=torch.bool, device=device).triu_(1)


def merge_masks(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    batch: int,
    num_heads: int,
    tgt_len: int,
    src_len: int,
    dtype: torch.dtype,
) -> Tensor | None:
    """Combine key_padding_mask (B, S) and attn_mask (T, S) | (B*H, T, S) into (B, H|1, T, S)."""
    merged = None
    if attn_mask is not None:
        attn_mask = additive_mask(attn_mask, dtype, "attn_mask")
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise ValueError(
                    f"attn_mask shape {tuple(attn_mask.shape)} != {(tgt_len, src_len)}"
                )
            merged = attn_mask.view(1, 1, tgt_len, src_len)
        elif attn_mask.dim() == 3:
            expected = (batch * num_heads, tgt_len, src_len)
            if attn_mask.shape != expected:
                raise ValueError(f"attn_mask shape {tuple(attn_mask.shape)} != {expected}")
            merged = attn_mask.view(batch, num_heads, tgt_len, src_len)
        else:
            raise ValueError(f"attn_mask must be 2-D or 3-D, got {attn_mask.dim()}-D")
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, src_len):
            raise ValueError(
                f"key_padding_mask shape {tuple(key_padding_mask.shape)} != {(batch, src_len)}"
            )
        kpm = additive_mask(key_padding_mask, dtype, "key_padding_mask")
        kpm = kpm.view(batch, 1, 1, src_len)
        merged = kpm if merged is None else merged + kpm
    return merged
