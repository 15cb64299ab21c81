"""Loaded models as nn.Modules: the calls the service uses (batched, varlen, attention weights).

MultiheadAttentionModel wraps one FusedAttention (`attn`), TransformerEncoderModel one
EncoderStack (`encoder`); `forward` follows nn.MultiheadAttention / nn.TransformerEncoder
(batch_first=True), on the shared EngineModel base (engine_model.py). The service sees them
through the ServedModel protocol (protocol.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .attention import FusedAttention
from .blocks import EncoderStack
from .config import MultiheadAttentionConfig, TransformerEncoderConfig
from .cuda_graphs import graph_mode
from .engine_model import EngineModel
from .packing import check_packed
from .varlen import Plan, lengths, make_plan, pad_rows


class MultiheadAttentionModel(EngineModel):
    """nn.MultiheadAttention(batch_first=True) as a fused, inference-only callable."""

    architecture = MultiheadAttentionConfig.architecture

    def __init__(self, config: MultiheadAttentionConfig) -> None:
        super().__init__(config)
        self.attn = FusedAttention(config)

    def attention_layers(self) -> list[FusedAttention]:
        return [self.attn]

    core = property(lambda self: self.attn, doc="nn.MultiheadAttention's names")

    def _prepare(self, query, key, value, key_padding_mask, attn_mask):
        """Default key/value to query, cast once keeping `is` identity, add a missing batch dim."""
        key = query if key is None else key
        value = key if value is None else value
        cast = {}
        for t in (query, key, value):
            if id(t) not in cast:
                cast[id(t)] = self._cast(t)
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

    def forward(
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
        out, weights = self.attn(q, k, v, kpm, mask, is_causal, need_weights)  # (B, T, E)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, T, S)
        if not batched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    @torch.inference_mode()
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
    def forward_packed(
        self,
        query: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        key: Tensor | None = None,
        value: Tensor | None = None,
        cu_seqlens_k: Tensor | Sequence[int] | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool | Sequence[bool] | Tensor = False,
        bucket_padding: float = 0.0,
    ) -> Tensor:
        """Attention over packed sequences; returns (N, E).

        query (N, E) holds B sequences split at cu_seqlens (B+1,). key (M, kdim) / value
        (M, vdim) split at cu_seqlens_k (default cu_seqlens) give cross-attention; omitted,
        it is self-attention. key_padding_mask (M,) covers the packed keys (True = ignore, or
        additive float); is_causal is one flag or one per sequence. bucket_padding > 0 opts
        into padded buckets (fewer SDPA calls, not bit-exact batch invariant; see varlen.py).
        """
        q = self._cast(query)  # (N, E)
        check_packed(q, self.embed_dim, "query")
        q_lens = lengths(cu_seqlens, q.shape[0])
        if key is None:
            if value is not None or cu_seqlens_k is not None:
                raise ValueError(
                    "value and cu_seqlens_k need a key (omit all three for self-attention)"
                )
            k = v = q
            kv_lens = q_lens
        else:
            k = self._cast(key)  # (M, kdim)
            v = k if value is None or value is key else self._cast(value)  # (M, vdim)
            check_packed(k, self.kdim, "key")
            check_packed(v, self.vdim, "value")
            if v.shape[0] != k.shape[0]:
                raise ValueError(f"key has {k.shape[0]} rows, value {v.shape[0]}")
            kv_cu = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
            kv_lens = lengths(kv_cu, k.shape[0], "cu_seqlens_k")
        out = None
        if self.cuda_graphs is not None:
            mode = graph_mode(key_padding_mask, is_causal)
            if k is q:
                out = self._replay(q, q_lens, mode)
            elif v is not k and mode is False:  # own key and value: two K/V GEMMs, as eagerly
                out = self._replay_cross(q, q_lens, (k, v), kv_lens, False)
        if out is not None:
            return out  # (N, E) from a CUDA graph
        plan = make_plan(q_lens, kv_lens, is_causal, key_padding_mask, q.device, bucket_padding)
        if k is q:
            return _rows(self.packed_run(pad_rows(q), plan), q.shape[0])  # (N, E), see pad_rows
        q_pad = pad_rows(q)  # small batches padded: see varlen.MIN_GEMM_ROWS
        k_pad = q_pad if k is q else pad_rows(k)
        v_pad = k_pad if v is k else pad_rows(v)
        return _rows(self.attn.forward_packed(q_pad, plan, k_pad, v_pad), q.shape[0])  # (N, E)

    def packed_run(self, x: Tensor, plan: Plan) -> Tensor:
        return self.attn.forward_packed(x, plan)  # (N, E)

    cross_memory_widths = property(lambda self: (self.kdim, self.vdim))

    def packed_cross_run(
        self, x: Tensor, memory: tuple[Tensor, ...], self_plan: Plan, cross_plan: Plan
    ) -> Tensor:
        key, value = memory  # (M, kdim), (M, vdim)
        return self.attn.forward_packed(x, cross_plan, key, value)  # (N, E)


class TransformerEncoderModel(EngineModel):
    """nn.TransformerEncoder(batch_first=True) (optionally with final norm) as a fused callable."""

    architecture = TransformerEncoderConfig.architecture
    stack_class: type[nn.Module] = EncoderStack  # ModernBERT's stack for its models

    def __init__(self, config: TransformerEncoderConfig) -> None:
        super().__init__(config)
        self.encoder = self.stack_class(config)

    def attention_layers(self) -> list[FusedAttention]:
        return [layer.self_attn for layer in self.encoder.layers]

    core = property(lambda self: self.encoder, doc="nn.TransformerEncoder's names")

    def _run(self, src, mask, src_key_padding_mask, is_causal, keep_weights):
        src, mask, kpm = self._cast(src), self._cast(mask), self._cast(src_key_padding_mask)
        batched = src.dim() == 3
        if not batched:
            src = src.unsqueeze(0)  # (1, T, E)
            kpm = None if kpm is None else kpm.unsqueeze(0)
        out, collected = self.encoder(src, kpm, mask, is_causal, need_weights=keep_weights)
        if not batched:
            out = out.squeeze(0)
            collected = [w.squeeze(0) for w in collected]
        return out, collected

    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """Like nn.TransformerEncoder(batch_first=True).forward (padded rows are computed too)."""
        return self._run(src, mask, src_key_padding_mask, is_causal, keep_weights=False)[0]

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
    def forward_packed(
        self,
        query: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        key: Tensor | None = None,
        value: Tensor | None = None,
        cu_seqlens_k: Tensor | Sequence[int] | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool | Sequence[bool] | Tensor = False,
        bucket_padding: float = 0.0,
    ) -> Tensor:
        """Encoder over packed sequences (N, E) split at cu_seqlens (B+1,); returns (N, E).

        The attention plan is made once and reused by every layer. key_padding_mask is (N,);
        key, value and cu_seqlens_k must be None (self-attention only).
        """
        if key is not None or value is not None or cu_seqlens_k is not None:
            raise ValueError("transformer_encoder is self-attention only: key/value must be None")
        x = self._cast(query)  # (N, E)
        check_packed(x, self.embed_dim, "query")
        lens = lengths(cu_seqlens, x.shape[0])
        return self._encode(x, lens, key_padding_mask, is_causal, bucket_padding)  # (N, E)

    def packed_run(self, x: Tensor, plan: Plan) -> Tensor:
        return self.encoder(x, plan=plan)[0]  # (N, E)

    def _encode(self, x, lens, key_padding_mask, is_causal, bucket_padding) -> Tensor:
        """Packed rows x (N, E) through the stack: a graph replay when one applies."""
        if (out := self._replay(x, lens, graph_mode(key_padding_mask, is_causal))) is not None:
            return out  # (N, E) from a CUDA graph
        plan = make_plan(lens, lens, is_causal, key_padding_mask, x.device, bucket_padding)
        return _rows(self.packed_run(pad_rows(x), plan), x.shape[0])  # (N, E), see pad_rows


def _rows(out: Tensor, n: int) -> Tensor:
    """The first n rows of out (the rest are pad_rows' padding): out itself when it has n."""
    return out if out.shape[0] == n else out[:n]
