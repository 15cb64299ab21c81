"""Loaded models: the public callables the service uses (batched, varlen, attention weights)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import introspect
from .attention import FusedAttention
from .blocks import EncoderStack
from .varlen import make_plan, normalise_varlen_args, packed_attention, split


class EngineModel:
    """Shared read-only attributes and input handling of every loaded model."""

    architecture: str = ""

    def __init__(self, config: dict, device: torch.device, dtype: torch.dtype) -> None:
        self._config = dict(config)
        self._device = device
        self._dtype = dtype

    config = property(lambda self: dict(self._config), doc="Copy of config.json's contents.")
    device = property(lambda self: self._device)
    dtype = property(lambda self: self._dtype)
    embed_dim = property(lambda self: self._attn_layers()[0].embed_dim)
    num_heads = property(lambda self: self._attn_layers()[0].num_heads)
    num_kv_heads = property(lambda self: self._attn_layers()[0].num_kv_heads)
    head_dim = property(lambda self: self._attn_layers()[0].head_dim)
    kdim = property(lambda self: self._attn_layers()[0].kdim)
    vdim = property(lambda self: self._attn_layers()[0].vdim)
    num_layers = property(lambda self: len(self._attn_layers()))
    is_cross_attention_capable: bool = False

    def _attn_layers(self) -> list[FusedAttention]:
        raise NotImplementedError

    def _cast(self, x: Tensor | None) -> Tensor | None:
        """Move a floating input to the model's device and dtype (no copy when already there)."""
        if x is None or x.dtype == torch.bool:
            return None if x is None else x.to(self._device)
        if torch.is_floating_point(x):
            return x.to(device=self._device, dtype=self._dtype)
        raise TypeError(f"expected a floating point or bool tensor, got {x.dtype}")

    def diagnostics(self, batch_size: int = 1, seq_len: int = 128) -> dict[str, Any]:
        """SDPA backend picked for these shapes; why PyTorch's own MHA fast path would not run."""
        return introspect.diagnostics(self, batch_size, seq_len)

    def head_importance(self) -> list[dict[str, Any]]:
        """Per layer: each head's share of out_proj and the head-by-head cosine correlation."""
        return introspect.head_importance(self._attn_layers())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_layers={self.num_layers}, device={self.device}, dtype={self.dtype})"
        )


class MultiheadAttentionModel(EngineModel):
    """nn.MultiheadAttention(batch_first=True) as a fused, inference-only callable."""

    architecture = "multihead_attention"
    is_cross_attention_capable = True

    def __init__(self, attn: FusedAttention, config: dict, device, dtype) -> None:
        super().__init__(config, device, dtype)
        self._attn = attn

    def _attn_layers(self) -> list[FusedAttention]:
        return [self._attn]

    def _prepare(self, query, key, value, key_padding_mask, attn_mask):
        """Default key/value to query, cast once keeping `is` identity, add a missing batch dim."""
        key = query if key is None else key
        value = key if value is None else value
        cast = {id(t): self._cast(t) for t in (query, key, value)}
        query, key, value = cast[id(query)], cast[id(key)], cast[id(value)]
        batched = query.dim() == 3
        if not batched:
            if query.dim() != 2:
                raise ValueError(f"query must be (B, T, E) or (T, E), got {tuple(query.shape)}")
            same = {id(t): t.unsqueeze(0) for t in (query, key, value)}
            query, key, value = same[id(query)], same[id(key)], same[id(value)]
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
            raise ValueError(
                f"key/value feature sizes {key.shape[-1]}/{value.shape[-1]} != "
                f"kdim/vdim {self.kdim}/{self.vdim}"
            )
        masks = self._cast(key_padding_mask), self._cast(attn_mask)
        return query, key, value, masks, batched

    @torch.inference_mode()
    def __call__(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        need_weights: bool = False,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Like nn.MultiheadAttention(batch_first=True).forward, but need_weights defaults False."""
        q, k, v, (kpm, mask), batched = self._prepare(
            query, key, value, key_padding_mask, attn_mask
        )
        out, weights = self._attn.forward(q, k, v, kpm, mask, is_causal, need_weights)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, T, S)
        if not batched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    forward = __call__

    def attention_weights(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        layer: int | None = None,
        average_attn_weights: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Output and attention probabilities [B, H, T, S] (or [B, T, S] averaged)."""
        if layer not in (None, 0):
            raise ValueError(f"layer must be None or 0 for multihead_attention, got {layer}")
        return self(
            query, key, value, key_padding_mask, attn_mask, True, average_attn_weights, is_causal
        )

    @torch.inference_mode()
    def forward_varlen(
        self,
        query: list[Tensor],
        key: list[Tensor] | None = None,
        value: list[Tensor] | None = None,
        key_padding_mask: list[Tensor | None] | None = None,
        is_causal: list[bool] | bool = False,
    ) -> list[Tensor]:
        """Attention over sequences of different lengths, packed without padding."""
        self_attn = key is None and value is None
        query, key, value, kpm, causal = normalise_varlen_args(
            query, key, value, key_padding_mask, is_causal
        )
        q = self._cast(torch.cat(query))  # (N, E)
        if self_attn:
            k = v = q
        else:
            k = self._cast(torch.cat(key))  # (M, kdim)
            v = k if value is key else self._cast(torch.cat(value))  # (M, vdim)
        plan = make_plan(
            [t.shape[0] for t in query], [t.shape[0] for t in key], causal, kpm, self._device
        )
        return split(packed_attention(self._attn, q, k, v, plan), plan)


class TransformerEncoderModel(EngineModel):
    """nn.TransformerEncoder(batch_first=True) (optionally with final norm) as a fused callable."""

    architecture = "transformer_encoder"

    def __init__(self, stack: EncoderStack, config: dict, device, dtype) -> None:
        super().__init__(config, device, dtype)
        self._stack = stack

    def _attn_layers(self) -> list[FusedAttention]:
        return [layer.self_attn for layer in self._stack.layers]

    def _run(self, src, mask, src_key_padding_mask, is_causal, keep_weights):
        src, mask, kpm = self._cast(src), self._cast(mask), self._cast(src_key_padding_mask)
        batched = src.dim() == 3
        if not batched:
            src = src.unsqueeze(0)  # (1, T, E)
            kpm = None if kpm is None else kpm.unsqueeze(0)
        collected: list[Tensor] = []

        def attn_fn(attn: FusedAttention, h: Tensor) -> Tensor:
            out, w = attn.forward(h, h, h, kpm, mask, is_causal, need_weights=keep_weights)
            if w is not None:
                collected.append(w)  # (B, H, T, S)
            return out

        out = self._stack.forward(src, attn_fn)  # (B, T, E)
        if not batched:
            out = out.squeeze(0)
            collected = [w.squeeze(0) for w in collected]
        return out, collected

    @torch.inference_mode()
    def __call__(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """Like nn.TransformerEncoder(batch_first=True).forward (padded rows are computed too)."""
        return self._run(src, mask, src_key_padding_mask, is_causal, keep_weights=False)[0]

    forward = __call__

    @torch.inference_mode()
    def attention_weights(
        self,
        src: Tensor,
        src_key_padding_mask: Tensor | None = None,
        mask: Tensor | None = None,
        is_causal: bool = False,
        layer: int | None = None,
        average_attn_weights: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Output plus weights [L, B, H, T, S] (layer=None) or [B, H, T, S]; averaging drops H."""
        if layer is not None and not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be None or in [0, {self.num_layers}), got {layer}")
        out, weights = self._run(src, mask, src_key_padding_mask, is_causal, keep_weights=True)
        stacked = torch.stack(weights) if layer is None else weights[layer]  # ([L,] B, H, T, S)
        if average_attn_weights:
            stacked = stacked.mean(dim=-3)
        return out, stacked

    @torch.inference_mode()
    def forward_varlen(
        self,
        query: list[Tensor],
        key: list[Tensor] | None = None,
        value: list[Tensor] | None = None,
        key_padding_mask: list[Tensor | None] | None = None,
        is_causal: list[bool] | bool = False,
    ) -> list[Tensor]:
        """Encoder over sequences of different lengths: packed tokens, attention per group."""
        if key is not None or value is not None:
            raise ValueError("transformer_encoder is self-attention only: key/value must be None")
        query, _, _, kpm, causal = normalise_varlen_args(
            query, None, None, key_padding_mask, is_causal
        )
        lens = [t.shape[0] for t in query]
        plan = make_plan(lens, lens, causal, kpm, self._device)
        x = self._cast(torch.cat(query))  # (N, E)
        out = self._stack.forward(x, lambda attn, h: packed_attention(attn, h, h, h, plan))
        return split(out, plan)
