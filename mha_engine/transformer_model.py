"""A loaded nn.Transformer (encoder + decoder with their norms) as one fused, inference-only
model: TransformerModel wraps one TransformerCore (`transformer`). Its forward, packed and
attention-weight calls follow TransformerDecoderModel's (decoder_models.py), with the source
run through the encoder first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .attention import FusedAttention
from .config import TransformerConfig
from .decoder_blocks import DecoderMasks, DecoderStack, TransformerCore
from .decoder_models import (
    CROSS,
    ENCODER,
    SELF,
    Causal,
    _check_layer,
    _DecoderBase,
    _stacked,
    _unbatch,
)
from .varlen import lengths, make_plan, pad_rows


class TransformerModel(_DecoderBase):
    """nn.Transformer(batch_first=True) as a fused callable: the encoder (with its norm) reads
    src into the memory, the decoder (with its norm) reads tgt and the memory."""

    architecture = TransformerConfig.architecture

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        self.transformer = TransformerCore(config)

    core = property(lambda self: self.transformer, doc="nn.Transformer's names")

    def _stack(self) -> DecoderStack:
        return self.transformer.decoder

    def attention_layers(self) -> list[FusedAttention]:
        """Encoder self_attn layers, then per decoder layer self_attn and multihead_attn."""
        encoder = [layer.self_attn for layer in self.transformer.encoder.layers]
        return encoder + super().attention_layers()

    def _run(self, src, tgt, src_masks: dict, masks: DecoderMasks, need_weights: bool):
        batched = tgt.dim() == 3
        s = self._dense("src", src, batched)  # (B, S, E)
        x = self._dense("tgt", tgt, batched)  # (B, T, E)
        if s.shape[0] != x.shape[0]:
            raise ValueError(f"src has batch size {s.shape[0]} but tgt has {x.shape[0]}")
        kpm = src_masks["src_key_padding_mask"]
        kpm = None if kpm is None else self._cast(kpm)
        kpm = kpm if kpm is None or batched else kpm.unsqueeze(0)
        memory, enc_ws = self.transformer.encoder(
            s,
            kpm,
            self._cast(src_masks["src_mask"]),
            src_masks["src_is_causal"],
            None,
            need_weights,
        )  # (B, S, E)
        out, self_ws, cross_ws = self.transformer.decoder(
            x, memory, self._masks(batched, masks), None, need_weights
        )
        return _unbatch(out, {ENCODER: enc_ws, SELF: self_ws, CROSS: cross_ws}, batched)

    @torch.inference_mode()
    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        src_is_causal: bool = False,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """Like nn.Transformer(batch_first=True).forward: src (B, S, E), tgt (B, T, E)."""
        src_masks = dict(
            src_mask=src_mask,
            src_key_padding_mask=src_key_padding_mask,
            src_is_causal=src_is_causal,
        )
        masks = DecoderMasks(
            tgt_mask,
            memory_mask,
            tgt_key_padding_mask,
            memory_key_padding_mask,
            tgt_is_causal,
            memory_is_causal,
        )
        return self._run(src, tgt, src_masks, masks, need_weights=False)[0]

    @torch.inference_mode()
    def attention_weights(
        self,
        src: Tensor,
        tgt: Tensor,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        layer: int | None = None,
        average_attn_weights: bool = False,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Output plus {"self_attn": [Ld,] B, H, T, T; "cross_attn": [Ld,] B, H, T, S;
        "encoder_self_attn": Le, B, H, S, S}; `layer` picks one decoder layer (the encoder's
        weights keep every layer)."""
        _check_layer(layer, self.config.num_decoder_layers)
        src_masks = dict(
            src_mask=None, src_key_padding_mask=src_key_padding_mask, src_is_causal=False
        )
        masks = DecoderMasks(
            None, None, tgt_key_padding_mask, memory_key_padding_mask, tgt_is_causal
        )
        out, weights = self._run(src, tgt, src_masks, masks, need_weights=True)
        picked = {ENCODER: _stacked(weights.pop(ENCODER), None, average_attn_weights)}
        picked.update({k: _stacked(w, layer, average_attn_weights) for k, w in weights.items()})
        return out, picked

    @torch.inference_mode()
    def forward_packed(
        self,
        src: Tensor,
        cu_seqlens_src: Tensor | Sequence[int],
        tgt: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: Causal = False,
        src_is_causal: Causal = False,
        bucket_padding: float = 0.0,
    ) -> Tensor:
        """Transformer over packed sources src (M, E) split at cu_seqlens_src (B+1,) and targets
        tgt (N, E) split at cu_seqlens (B+1,); returns (N, E). Masks are packed ((M,), (N,),
        (M,)); padding is simply absent from packed inputs."""
        s, x = self._packed("src", src), self._packed("tgt", tgt)  # (M, E), (N, E)
        s_lens = lengths(cu_seqlens_src, s.shape[0], "cu_seqlens_src")
        enc_plan = make_plan(
            s_lens, s_lens, src_is_causal, src_key_padding_mask, self.device, bucket_padding
        )
        memory = self.transformer.encoder(pad_rows(s), plan=enc_plan)[0]  # (max(M, MIN_ROWS), E)
        return self._decode_packed(
            x,
            cu_seqlens,
            memory,
            s.shape[0],  # the memory has the sources' rows (plus padding rows from pad_rows)
            cu_seqlens_src,
            tgt_key_padding_mask,
            memory_key_padding_mask,
            tgt_is_causal,
            False,
            bucket_padding,
        )  # (N, E)

    @torch.inference_mode()
    def forward_varlen(  # type: ignore[override]
        self,
        src: list[Tensor],
        tgt: list[Tensor],
        tgt_is_causal: list[bool] | bool = False,
    ) -> list[Tensor]:
        """Lists of (S_i, E) sources and (T_i, E) targets: a thin forward_packed wrapper."""
        return self._varlen(src, tgt, [t.shape[0] for t in tgt], tgt_is_causal)
