"""Text encoder models: a transformer_encoder that also takes token ids and gives sentence vectors.

The hidden-state API ([B, T, D] + padding mask, forward_varlen) is TransformerEncoderModel's,
unchanged; `encode` / `encode_varlen` put the embeddings layer in front and `embed_varlen` adds
pooling and normalisation behind, as sentence-transformers configures them for the directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from .devices import upload
from .fused import linear
from .models import TransformerEncoderModel
from .text import TextEmbeddings, normalize, pool_packed, pool_padded
from .text_config import POOLING_MODES, DenseConfig, TextEncoderConfig
from .varlen import cumulative, lengths

DENSE_FUNCTIONS = {  # text_config.DENSE_ACTIVATIONS -> the function
    "tanh": torch.tanh, "identity": lambda x: x, "relu": torch.relu,
    "gelu": torch.nn.functional.gelu, "sigmoid": torch.sigmoid,
}  # fmt: skip


class TextEncoderModel(TransformerEncoderModel):
    """A BERT-family encoder: transformer_encoder tensor API plus token ids in, vectors out.

    Submodules: `embeddings` (`embeddings_class`: TextEmbeddings, float32) and `encoder`
    (`stack_class`: EncoderStack); ModernBertModel swaps in its own two.
    """

    embeddings_class: type[nn.Module] = TextEmbeddings  # ModernBERT's for its models

    def __init__(self, config: TextEncoderConfig) -> None:
        super().__init__(config)
        self.embeddings = self.embeddings_class(config)
        self.dense = nn.ModuleList(SentenceDense(c) for c in config.dense)  # after pooling

    model_type = property(lambda self: self.config.model_type)
    max_seq_len = property(lambda self: self.config.max_seq_len)
    pooling = property(lambda self: self.config.pooling)
    normalize = property(lambda self: self.config.normalize)
    vocab_size = property(lambda self: self.config.vocab_size)
    embedding_dim = property(
        lambda self: self.config.embedding_dim, doc="a sentence vector's width"
    )

    def set_pooling(self, mode: str) -> None:
        """Pool sentence vectors this way (mean | cls | last_token) from now on, instead of as
        the directory's 1_Pooling says (TEI's --pooling)."""
        if mode not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {POOLING_MODES}, got {mode!r}")
        self.config = replace(self.config, pooling=mode)

    def _check_ids(self, ids: Tensor, what: str) -> Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{what} must be int64 or int32, got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"{what} holds ids outside [0, {self.vocab_size})")
        return _to_model(ids, self.device)

    def _check_types(self, types: Tensor, ids: Tensor) -> Tensor:
        table = self.config.type_vocab_size
        if types.shape != ids.shape:
            raise ValueError(f"token_type_ids {tuple(types.shape)} != ids {tuple(ids.shape)}")
        if table and types.numel() and (int(types.min()) < 0 or int(types.max()) >= table):
            raise ValueError(f"token_type_ids hold types outside [0, {table})")
        return _to_model(types, self.device)

    @torch.inference_mode()
    def encode(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Last hidden state (B, T, D) of a padded (B, T) batch, like Hugging Face's BertModel.

        attention_mask is 1 for real tokens, 0 for padding (padded rows are computed too).
        """
        ids = self._check_ids(input_ids, "input_ids")  # (B, T)
        if ids.shape[-1] > self.max_seq_len:
            raise ValueError(f"sequence length {ids.shape[-1]} > max_seq_len {self.max_seq_len}")
        types = None if token_type_ids is None else token_type_ids.to(self.device).long()
        positions = self.embeddings.padded_positions(ids)  # (B, T)
        x = self.embeddings(ids, positions, types).to(self.dtype)  # (B, T, D)
        kpm = None if attention_mask is None else attention_mask.to(self.device) == 0  # (B, T)
        return self._run(x, None, kpm, False, keep_weights=False)[0]

    @torch.inference_mode()
    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """The embeddings layer's output (B, T, D) for unpadded (B, T) ids (token type 0): the
        hidden states that `__call__`, `attention_weights` and the tensor API take."""
        ids = self._check_ids(input_ids, "input_ids")  # (B, T)
        if ids.shape[-1] > self.max_seq_len:
            raise ValueError(f"sequence length {ids.shape[-1]} > max_seq_len {self.max_seq_len}")
        positions = self.embeddings.padded_positions(ids)  # (B, T)
        return self.embeddings(ids, positions).to(self.dtype)  # (B, T, D)

    @torch.inference_mode()
    def encode_packed(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        bucket_padding: float = 0.0,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Token states (N, D) of packed unpadded id sequences (N,) split at cu_seqlens (B+1,);
        token_type_ids (N,) mark a pair's second segment (None: all 0)."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be packed (tokens,), got {tuple(input_ids.shape)}")
        lens = lengths(cu_seqlens, input_ids.shape[0])
        if not lens or min(lens) < 1:
            raise ValueError("every sequence needs at least one token")
        if max(lens) > self.max_seq_len:
            raise ValueError(f"sequence length {max(lens)} > max_seq_len {self.max_seq_len}")
        ids = self._check_ids(input_ids, "input_ids")  # (N,)
        types = None if token_type_ids is None else self._check_types(token_type_ids, ids)
        x = self.embeddings.forward_packed(ids, lens, types).to(self.dtype)  # (N, D)
        return self._encode(x, lens, None, False, bucket_padding)  # (N, D)

    @torch.inference_mode()
    def embed_packed(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        pooling: str | None = None,
        normalize: bool | None = None,
    ) -> Tensor:
        """Sentence vectors (B, embedding_dim) in float32: encode, pool, Dense modules, normalise
        (pooling and normalisation default to the model's)."""
        out = self.encode_packed(input_ids, cu_seqlens)  # (N, D)
        pooled = pool_packed(out, lengths(cu_seqlens, out.shape[0]), pooling or self.pooling)
        return self._vectors(pooled, normalize)  # (B, embedding_dim)

    def encode_varlen(self, input_ids: list[Tensor]) -> list[Tensor]:
        """Token states (T_i, D) of unpadded id sequences (T_i,): a thin encode_packed wrapper."""
        lens = [int(t.shape[0]) for t in input_ids]
        return list(self.encode_packed(_cat_ids(input_ids), cumulative(lens)).split(lens))

    def embed_varlen(
        self, input_ids: list[Tensor], pooling: str | None = None, normalize: bool | None = None
    ) -> Tensor:
        """Sentence vectors (B, embedding_dim) of unpadded id sequences: an embed_packed wrapper."""
        lens = [int(t.shape[0]) for t in input_ids]
        return self.embed_packed(_cat_ids(input_ids), cumulative(lens), pooling, normalize)

    @torch.inference_mode()
    def embed(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Sentence vectors (B, embedding_dim) in float32 from a padded batch (padding excluded)."""
        hidden = self.encode(input_ids, attention_mask)  # (B, T, D)
        return self._vectors(pool_padded(hidden, attention_mask, self.pooling), None)

    def _vectors(self, pooled: Tensor, normalize: bool | None) -> Tensor:
        """Pooled (B, D) float32 through the Dense modules, then normalised if asked (None:
        as the model's files say)."""
        for dense in self.dense:
            pooled = dense(pooled)  # (B, out_features)
        return _normalize_if(pooled, self.normalize if normalize is None else normalize)


class SentenceDense(nn.Module):
    """sentence-transformers' Dense module on pooled vectors: activation(linear(x)), float32 out
    (its Linear in whatever dtype it was assigned; `linear` pads tiny batches, so a vector's bits
    never depend on how many share its call)."""

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.linear = nn.Linear(config.in_features, config.out_features, bias=config.bias)
        self.activation = DENSE_FUNCTIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        weight = getattr(self.linear, "weight", None)  # an Int8Linear takes float32 as it is
        x = x if weight is None else x.to(weight.dtype)
        return self.activation(linear(self.linear, x)).float()


def _cat_ids(input_ids: list[Tensor]) -> Tensor:
    if not input_ids:
        raise ValueError("every sequence needs at least one token")
    return torch.cat(input_ids)


def _normalize_if(x: Tensor, flag: bool) -> Tensor:
    return normalize(x) if flag else x


def _to_model(ids: Tensor, device: torch.device) -> Tensor:
    """Checked ids as int64 on the model's device; host ids go up without blocking."""
    ids = ids.to(torch.long)
    return upload(ids, device) if ids.device.type == "cpu" else ids.to(device)
