"""Rotary position embeddings (RoPE) as transformers computes them, shared by the rotary text
families (ModernBERT, Qwen3, the Llama family, Gemma 3, NomicBERT, GTE): cos/sin of position *
1 / theta^(2i / head_dim), the frequencies rescaled by a static RopeScaling where the config has
one (GTE's fixed NTK as the linear scaling it equals), applied to queries and keys with
rotate_half (the first half of each head's dims paired with the second).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache

import torch
from torch import Tensor, nn

from .devices import upload
from .packed_attention import layer_window
from .text import packed_positions
from .text_config import LAYER_TYPES, RopeScaling
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


def transformers_form(
    theta: float, scaling: RopeScaling | None, head_dim: int
) -> tuple[float, RopeScaling | None]:
    """The same frequencies in a kind transformers computes: fixed NTK (base theta * factor, every
    frequency divided by factor^(2 / head_dim)) is linear scaling by factor^(2 / head_dim) on
    base theta * factor; every other RoPE is already one."""
    if scaling is None or scaling.rope_type != "ntk":
        return theta, scaling
    return theta * scaling.factor, RopeScaling("linear", scaling.factor ** (2 / head_dim))


@lru_cache(maxsize=32)
def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Tensor:
    """(head_dim / 2,) float32 on the host, in transformers' order of operations (exactly its
    numbers): 1 / theta^(2i / head_dim), then the scaling's rule. Cached: never modify it."""
    if scaling is not None and scaling.rope_type == "ntk":  # as linear on base theta * factor
        return inverse_frequencies(head_dim, *transformers_form(theta, scaling, head_dim))
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)  # (hd/2,)
    inv_freq = 1.0 / base
    if scaling is None:
        return inv_freq
    factor = scaling.factor
    if scaling.rope_type == "linear":
        return inv_freq / factor
    if scaling.rope_type == "llama3":  # divide the low frequencies, keep the high, smooth between
        old = scaling.original_max_position_embeddings
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        divided = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * divided / factor + smooth * divided
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, divided)

    # yarn: original frequencies on the fast dimensions, divided ones on the slow, a linear ramp
    # between the dimensions that turn beta_fast and beta_slow times in the pre-training length
    def dim_of(turns: float) -> float:
        length = scaling.original_max_position_embeddings
        return (head_dim * math.log(length / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    dims = torch.arange(head_dim // 2, dtype=torch.float32)
    ramp = torch.clamp((dims - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the original frequency
    return (1.0 / (factor * base)) * (1 - keep) + inv_freq * keep


def rotary(
    positions: Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: RopeScaling | None = None,
) -> tuple[Tensor, Tensor]:
    """cos and sin (..., head_dim) of the positions' rotary angles (times YaRN's attention
    factor), in `dtype` (as transformers rounds them); the inverse frequencies are computed on
    the host, as transformers does."""
    inv_freq = upload(inverse_frequencies(head_dim, theta, scaling), positions.device)
    freqs = positions[..., None].float() * inv_freq  # (..., hd/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (..., hd)
    cos, sin = angles.cos(), angles.sin()
    if scaling is not None and scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos.to(dtype), sin.to(dtype)


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
    ropes: dict[str, tuple[float, RopeScaling | None]],
    reach: int,
) -> tuple[Tensor, list[Tensor]]:
    """Full and sliding rotary layers (each with a `kind`) in order on x, dense or packed:
    cos/sin once per kind (`ropes`: kind -> RoPE base and scaling) and the sliding layers' band
    (keys at most `reach` away) once per forward; x after the last layer and the weights
    collected (ModernBERT, Gemma 3)."""
    positions = token_positions(x, plan)  # (N,) or (T,)
    angles = {
        kind: rotary(positions, head_dim, theta, x.dtype, scaling)
        for kind, (theta, scaling) in ropes.items()
    }
    window = layer_window(reach, x, plan)
    weights: list[Tensor] = []
    for layer in layers:
        band = window if layer.kind == SLIDING else None
        x, w = layer(x, angles[layer.kind], key_padding_mask, plan, need_weights, band)
        if w is not None:
            weights.append(w)
    return x, weights
