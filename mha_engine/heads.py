"""Sequence-classification heads of BERT-family checkpoints (`...ForSequenceClassification`).

Every family pools its sequence (the first token, [CLS] / <s>; ModernBERT: the first token or
the mean, as config.classifier_pooling says) and applies dense -> activation (-> LayerNorm) ->
linear to num_labels logits; the names, the activation and the norm differ:
- bert, nomic_bert, gte: {base}.pooler.dense + tanh, then classifier
- roberta, xlm-roberta, camembert, mpnet: classifier.dense + tanh, then classifier.out_proj
- distilbert: pre_classifier + ReLU, then classifier
- modernbert: head.dense (bias if classifier_bias) + classifier_activation + head.norm, then
  classifier
Dropout is identity at inference. `TextClassifierModel` is the encoder with such a head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .errors import CheckpointError, check_state
from .fused import ACTIVATIONS, linear
from .hf_bert import ACTIVATIONS as FROM_HF
from .text import pool_packed
from .text_config import TextEncoderConfig
from .text_model import TextEncoderModel
from .varlen import cumulative, lengths, pad_rows

PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")


@dataclass(frozen=True)
class HeadNames:
    """Where a family keeps its head's two Linears ({base} is the base model's prefix)."""

    dense: str
    out: str
    activation: str  # tanh | relu (the family's; ModernBERT's comes from its config)
    norm: str | None = None  # ModernBERT: a LayerNorm after the activation


@dataclass(frozen=True)
class HeadSpec:
    """One checkpoint's head: its family's names plus what its config decides."""

    names: HeadNames
    activation: str  # tanh | relu | gelu | gelu_tanh
    pooling: str = "cls"  # cls (the first token) | mean
    dense_bias: bool = True
    norm_eps: float = 1e-5


ROBERTA_HEAD = HeadNames("classifier.dense", "classifier.out_proj", "tanh")
BERT_HEAD = HeadNames("{base}pooler.dense", "classifier", "tanh")  # the pooler, then a Linear
HEAD_NAMES = {
    "bert": BERT_HEAD,
    "roberta": ROBERTA_HEAD,
    "xlm-roberta": ROBERTA_HEAD,
    "camembert": ROBERTA_HEAD,
    "distilbert": HeadNames("pre_classifier", "classifier", "relu"),
    "mpnet": ROBERTA_HEAD,
    "jina_bert": BERT_HEAD,  # JinaBertForSequenceClassification (jina-reranker-v1)
    "modernbert": HeadNames("head.dense", "classifier", "gelu", norm="head.norm"),
    "nomic_bert": BERT_HEAD,
    "gte": BERT_HEAD,
}
CLASSIFIER_POOLING = ("cls", "mean")  # ModernBERT's config.classifier_pooling


@dataclass(frozen=True)
class ClassifierInfo:
    """What a classifier's outputs mean: label names by index and the training problem type."""

    id2label: dict[int, str]
    problem_type: str | None = None  # transformers' config.problem_type (None: inferred)

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @property
    def label2id(self) -> dict[str, int]:
        return {name: i for i, name in self.id2label.items()}

    @property
    def kind(self) -> str:
        """ "reranker" (one score per input, as cross-encoders give) or "classifier"."""
        return "reranker" if self.num_labels == 1 else "classifier"


def is_sequence_classifier(hf_config: dict) -> bool:
    """The HF config names a `...ForSequenceClassification` architecture."""
    names = hf_config.get("architectures") or []
    return any(isinstance(n, str) and n.endswith("ForSequenceClassification") for n in names)


def classifier_info(hf_config: dict) -> ClassifierInfo:
    """id2label (keys as ints, indices 0..L-1) and problem_type from an HF config.json."""
    raw = hf_config.get("id2label")
    if raw is None:
        count = hf_config.get("num_labels", 2)
        raw = {str(i): f"LABEL_{i}" for i in range(count if isinstance(count, int) else 0)}
    if not isinstance(raw, dict) or not raw:
        raise CheckpointError(f"config.id2label must be a non-empty object, got {raw!r}")
    try:
        id2label = {int(k): str(v) for k, v in raw.items()}
    except ValueError:
        raise CheckpointError(f"config.id2label keys must be integers, got {list(raw)}") from None
    if sorted(id2label) != list(range(len(id2label))):
        raise CheckpointError(f"config.id2label keys must be 0..{len(id2label) - 1}")
    problem = hf_config.get("problem_type")
    if problem is not None and problem not in PROBLEM_TYPES:
        raise CheckpointError(f"config.problem_type {problem!r} is not one of {PROBLEM_TYPES}")
    return ClassifierInfo(id2label, problem)


def default_spec(model_type: str) -> HeadSpec:
    """The family's head as its names say (every family but ModernBERT has one form)."""
    names = HEAD_NAMES[model_type]
    return HeadSpec(names, names.activation)


def head_spec(hf_config: dict, config: TextEncoderConfig) -> HeadSpec:
    """The head of this checkpoint: the family's, with ModernBERT's pooling, activation and
    dense bias read from its config (CheckpointError naming a value the engine does not run);
    its norm's eps is the encoder's."""
    names = HEAD_NAMES[config.model_type]
    if names.norm is None:
        return default_spec(config.model_type)
    pooling = hf_config.get("classifier_pooling", "cls")
    if pooling not in CLASSIFIER_POOLING:
        raise CheckpointError(
            f"config.classifier_pooling {pooling!r} is not one of {CLASSIFIER_POOLING}"
        )
    act = hf_config.get("classifier_activation", "gelu")
    if act not in FROM_HF:
        raise CheckpointError(
            f"config.classifier_activation {act!r} is not supported; use one of {list(FROM_HF)}"
        )
    bias = bool(hf_config.get("classifier_bias", False))
    return HeadSpec(names, FROM_HF[act], pooling, bias, config.layer_norm_eps)


def head_state(
    state: dict[str, Tensor],
    model_type: str,
    base_prefix: str,
    d_model: int,
    num_labels: int,
    spec: HeadSpec | None = None,
) -> dict[str, Tensor]:
    """The head's weights under ClassificationHead's names (dense.*, norm.*, out.*), shapes
    checked; spec: the checkpoint's head (head_spec), the family's by default."""
    spec = spec or default_spec(model_type)
    names = spec.names
    shapes = {  # ours -> (theirs, shape)
        "dense.weight": (names.dense, (d_model, d_model)),
        "out.weight": (names.out, (num_labels, d_model)),
        "out.bias": (names.out, (num_labels,)),
    }
    if spec.dense_bias:
        shapes["dense.bias"] = (names.dense, (d_model,))
    if names.norm is not None:
        shapes["norm.weight"] = (names.norm, (d_model,))
    theirs = {
        ours: f"{name.format(base=base_prefix)}.{ours.rsplit('.', 1)[1]}"
        for ours, (name, _) in shapes.items()
    }
    expected = {theirs[ours]: shape for ours, (_, shape) in shapes.items()}
    found = {k: v for k, v in state.items() if k in expected}
    check_state(found, expected, f"{model_type} sequence-classification head")
    return {ours: found[name] for ours, name in theirs.items()}


class ClassificationHead(nn.Module):
    """Pooled state (B, D) -> logits (B, num_labels): dense, activation, (LayerNorm,) linear."""

    def __init__(self, d_model: int, num_labels: int, spec: HeadSpec) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model, bias=spec.dense_bias)
        self.norm = (
            nn.LayerNorm(d_model, eps=spec.norm_eps, bias=False) if spec.names.norm else None
        )
        self.out = nn.Linear(d_model, num_labels)
        self.activation = torch.tanh if spec.activation == "tanh" else ACTIVATIONS[spec.activation]

    def forward(self, pooled: Tensor) -> Tensor:
        h = self.activation(linear(self.dense, pooled))  # (B, D)
        if self.norm is not None:
            h = self.norm(h)
        return linear(self.out, h)  # (B, num_labels)


class SequenceClassifier:
    """What every text classifier adds to its encoder (mixed in before it): `info`, and logits
    from the encoder's packed states: a subclass says which state (or pooled vector) each
    sequence is classified by (`_pooled`) and how its head scores it (`_scores`)."""

    info: ClassifierInfo

    def _pooled(self, hidden: Tensor, lens: list[int], input_ids: Tensor) -> Tensor:
        """(B, D) in hidden's dtype from packed states (N, D)."""
        raise NotImplementedError

    def _scores(self, pooled: Tensor) -> Tensor:
        """Logits (B', num_labels) of pooled rows (B', D)."""
        raise NotImplementedError

    @torch.inference_mode()
    def classify_packed(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor | Sequence[int],
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, num_labels) float32 of packed id sequences (N,) split at cu_seqlens;
        token_type_ids (N,) mark each pair's second text (None: all 0)."""
        hidden = self.encode_packed(input_ids, cu_seqlens, token_type_ids=token_type_ids)
        lens = lengths(cu_seqlens, hidden.shape[0])
        pooled = self._pooled(hidden, lens, input_ids)  # (B, D)
        return self._scores(pad_rows(pooled))[: len(lens)].float()  # tiny batches padded

    def classify_varlen(
        self, input_ids: list[Tensor], token_type_ids: list[Tensor] | None = None
    ) -> Tensor:
        """Logits (B, num_labels) of unpadded id sequences: a thin classify_packed wrapper."""
        lens = [int(t.shape[0]) for t in input_ids]
        types = None if token_type_ids is None else torch.cat(token_type_ids)
        return self.classify_packed(torch.cat(input_ids), cumulative(lens), types)


class TextClassifierModel(SequenceClassifier, TextEncoderModel):
    """A BERT-family encoder with its sequence-classification head: ids in, logits out."""

    def __init__(
        self, config: TextEncoderConfig, info: ClassifierInfo, spec: HeadSpec | None = None
    ) -> None:
        super().__init__(config)
        self.info = info
        self.spec = spec or default_spec(config.model_type)
        self.head = ClassificationHead(config.d_model, info.num_labels, self.spec)

    def _pooled(self, hidden: Tensor, lens: list[int], input_ids: Tensor) -> Tensor:
        return pool_packed(hidden, lens, self.spec.pooling).to(hidden.dtype)

    def _scores(self, pooled: Tensor) -> Tensor:
        return self.head(pooled)
