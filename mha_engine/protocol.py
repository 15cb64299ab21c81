"""What the service needs of a loaded model: the ServedModel and ServedTextModel protocols.

The service depends on these, not on the engine's classes, so any object with this surface
(MultiheadAttentionModel, TransformerEncoderModel, TextEncoderModel, TextClassifierModel, a
quantized variant) serves. Decoder models (TransformerDecoderModel, TransformerModel) share the
attributes but take PyTorch's argument names in forward_packed / attention_weights (tgt,
memory, src); the service calls them by `architecture` (service.oip.decoder_inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from .config import EngineConfig


@runtime_checkable
class ServedModel(Protocol):
    """A model the service runs: typed config, hidden-state calls and introspection."""

    architecture: str
    config: EngineConfig  # the one source of dimensions (service limits read it)

    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def precision(self) -> str:
        """float32 | bfloat16 | float16 | int8: the name metadata and metrics show."""
        ...

    @property
    def embed_dim(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def kdim(self) -> int: ...
    @property
    def vdim(self) -> int: ...
    @property
    def is_cross_attention_capable(self) -> bool: ...

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
        """Outputs (N, E) of packed sequences split at cu_seqlens; batch invariant by default."""
        ...

    def forward_varlen(
        self,
        query: list[Tensor],
        key: list[Tensor] | None = None,
        value: list[Tensor] | None = None,
        key_padding_mask: list[Tensor | None] | None = None,
        is_causal: list[bool] | bool = False,
    ) -> list[Tensor]:
        """Outputs (T_i, E) of sequences of different lengths, batch invariant."""
        ...

    def attention_weights(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Output and attention probabilities (see the model classes for the arguments)."""
        ...

    def head_importance(self) -> list[dict[str, Any]]: ...

    def diagnostics(self, batch_size: int = 1, seq_len: int = 128) -> dict[str, Any]: ...


@runtime_checkable
class ServedTextModel(ServedModel, Protocol):
    """A text encoder: token ids in, sentence vectors out (/v1/embeddings)."""

    @property
    def max_seq_len(self) -> int: ...
    @property
    def embedding_dim(self) -> int:
        """A sentence vector's width (d_model, or the last Dense module's out_features)."""
        ...

    def embed_packed(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        pooling: str | None = None,
        normalize: bool | None = None,
    ) -> Tensor:
        """Sentence vectors (B, D) float32 of packed id sequences (N,) split at cu_seqlens."""
        ...

    def embed_varlen(
        self, input_ids: list[Tensor], pooling: str | None = None, normalize: bool | None = None
    ) -> Tensor:
        """Sentence vectors (B, D) float32 of unpadded id sequences (T_i,)."""
        ...

    def encode_packed(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        bucket_padding: float = 0.0,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Token states (N, D) of packed id sequences (N,) split at cu_seqlens (/embed_all)."""
        ...


@runtime_checkable
class ServedClassifierModel(ServedTextModel, Protocol):
    """A text encoder with a sequence-classification head (/predict, /rerank)."""

    info: Any  # heads.ClassifierInfo: id2label, label2id, problem_type, kind

    def classify_packed(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, num_labels) float32 of packed id sequences (pairs: token types 1)."""
        ...


@runtime_checkable
class ServedSparseModel(ServedTextModel, Protocol):
    """A sparse encoder (/embed_sparse): SPLADE (`text_kind` "sparse"), or an embedding model
    with lexical weights (BGE-M3: `offers_sparse`)."""

    text_kind: str

    def sparse_embed_packed(self, input_ids: Tensor, cu_seqlens: Tensor | Sequence[int]) -> Tensor:
        """SPLADE weights (B, vocab_size) float32 of packed id sequences."""
        ...
