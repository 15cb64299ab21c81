"""Rotary position embeddings (RoPE) as transformers computes them, shared by the rotary text
families (ModernBERT, Qwen3, Gemma 3): cos/sin of position * 1 / theta^(2i / head_dim), applied to
queries and keys with rotate_half (the first half of each head's dims paired with the second).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from .devices import upload
from .packed_attention import layer_window
from .text import packed_positions
from .text_config import LAYER_TYPES
from .varlen import Plan

FULL, SLIDING = LAYER_TYPES


def token_positions(x: Tensor, plan: Plan | None) -> Tensor:
    """Each row's position in its sequence: packed rows (N,) along the plan, from 0 in every
    sequence (rows varlen.pad_rows appended get 0: they are dropped later), or 0..T-1 for a dense
    (..., T, D) batch."""
    if plan is None:
        return torch.arange(x.shape[-2], device=x.device)  # (T,)
    positions = packed_positions(plan.q_lens, x.device)  # (N,)
    extra = x.shape[0] - positions.shape[0]
    return torch.cat([positions, positions.new_zeros(extra)]) if extra else positions


def rotary(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin (..., head_dim) of the positions' rotary angles, in `dtype` (as transformers
    rounds them); the inverse frequencies are computed on the host, as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = positions[..., None].float() * upload(inv_freq, positions.device)  # (..., hd/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (..., hd)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, num_heads: int) -> Tensor:
    """RoPE on merged heads x (..., T, H*hd) with cos/sin (T, hd), in float32, back to x's dtype."""
    shape = x.shape
    heads = x.reshape(*shape[:-1], num_heads, -1).float()  # (..., T, H, hd)
    half = heads.shape[-1] // 2
    turned = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)  # rotate_half
    out = heads * cos[:, None, :] + turned * sin[:, None, :]
    return out.to(x.dtype).reshape(shape)


def run_windowed_layers(
    layers: Iterable[nn.Module],
    x: Tensor,
    plan: Plan | None,
    key_padding_mask: Tensor | None,
    need_weights: bool,
    head_dim: int,
    thetas: dict[str, float],
    reach: int,
) -> tuple[Tensor, list[Tensor]]:
    """Full and sliding rotary layers (each with a `kind`) in order on x, dense or packed:
    cos/sin once per kind (`thetas`: kind -> RoPE base) and the sliding layers' band (keys at
    most `reach` away) once per forward; x after the last layer and the weights collected
    (ModernBERT, Gemma 3)."""
    positions = token_positions(x, plan)  # (N,) or (T,)
    angles = {kind: rotary(positions, head_dim, theta, x.dtype) for kind, theta in thetas.items()}
    window = layer_window(reach, x, plan)
    weights: list[Tensor] = []
    for layer in layers:
        band = window if layer.kind == SLIDING else None
        x, w = layer(x, angles[layer.kind], key_padding_mask, plan, need_weights, band)
        if w is not None:
            weights.append(w)
    return x, weights
