"""Loaded decoder models: nn.TransformerDecoder as fused, inference-only calls, and the base
that TransformerModel (transformer_model.py, nn.Transformer) shares with it.

TransformerDecoderModel wraps one DecoderStack (`decoder`). `forward` follows PyTorch's
batch_first=True signatures (padded inputs, PyTorch's masks); `forward_packed` takes packed
variable-length targets and memories (two cu_seqlens, padding simply absent), batch invariant
bit for bit; `attention_weights` gives each layer's self- and cross-attention weights per head.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import introspect
from .attention import FusedAttention
from .config import TransformerDecoderConfig
from .cuda_graphs import graph_mode
from .decoder_blocks import DecoderMasks, DecoderPlans, DecoderStack
from .engine_model import EngineModel
from .packing import check_packed
from .varlen import Plan, cumulative, lengths, make_plan, pad_rows

Causal = bool | Sequence[bool] | Tensor
# attention_weights' keys: decoder self-attention, decoder cross-attention, encoder (nn.Transformer)
SELF, CROSS, ENCODER = "self_attn", "cross_attn", "encoder_self_attn"


class _DecoderBase(EngineModel):
    """What the decoder and the whole transformer share: dims, input checks, the decoder pass."""

    kdim = vdim = property(lambda self: self.config.d_model)
    num_layers = property(lambda self: self.config.num_layers)

    def _stack(self) -> DecoderStack:
        raise NotImplementedError

    def attention_layers(self) -> list[FusedAttention]:
        """Per decoder layer its self_attn then its multihead_attn (cross-attention)."""
        return [
            a for layer in self._stack().layers for a in (layer.self_attn, layer.multihead_attn)
        ]

    def head_importance(self) -> list[dict[str, Any]]:
        """Per decoder layer: its self-attention heads' shares of out_proj (as an encoder's),
        with the cross-attention's under "cross_attn"."""
        layers = self._stack().layers
        report = introspect.head_importance([layer.self_attn for layer in layers])
        cross = introspect.head_importance([layer.multihead_attn for layer in layers])
        for entry, other in zip(report, cross, strict=True):
            entry["cross_attn"] = {k: v for k, v in other.items() if k != "layer"}
        return report

    def _dense(self, name: str, x: Tensor | None, batched: bool | None) -> Tensor | None:
        """Cast a padded (B, L, E) input (or (L, E) unbatched) to (B, L, E), checking its width."""
        if x is None:
            return None
        x = self._cast(x)
        want = 3 if batched else 2
        if x.dim() != want or x.shape[-1] != self.embed_dim:
            shape = "(B, L, E)" if batched else "(L, E)"
            raise ValueError(
                f"{name} must be {shape} with E = {self.embed_dim}, got {tuple(x.shape)}"
            )
        return x if batched else x.unsqueeze(0)

    def _masks(self, batched: bool, masks: DecoderMasks) -> DecoderMasks:
        """PyTorch's masks cast to the model; unbatched padding masks get their batch dim."""
        cast = {}
        for name, m in masks._asdict().items():
            if isinstance(m, Tensor):
                m = self._cast(m)
                m = m.unsqueeze(0) if not batched and name.endswith("padding_mask") else m
            cast[name] = m
        return DecoderMasks(**cast)

    def _varlen(self, first, second, tgt_lens, tgt_is_causal) -> list[Tensor]:
        """forward_varlen of both models: two lists packed, forward_packed, split by tgt."""
        out = self.forward_packed(
            torch.cat(first),
            cumulative([x.shape[0] for x in first]),
            torch.cat(second),
            cumulative([x.shape[0] for x in second]),
            tgt_is_causal=tgt_is_causal,
        )
        return list(out.split(tgt_lens))

    def _decode_packed(
        self,
        x: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        memory: Tensor,
        memory_rows: int,
        cu_seqlens_memory: Tensor | Sequence[int],
        tgt_key_padding_mask: Tensor | None,
        memory_key_padding_mask: Tensor | None,
        tgt_is_causal: Causal,
        memory_is_causal: Causal,
        bucket_padding: float,
    ) -> Tensor:
        """The decoder stack over packed targets x (N, E) and the memory's states (its first
        `memory_rows` rows are real, the rest padding from pad_rows): the self-attention plan
        over the targets and the cross-attention plan target -> memory, made once for every
        layer; returns (N, E)."""
        t_lens = lengths(cu_seqlens, x.shape[0], "cu_seqlens")
        m_lens = lengths(cu_seqlens_memory, memory_rows, "cu_seqlens_memory")
        if len(t_lens) != len(m_lens):
            raise ValueError(
                f"tgt has {len(t_lens)} sequences but memory has {len(m_lens)}: "
                "each target needs its own memory"
            )
        if (
            self.cuda_graphs is not None
            and memory_key_padding_mask is None
            and graph_mode(None, memory_is_causal) is False
        ):
            mode = graph_mode(tgt_key_padding_mask, tgt_is_causal)
            real = (memory[:memory_rows],)  # (M, E): pad_rows' padding left out
            if (out := self._replay_cross(x, t_lens, real, m_lens, mode)) is not None:
                return out  # (N, E) from a CUDA graph
        device = self.device
        plans = DecoderPlans(
            make_plan(t_lens, t_lens, tgt_is_causal, tgt_key_padding_mask, device, bucket_padding),
            make_plan(
                t_lens, m_lens, memory_is_causal, memory_key_padding_mask, device, bucket_padding
            ),
        )
        out = self._stack()(pad_rows(x), memory, plans=plans)[0]  # (max(N, MIN_ROWS), E)
        return out[: x.shape[0]]  # (N, E)

    cross_memory_widths = property(lambda self: (self.embed_dim,))

    def packed_cross_run(
        self, x: Tensor, memory: tuple[Tensor, ...], self_plan: Plan, cross_plan: Plan
    ) -> Tensor:
        """The decoder stack over rows x (N, E) and one memory (M, E): what graphs capture."""
        return self._stack()(x, memory[0], plans=DecoderPlans(self_plan, cross_plan))[0]

    def _packed(self, name: str, x: Tensor) -> Tensor:
        x = self._cast(x)
        check_packed(x, self.embed_dim, name)
        return x


def _stacked(weights: list[Tensor], layer: int | None, average: bool) -> Tensor:
    """[L, B, H, T, S] (layer=None) or one layer's [B, H, T, S]; averaging drops H."""
    stacked = torch.stack(weights) if layer is None else weights[layer]
    return stacked.mean(dim=-3) if average else stacked


def _check_layer(layer: int | None, count: int) -> None:
    if layer is not None and not 0 <= layer < count:
        raise ValueError(f"layer must be None or in [0, {count}), got {layer}")


def _unbatch(out: Tensor, weights: dict[str, list[Tensor]], batched: bool):
    if batched:
        return out, weights
    return out.squeeze(0), {k: [w.squeeze(0) for w in ws] for k, ws in weights.items()}


class TransformerDecoderModel(_DecoderBase):
    """nn.TransformerDecoder(batch_first=True) (optionally with final norm) as a fused callable."""

    architecture = TransformerDecoderConfig.architecture

    def __init__(self, config: TransformerDecoderConfig) -> None:
        super().__init__(config)
        self.decoder = DecoderStack(config)

    core = property(lambda self: self.decoder, doc="nn.TransformerDecoder's names")

    def _stack(self) -> DecoderStack:
        return self.decoder

    def _run(self, tgt, memory, masks: DecoderMasks, need_weights: bool):
        batched = tgt.dim() == 3
        x = self._dense("tgt", tgt, batched)  # (B, T, E)
        mem = self._dense("memory", memory, batched)  # (B, S, E)
        if mem.shape[0] != x.shape[0]:
            raise ValueError(f"tgt has batch size {x.shape[0]} but memory has {mem.shape[0]}")
        out, self_ws, cross_ws = self.decoder(
            x, mem, self._masks(batched, masks), None, need_weights
        )
        return _unbatch(out, {SELF: self_ws, CROSS: cross_ws}, batched)

    @torch.inference_mode()
    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """Like nn.TransformerDecoder(batch_first=True).forward: tgt (B, T, E), memory (B, S, E)
        (or unbatched (T, E), (S, E)); tgt_is_causal alone (no tgt_mask) is a causal mask."""
        masks = DecoderMasks(
            tgt_mask,
            memory_mask,
            tgt_key_padding_mask,
            memory_key_padding_mask,
            tgt_is_causal,
            memory_is_causal,
        )
        return self._run(tgt, memory, masks, need_weights=False)[0]

    @torch.inference_mode()
    def attention_weights(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        layer: int | None = None,
        average_attn_weights: bool = False,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Output plus {"self_attn": [L,] B, H, T, T; "cross_attn": [L,] B, H, T, S}, each
        equal to nn.MultiheadAttention's need_weights=True, average_attn_weights=False."""
        _check_layer(layer, self.num_layers)
        masks = DecoderMasks(
            tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask, tgt_is_causal
        )
        out, weights = self._run(tgt, memory, masks, need_weights=True)
        return out, {k: _stacked(w, layer, average_attn_weights) for k, w in weights.items()}

    @torch.inference_mode()
    def forward_packed(
        self,
        tgt: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        memory: Tensor,
        cu_seqlens_memory: Tensor | Sequence[int],
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: Causal = False,
        memory_is_causal: Causal = False,
        bucket_padding: float = 0.0,
    ) -> Tensor:
        """Decoder over packed targets tgt (N, E) split at cu_seqlens (B+1,) and their memories
        (M, E) split at cu_seqlens_memory (B+1,); returns (N, E).

        Padding masks are packed too ((N,) and (M,), True = ignore); tgt_is_causal is one flag
        or one per sequence. Both plans are made once and reused by every layer.
        """
        x, mem = self._packed("tgt", tgt), self._packed("memory", memory)  # (N, E), (M, E)
        return self._decode_packed(
            x,
            cu_seqlens,
            pad_rows(mem),
            mem.shape[0],
            cu_seqlens_memory,
            tgt_key_padding_mask,
            memory_key_padding_mask,
            tgt_is_causal,
            memory_is_causal,
            bucket_padding,
        )  # (N, E)

    @torch.inference_mode()
    def forward_varlen(  # type: ignore[override]
        self,
        tgt: list[Tensor],
        memory: list[Tensor],
        tgt_is_causal: list[bool] | bool = False,
    ) -> list[Tensor]:
        """Lists of (T_i, E) targets and (S_i, E) memories: a thin forward_packed wrapper."""
        return self._varlen(tgt, memory, [t.shape[0] for t in tgt], tgt_is_causal)
