"""The attention of the decoder-derived text families (Qwen3, Gemma 3): grouped-query heads not as
wide as the model, a norm over each query and key head, rotary positions; and the RMSNorms those
families use (Qwen3's weight * x, Gemma's (1 + weight) * x, both in float32 as transformers).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import FusedAttention
from .config import MultiheadAttentionConfig
from .fused import linear
from .rope import rotate
from .text_config import GroupedRotaryConfig
from .text_model import TextEncoderModel
from .varlen import AttnBias, Plan


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in float32 and rounded to x's dtype
    before the weight multiplies (transformers' Qwen3RMSNorm, bit for bit)."""

    initial = 1.0  # the weight's starting value (Gemma's stores its offset from 1)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), self.initial))
        self.eps = eps

    def normalized(self, x: Tensor) -> Tensor:
        """x / sqrt(mean(x^2) + eps) in float32."""
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * self.normalized(x).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32, rounded to x's dtype at the end
    (transformers' Gemma3RMSNorm, bit for bit; the weight is stored as the offset from 1)."""

    initial = 0.0

    def forward(self, x: Tensor) -> Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).type_as(x)


class GroupedRotaryAttention(FusedAttention):
    """FusedAttention over num_heads * head_dim query columns (`embed_dim` here) read from and
    written back to the model width d_model: in_proj (d_model -> H*hd + 2*Hkv*hd), out_proj
    (H*hd -> d_model), plus q_norm and k_norm (`norm` over each head: the family's RMSNorm)
    where config.head_norms (None in the Llama family)."""

    def __init__(self, config: GroupedRotaryConfig, norm: type[nn.Module] = RMSNorm) -> None:
        width = config.nhead * config.head_dim
        bias = config.attention_bias
        attention = MultiheadAttentionConfig(
            width, config.nhead, num_kv_heads=config.num_kv_heads, bias=bias
        )
        super().__init__(attention)
        D = config.d_model
        self.in_proj = nn.Linear(D, width + 2 * self.kv_dim, bias=bias)  # rows [Q; K; V]
        self.out_proj = nn.Linear(width, D, bias=config.out_bias)
        heads = config.head_norms
        self.q_norm = norm(config.head_dim, config.layer_norm_eps) if heads else None
        self.k_norm = norm(config.head_dim, config.layer_norm_eps) if heads else None

    def positioned(
        self, q: Tensor, k: Tensor, cos_sin: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """Queries (..., H*hd) and keys (..., Hkv*hd) normalised per head (if the family
        does), then rotated."""
        if self.q_norm is not None:
            q = self.q_norm(q.unflatten(-1, (self.num_heads, -1))).flatten(-2)
            k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, -1))).flatten(-2)
        return rotate(q, *cos_sin, self.num_heads), rotate(k, *cos_sin, self.num_kv_heads)

    def attend_rotary(
        self,
        x: Tensor,
        cos_sin: tuple[Tensor, Tensor],
        plan: Plan | None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        attn_bias: Tensor | AttnBias | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """One fused Q/K/V GEMM on x (already normed where the family norms first), the heads
        positioned, then attend_either: merged heads (..., H*hd) before out_proj, and weights."""
        q, k, v = self.split_qkv(linear(self.in_proj, x))
        q, k = self.positioned(q, k, cos_sin)  # (..., H*hd), (..., Hkv*hd)
        return self.attend_either(
            q, k, v, plan, key_padding_mask, is_causal, need_weights, attn_bias
        )


class GroupedRotaryModel(TextEncoderModel):
    """A TextEncoderModel whose attention is GroupedRotaryAttention: its K/V head count and head
    width come from the config (not d_model / nhead)."""

    num_kv_heads = property(lambda self: self.config.num_kv_heads)
    head_dim = property(lambda self: self.config.head_dim)
