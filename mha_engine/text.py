"""Text pieces around an encoder: token embeddings in front, pooling and normalisation behind.

They work on packed tokens (N, ...) with per-sequence lengths, the layout forward_varlen uses,
and on padded (B, T, ...) batches where a function says so. Additions follow Hugging Face's
order (word + token type, then + position) so fp32 results match it closely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .devices import upload
from .text_config import POOLING_MODES, TextEncoderConfig


def packed_positions(lengths: list[int], device: torch.device) -> Tensor:
    """0..T_i-1 for every sequence, concatenated: (N,) long, built on the host (no sync)."""
    lens = torch.tensor(lengths, dtype=torch.long)  # (B,)
    starts = torch.cumsum(lens, 0) - lens  # (B,)
    total = int(lens.sum())
    positions = torch.arange(total) - starts.repeat_interleave(lens, output_size=total)  # (N,)
    return upload(positions, device)


def segment_ids(lengths: list[int], device: torch.device) -> Tensor:
    """Sequence index of every packed token: (N,) long, built on the host (no sync)."""
    lens = torch.tensor(lengths, dtype=torch.long)  # (B,)
    return upload(torch.arange(len(lengths)).repeat_interleave(lens), device)  # (N,)


class Float32Tables(nn.Module):
    """Embedding tables that stay float32 whatever dtype the model is cast to: lookup and
    LayerNorm run in float32 and the caller casts the result once, so a bf16 model's first layer
    gets the fp32 embeddings rounded once. `_table` is one of the subclass's tables."""

    def _table(self) -> Tensor:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        """Apply device moves only: the tables keep float32. The device is what `fn` makes of
        a tensor where the tables are: a cast by dtype alone keeps them there (a CPU probe
        would have moved a CUDA model's tables to the CPU)."""
        device = fn(self._table().new_zeros(())).device
        return super()._apply(lambda t: t.to(device=device), recurse)


class RotaryTables(Float32Tables):
    """Embedding tables of a family whose positions come from RoPE (no position table): the
    padded path's positions are 0..T-1 for every row, taken for TextEmbeddings' interface."""

    def padded_positions(self, input_ids: Tensor) -> Tensor:
        T = input_ids.shape[-1]
        return torch.arange(T, device=input_ids.device).expand_as(input_ids)


class TextEmbeddings(Float32Tables):
    """word + token-type + absolute position embeddings, then LayerNorm (BERT family).

    Submodule names are Hugging Face's (word_embeddings, position_embeddings,
    token_type_embeddings, LayerNorm), so an HF `embeddings.` state dict loads as it is.
    The tables stay float32 whatever dtype the model is cast to: lookup and LayerNorm run in
    float32 and the caller casts the result once, so a bf16 model's first layer gets the fp32
    embeddings rounded once. No position embeddings where positions come from elsewhere: a
    RoPE family sets `position_table` False (NomicBERT, GTE); an ALiBi config has none
    (JinaBERT).
    """

    position_table = True

    def __init__(self, config: TextEncoderConfig) -> None:
        super().__init__()
        D = config.d_model
        self.word_embeddings = nn.Embedding(config.vocab_size, D)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, D)
            if self.position_table and not config.alibi
            else None
        )
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, D) if config.type_vocab_size > 0 else None
        )  # None: DistilBERT
        self.LayerNorm = nn.LayerNorm(D, eps=config.layer_norm_eps)
        self.position_offset = config.position_offset  # RoBERTa: pad_token_id + 1
        self.pad_token_id = config.pad_token_id
        self.positions_from_padding = config.positions_from_padding

    def _table(self) -> Tensor:
        return self.word_embeddings.weight

    def padded_positions(self, input_ids: Tensor) -> Tensor:
        """(B, T) position ids as Hugging Face numbers a padded batch.

        BERT counts 0..T-1 whatever the padding; RoBERTa counts only non-pad tokens, from
        pad_token_id + 1, and gives pad tokens pad_token_id.
        """
        if self.positions_from_padding:
            real = input_ids.ne(self.pad_token_id).long()  # (B, T)
            return torch.cumsum(real, dim=1) * real + self.pad_token_id
        T = input_ids.shape[-1]
        return torch.arange(T, device=input_ids.device).expand_as(input_ids) + self.position_offset

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Embed ids of any shape (..., ) -> float32 (..., D); token types default to 0,
        positions to padded_positions' (unused without a position table)."""
        x = self.word_embeddings(input_ids)  # (..., D)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                x = x + self.token_type_embeddings.weight[0]
            else:
                x = x + self.token_type_embeddings(token_type_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = self.padded_positions(input_ids)
            x = x + self.position_embeddings(position_ids)
        return self.LayerNorm(x)

    def forward_packed(
        self, input_ids: Tensor, lengths: list[int], token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Packed ids (N,) of unpadded sequences -> (N, D); positions restart per sequence;
        token types (N,) for sentence pairs (None: all 0)."""
        if self.position_embeddings is None:
            return self.forward(input_ids, None, token_type_ids)  # (N, D)
        positions = packed_positions(lengths, input_ids.device) + self.position_offset  # (N,)
        return self.forward(input_ids, positions, token_type_ids)


def pool_packed(hidden: Tensor, lengths: list[int], mode: str) -> Tensor:
    """Sentence vectors (B, D) in float32 from packed token states (N, D).

    mean: average over each sequence's tokens (every packed token is real, nothing to mask);
    cls: each sequence's first token; last_token: each sequence's last token.
    """
    if mode in ("cls", "last_token"):
        lens = torch.tensor(lengths, dtype=torch.long)
        ends = torch.cumsum(lens, 0)  # (B,)
        rows = ends - lens if mode == "cls" else ends - 1
        return hidden.index_select(0, upload(rows, hidden.device)).float()  # (B, D)
    if mode != "mean":
        raise ValueError(f"pooling must be one of {POOLING_MODES}, got {mode!r}")
    if hidden.is_cuda:  # index_add_ adds with atomics on CUDA: an order that varies per run
        return segment_mean(hidden, lengths)
    seg = segment_ids(lengths, hidden.device)  # (N,)
    sums = hidden.new_zeros(len(lengths), hidden.shape[-1], dtype=torch.float32)  # (B, D)
    sums.index_add_(0, seg, hidden.float())
    counts = torch.tensor(lengths, dtype=torch.float32)  # (B,)
    return sums / counts[:, None]  # (B, D)


def segment_mean(hidden: Tensor, lengths: list[int]) -> Tensor:
    """Mean of each sequence's rows of packed hidden (N, D) -> (B, D) float32, in a fixed
    order (CUDA's pooling). `unsafe`: the lengths come from the host (each >= 1, summing to N),
    and its checks would read two values back from the device (.item()) in every batch."""
    lens = upload(torch.tensor(lengths, dtype=torch.long), hidden.device)  # (B,)
    return torch.segment_reduce(hidden.float(), "mean", lengths=lens, axis=0, unsafe=True)


def pool_padded(hidden: Tensor, attention_mask: Tensor, mode: str) -> Tensor:
    """Sentence vectors (B, D) in float32 from a padded batch (B, T, D); mask 1 = real token."""
    if mode == "cls":
        return hidden[:, 0].float()
    if mode == "last_token":  # the last real token of each row, wherever the padding is
        T = attention_mask.shape[1]
        positions = torch.arange(T, device=hidden.device).expand_as(attention_mask)  # (B, T)
        last = (positions * attention_mask.ne(0)).amax(dim=1)  # (B,)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
    if mode != "mean":
        raise ValueError(f"pooling must be one of {POOLING_MODES}, got {mode!r}")
    mask = attention_mask.to(torch.float32).unsqueeze(-1)  # (B, T, 1)
    return (hidden.float() * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1e-9)  # (B, D)


def normalize(x: Tensor, eps: float = 1e-12) -> Tensor:
    """Unit L2 norm along the last axis (what sentence-transformers' Normalize does)."""
    return F.normalize(x, p=2.0, dim=-1, eps=eps)


class TokenEmbeddings(RotaryTables):
    """embed_tokens alone (positions come from RoPE: Qwen3), times `scale` where a family sets
    one (Gemma 3); a float32 table (Float32Tables). Hugging Face's name for the table."""

    scale: float | None = None

    def __init__(self, config: TextEncoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)

    def _table(self) -> Tensor:
        return self.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        table = self.embed_tokens(input_ids)  # (..., D) float32
        return table if self.scale is None else table * self.scale

    def forward_packed(
        self, input_ids: Tensor, lengths: list[int], token_type_ids: Tensor | None = None
    ) -> Tensor:
        return self.forward(input_ids)  # (N, D)
