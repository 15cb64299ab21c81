"""SPLADE sparse encoders: a BERT-family encoder with its masked-language-model head, pooled as
sentence-transformers' SparseEncoder does (MLMTransformer + SpladePooling): per token, the
vocabulary logits through log(1 + relu(.)); per sequence, their maximum over its tokens. One
weight per vocabulary entry, almost all zero: what TEI answers at /embed_sparse.

The head is the checkpoint's `...ForMaskedLM` one (dense -> activation -> LayerNorm -> decoder
to the vocabulary, the decoder's weight tied to the word embeddings when the file leaves it
out); names per family:
- bert:       cls.predictions.transform.dense / .LayerNorm, cls.predictions.decoder (+ bias)
- roberta, xlm-roberta, camembert, mpnet: lm_head.dense / lm_head.layer_norm, lm_head.decoder
  (+ lm_head.bias)
- distilbert: vocab_transform / vocab_layer_norm, vocab_projector
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .devices import upload
from .errors import CheckpointError, check_state
from .fused import linear
from .hf_bert import legacy_names
from .text_config import TextEncoderConfig
from .text_model import TextEncoderModel
from .varlen import cumulative, lengths

# Tokens whose vocabulary logits are made at once: (TOKEN_CHUNK, V) float32 is 61 MiB at
# BERT's V=30522 (488 MiB at XLM-R's 250,002), whatever the batch.
TOKEN_CHUNK = 512


@dataclass(frozen=True)
class MlmNames:
    """Where a family keeps its MLM head (transform dense, its LayerNorm, the decoder)."""

    dense: str
    norm: str
    decoder: str
    bias: str  # the decoder's bias (some files keep it only here)
    gelu: bool = False  # exact GELU whatever the encoder's activation (else the encoder's)


# transformers' RobertaLMHead (and MPNetLMHead): always GELU
ROBERTA_MLM = MlmNames(
    "lm_head.dense", "lm_head.layer_norm", "lm_head.decoder", "lm_head.bias", gelu=True
)
MLM_NAMES = {
    "bert": MlmNames(
        "cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
        "cls.predictions.decoder", "cls.predictions.bias",
    ),
    "roberta": ROBERTA_MLM,
    "xlm-roberta": ROBERTA_MLM,
    "camembert": ROBERTA_MLM,
    "distilbert": MlmNames(
        "vocab_transform", "vocab_layer_norm", "vocab_projector", "vocab_projector.bias"
    ),
    "mpnet": ROBERTA_MLM,
}  # fmt: skip


def is_masked_lm(hf_config: dict) -> bool:
    """The HF config names a `...ForMaskedLM` architecture."""
    names = hf_config.get("architectures") or []
    return any(isinstance(n, str) and n.endswith("ForMaskedLM") for n in names)


def mlm_head_state(state: dict[str, Tensor], config: TextEncoderConfig) -> dict[str, Tensor]:
    """The MLM head's weights under MaskedLMHead's names, shapes checked; the decoder's weight
    is the word embeddings' when the file ties them (leaves it out)."""
    names = MLM_NAMES[config.model_type]
    state = {legacy_names(k): v for k, v in state.items()}
    E, V = config.d_model, config.vocab_size
    expected = {
        f"{names.dense}.weight": (E, E), f"{names.dense}.bias": (E,),
        f"{names.norm}.weight": (E,), f"{names.norm}.bias": (E,),
    }  # fmt: skip
    found = {k: v for k, v in state.items() if k in expected}
    check_state(found, expected, f"{config.model_type} masked-LM head")
    bias = state.get(f"{names.decoder}.bias", state.get(names.bias))
    if bias is None or tuple(bias.shape) != (V,):
        raise CheckpointError(
            f"{config.model_type} masked-LM head: no decoder bias of shape ({V},) "
            f"({names.decoder}.bias or {names.bias})"
        )
    weight = state.get(f"{names.decoder}.weight")
    if weight is None:  # tied to the word embeddings, as save_pretrained writes it
        weight = next(v for k, v in state.items() if k.endswith("word_embeddings.weight"))
    if tuple(weight.shape) != (V, E):
        raise CheckpointError(f"masked-LM decoder weight is {tuple(weight.shape)}, want {(V, E)}")
    return {
        "dense.weight": found[f"{names.dense}.weight"], "dense.bias": found[f"{names.dense}.bias"],
        "norm.weight": found[f"{names.norm}.weight"], "norm.bias": found[f"{names.norm}.bias"],
        "decoder.weight": weight, "decoder.bias": bias,
    }  # fmt: skip


class MaskedLMHead(nn.Module):
    """Token states (N, D) -> vocabulary logits (N, V): dense, activation, LayerNorm, decoder."""

    def __init__(self, config: TextEncoderConfig) -> None:
        super().__init__()
        D = config.d_model
        self.dense = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(D, config.vocab_size)
        gelu = MLM_NAMES[config.model_type].gelu
        self.activation = "gelu" if gelu else config.activation

    def forward(self, states: Tensor) -> Tensor:
        h = linear(self.dense, states, self.activation)  # (N, D)
        h = F.layer_norm(h, h.shape[-1:], self.norm.weight, self.norm.bias, self.norm.eps)
        return linear(self.decoder, h)  # (N, V)


class SparseEncoderModel(TextEncoderModel):
    """A BERT-family encoder with its MLM head, pooled as SPLADE: ids in, a weight per
    vocabulary entry out."""

    text_kind = "sparse"

    def __init__(self, config: TextEncoderConfig) -> None:
        super().__init__(config)
        self.head = MaskedLMHead(config)

    @torch.inference_mode()
    def sparse_embed_packed(self, input_ids: Tensor, cu_seqlens: Tensor | Sequence[int]) -> Tensor:
        """SPLADE weights (B, V) float32 of packed id sequences (N,) split at cu_seqlens: per
        sequence, the maximum over its tokens of log(1 + relu(logits)), computed as
        log1p(max(0, max logits)), the same numbers (log1p and relu never decrease) in one pass
        over (B, V). The logits are made TOKEN_CHUNK tokens at a time; a token's row never
        depends on the others, and a maximum is exact in any order, so the weights never depend
        on the batch."""
        lens = lengths(cu_seqlens, input_ids.shape[0])  # host, before the forward is queued
        owner = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))  # (N,)
        owner = upload(owner, self.device)  # each token's sequence
        states = self.encode_packed(input_ids, cu_seqlens)  # (N, D)
        best = torch.zeros(len(lens), self.vocab_size, device=states.device)  # (B, V): max(0, .)
        for start in range(0, states.shape[0], TOKEN_CHUNK):
            logits = self.head(states[start : start + TOKEN_CHUNK]).float()  # (n, V)
            index = owner[start : start + logits.shape[0], None].expand_as(logits)
            best.scatter_reduce_(0, index, logits, reduce="amax")
        return best.log1p_()

    def sparse_embed_varlen(self, input_ids: list[Tensor]) -> Tensor:
        """SPLADE weights (B, V) of unpadded id sequences: a thin sparse_embed_packed wrapper."""
        lens = [int(t.shape[0]) for t in input_ids]
        return self.sparse_embed_packed(torch.cat(input_ids), cumulative(lens))
