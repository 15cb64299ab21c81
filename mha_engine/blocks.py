"""Transformer encoder layer and stack as nn.Modules, equal to nn.TransformerEncoderLayer/Encoder.

Module and parameter names are PyTorch's (self_attn, linear1, linear2, norm1, norm2; layers,
norm), so nn.TransformerEncoder state dicts load as they are. Every op except attention is per
token, so one layer serves dense (B, T, E) batches and packed (N, E) tokens with a varlen Plan.
A stack may carry a position bias shared by its layers (`position_bias`: MPNet's relative bias,
JinaBERT's ALiBi), and a gated feed-forward (JinaBERT: linear1 gives [gate; up] rows).
"""

from __future__ import annotations

from torch import Tensor, nn

from .attention import FusedAttention
from .config import TransformerEncoderConfig
from .fused import ACTIVATIONS, gated_linear, linear
from .position_bias import AlibiBias, BiasCache, RelativePositionBias
from .varlen import AttnBias, Plan


class EncoderLayer(nn.Module):
    """One encoder layer: self-attention + feed-forward, post-norm or pre-norm (norm_first). A
    gated feed-forward (config.gated_ffn, JinaBERT's GLU) is linear2(act(gate) * up) with
    [gate; up] = linear1(x), linear1 without bias."""

    def __init__(self, config: TransformerEncoderConfig) -> None:
        super().__init__()
        E, F_, bias = config.d_model, config.dim_feedforward, config.bias
        eps = config.layer_norm_eps
        self.gated = getattr(config, "gated_ffn", False)  # TextEncoderConfig's
        self.self_attn = FusedAttention(config.attention)
        if self.gated:
            self.linear1 = nn.Linear(E, 2 * F_, bias=False)  # rows [gate; up]
        else:
            self.linear1 = nn.Linear(E, F_, bias=bias)
        self.linear2 = nn.Linear(F_, E, bias=bias)
        self.norm1 = nn.LayerNorm(E, eps=eps, bias=bias)
        self.norm2 = nn.LayerNorm(E, eps=eps, bias=bias)
        self.norm_first = config.norm_first
        self.activation_name = config.activation

    def _self_attention(
        self,
        h: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
        plan: Plan | None,
        need_weights: bool,
        attn_bias: Tensor | AttnBias | None,
        residual: Tensor,
    ) -> tuple[Tensor, Tensor | None]:
        """residual + self-attention(h); packed, the add is fused into out_proj."""
        if plan is not None:  # packed tokens: attention per group of equal-shaped sequences
            out = self.self_attn.forward_packed(h, plan, residual=residual, attn_bias=attn_bias)
            return out, None  # (N, E)
        attend = (key_padding_mask, attn_mask, is_causal, need_weights, attn_bias)
        a, w = self.self_attn(h, h, h, *attend)
        return residual + a, w

    def _ff(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """[residual +] linear2(activation(linear1(x))), activation and add fused on CPU; gated:
        linear2(activation(gate) * up)."""
        if self.gated:
            act = ACTIVATIONS[self.activation_name]
            return gated_linear(self.linear1, self.linear2, x, act, residual)  # (..., E)
        h = linear(self.linear1, x, self.activation_name)  # (..., F)
        return linear(self.linear2, h, residual=residual)  # (..., E)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        plan: Plan | None = None,
        need_weights: bool = False,
        attn_bias: Tensor | AttnBias | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x: dense (B, T, E) with masks, or packed (N, E) with the plan of its sequences;
        attn_bias: an additive score bias, (1, H, T, T) dense, per sequence length packed.

        Returns the layer output (same shape) and, with need_weights, weights (B, H, T, S).
        """
        attend = (key_padding_mask, attn_mask, is_causal, plan, need_weights, attn_bias)
        if self.norm_first:
            x, weights = self._self_attention(self.norm1(x), *attend, residual=x)
            x = self._ff(self.norm2(x), residual=x)
        else:
            x, weights = self._self_attention(x, *attend, residual=x)
            x = self.norm1(x)
            x = self.norm2(self._ff(x, residual=x))
        return x, weights


class EncoderStack(nn.Module):
    """num_layers EncoderLayers plus the optional final LayerNorm (nn.TransformerEncoder.norm),
    and the position bias where the config has one (MPNet's relative bias, JinaBERT's ALiBi)."""

    layer_class: type[nn.Module] = EncoderLayer

    def __init__(self, config: TransformerEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(self.layer_class(config) for _ in range(config.num_layers))
        self.norm = (
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
            if config.final_norm
            else None
        )
        buckets = getattr(config, "relative_attention_num_buckets", 0)  # TextEncoderConfig's
        self.position_bias: RelativePositionBias | AlibiBias | None = None
        if buckets:
            self.position_bias = RelativePositionBias(config.nhead, buckets)
        elif getattr(config, "alibi", False):
            self.position_bias = AlibiBias(config.nhead)

    @property
    def cuda_graphs_refusal(self) -> str | None:
        """Why CUDA graphs cannot replay this stack (None: they can)."""
        if self.position_bias is not None:
            return "the kernel takes no position bias (MPNet's relative bias, ALiBi)"
        return None

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        plan: Plan | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor]]:
        """Every layer then the final norm on (B, T, E) or packed (N, E) tokens.

        Returns the output and, with need_weights, each layer's weights (B, H, T, S).
        """
        weights: list[Tensor] = []
        bias: Tensor | AttnBias | None = None
        if self.position_bias is not None:  # computed once, shared by every layer
            if plan is not None:
                bias = BiasCache(self.position_bias, x.dtype, x.device)
            else:
                T = x.shape[-2]
                bias = self.position_bias(T, T, x.dtype, x.device)  # (1, H, T, T)
        for layer in self.layers:
            x, w = layer(x, key_padding_mask, attn_mask, is_causal, plan, need_weights, bias)
            if w is not None:
                weights.append(w)
        if self.norm is not None:
            x = self.norm(x)
        return x, weights
