"""Transformer decoder layer and stack as nn.Modules, equal to nn.TransformerDecoderLayer/Decoder.

Names are PyTorch's (self_attn, multihead_attn, linear1, linear2, norm1..3; layers, norm), so
nn.TransformerDecoder state dicts load as they are. Self-attention projects Q/K/V with one fused
GEMM; cross-attention projects Q from the target and K/V from the memory with one fused GEMM
(rows [K; V] of multihead_attn.in_proj_weight). Dense (B, T, E) batches take PyTorch's masks;
packed (N, E) targets and (M, E) memories take two varlen Plans (self and cross).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn

from .attention import FusedAttention
from .blocks import EncoderLayer, EncoderStack
from .config import LayerStackConfig, TransformerConfig
from .varlen import Plan


class DecoderMasks(NamedTuple):
    """PyTorch's decoder masks for dense inputs (any may be None)."""

    tgt_mask: Tensor | None = None  # (T, T) or (B*H, T, T)
    memory_mask: Tensor | None = None  # (T, S) or (B*H, T, S)
    tgt_key_padding_mask: Tensor | None = None  # (B, T)
    memory_key_padding_mask: Tensor | None = None  # (B, S)
    tgt_is_causal: bool = False
    memory_is_causal: bool = False


NO_MASKS = DecoderMasks()


class DecoderPlans(NamedTuple):
    """Packed inputs' attention plans: target self-attention and target-to-memory attention."""

    self_attn: Plan
    cross_attn: Plan


class LayerOutput(NamedTuple):
    out: Tensor  # (B, T, E) or packed (N, E)
    self_weights: Tensor | None  # (B, H, T, T) with need_weights
    cross_weights: Tensor | None  # (B, H, T, S) with need_weights


class DecoderLayer(EncoderLayer):
    """One decoder layer: self-attention, cross-attention to the memory, feed-forward; post-norm
    or pre-norm (norm_first). Shares the encoder layer's self_attn/linear1/linear2/norm1/norm2."""

    def __init__(self, config: LayerStackConfig) -> None:
        super().__init__(config)
        E, eps = config.d_model, config.layer_norm_eps
        self.multihead_attn = FusedAttention(config.attention)
        self.norm3 = nn.LayerNorm(E, eps=eps, bias=config.bias)

    def _sa(
        self, h: Tensor, masks: DecoderMasks, plans: DecoderPlans | None, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        if plans is not None:
            return self.self_attn.forward_packed(h, plans.self_attn), None  # (N, E): one QKV GEMM
        return self.self_attn(  # (B, T, E), (B, H, T, T)
            h,
            h,
            h,
            masks.tgt_key_padding_mask,
            masks.tgt_mask,
            masks.tgt_is_causal,
            need_weights,
        )

    def _ca(
        self,
        h: Tensor,
        memory: Tensor,
        masks: DecoderMasks,
        plans: DecoderPlans | None,
        need_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        if plans is not None:  # Q GEMM on (N, E), one fused K/V GEMM on the memory (M, E)
            return self.multihead_attn.forward_packed(h, plans.cross_attn, memory, memory), None
        return self.multihead_attn(  # (B, T, E), (B, H, T, S)
            h,
            memory,
            memory,
            masks.memory_key_padding_mask,
            masks.memory_mask,
            masks.memory_is_causal,
            need_weights,
        )

    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        memory: Tensor,
        masks: DecoderMasks = NO_MASKS,
        plans: DecoderPlans | None = None,
        need_weights: bool = False,
    ) -> LayerOutput:
        """x (B, T, E) and memory (B, S, E) with masks, or packed x (N, E) and memory (M, E)
        with their plans. Returns the output (same shape as x) and, with need_weights, the
        self- and cross-attention weights per head."""
        if self.norm_first:
            a, self_w = self._sa(self.norm1(x), masks, plans, need_weights)
            x = x + a
            c, cross_w = self._ca(self.norm2(x), memory, masks, plans, need_weights)
            x = x + c
            x = x + self._ff(self.norm3(x))
        else:
            a, self_w = self._sa(x, masks, plans, need_weights)
            x = self.norm1(x + a)
            c, cross_w = self._ca(x, memory, masks, plans, need_weights)
            x = self.norm2(x + c)
            x = self.norm3(x + self._ff(x))
        return LayerOutput(x, self_w, cross_w)


class DecoderStack(EncoderStack):
    """num_layers DecoderLayers plus the optional final LayerNorm (nn.TransformerDecoder.norm)."""

    layer_class = DecoderLayer

    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        memory: Tensor,
        masks: DecoderMasks = NO_MASKS,
        plans: DecoderPlans | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Every layer then the final norm. Returns the output and, with need_weights, each
        layer's self-attention (B, H, T, T) and cross-attention (B, H, T, S) weights."""
        self_ws: list[Tensor] = []
        cross_ws: list[Tensor] = []
        for layer in self.layers:
            x, self_w, cross_w = layer(x, memory, masks, plans, need_weights)
            if need_weights:
                self_ws.append(self_w)
                cross_ws.append(cross_w)
        if self.norm is not None:
            x = self.norm(x)
        return x, self_ws, cross_ws


class TransformerCore(nn.Module):
    """nn.Transformer's modules under its names: encoder (EncoderStack + norm), decoder."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.encoder = EncoderStack(config.encoder)
        self.decoder = DecoderStack(config.decoder)
