"""Sequence-classification heads of BERT-family checkpoints (`...ForSequenceClassification`).

Every family reads its sequence's first token ([CLS] / <s>) and applies dense -> activation ->
linear to num_labels logits; only the names and the activation differ:
- bert:       bert.pooler.dense + tanh, then classifier
- roberta, xlm-roberta, mpnet: classifier.dense + tanh, then classifier.out_proj
- distilbert: pre_classifier + ReLU, then classifier
Dropout is identity at inference. `TextClassifierModel` is the encoder with such a head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .config import TextEncoderConfig
from .errors import CheckpointError, check_state
from .fused import linear
from .text_model import TextEncoderModel
from .varlen import cumulative, lengths, pad_rows

PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")


@dataclass(frozen=True)
class HeadNames:
    """Where a family keeps its head's two Linears ({base} is the base model's prefix)."""

    dense: str
    out: str
    activation: str  # tanh | relu


HEAD_NAMES = {
    "bert": HeadNames("{base}pooler.dense", "classifier", "tanh"),
    "roberta": HeadNames("classifier.dense", "classifier.out_proj", "tanh"),
    "xlm-roberta": HeadNames("classifier.dense", "classifier.out_proj", "tanh"),
    "distilbert": HeadNames("pre_classifier", "classifier", "relu"),
    "mpnet": HeadNames("classifier.dense", "classifier.out_proj", "tanh"),
}


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


def head_state(
    state: dict[str, Tensor], model_type: str, base_prefix: str, d_model: int, num_labels: int
) -> dict[str, Tensor]:
    """The head's weights under ClassificationHead's names (dense.*, out.*), shapes checked."""
    names = HEAD_NAMES[model_type]
    ours = {"dense": names.dense.format(base=base_prefix), "out": names.out}  # ours -> theirs
    shapes = {"dense": (d_model, d_model), "out": (num_labels, d_model)}
    expected = {}
    for name, theirs in ours.items():
        expected[f"{theirs}.weight"] = shapes[name]
        expected[f"{theirs}.bias"] = shapes[name][:1]
    found = {k: v for k, v in state.items() if k in expected}
    check_state(found, expected, f"{model_type} sequence-classification head")
    return {f"{name}.{kind}": found[f"{theirs}.{kind}"]
            for name, theirs in ours.items() for kind in ("weight", "bias")}  # fmt: skip


class ClassificationHead(nn.Module):
    """First-token state (B, D) -> logits (B, num_labels): dense, tanh or ReLU, linear."""

    def __init__(self, d_model: int, num_labels: int, activation: str) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, num_labels)
        self.activation = torch.tanh if activation == "tanh" else torch.relu

    def forward(self, first: Tensor) -> Tensor:
        h = self.activation(linear(self.dense, first))  # (B, D)
        return linear(self.out, h)  # (B, num_labels)


class TextClassifierModel(TextEncoderModel):
    """A BERT-family encoder with its sequence-classification head: ids in, logits out."""

    def __init__(self, config: TextEncoderConfig, info: ClassifierInfo) -> None:
        super().__init__(config)
        self.info = info
        activation = HEAD_NAMES[config.model_type].activation
        self.head = ClassificationHead(config.d_model, info.num_labels, activation)

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
        lens = torch.tensor(lengths(cu_seqlens, hidden.shape[0]), device=hidden.device)
        first = hidden.index_select(0, torch.cumsum(lens, 0) - lens)  # (B, D)
        return self.head(pad_rows(first))[: first.shape[0]].float()  # (B, num_labels)

    def classify_varlen(
        self, input_ids: list[Tensor], token_type_ids: list[Tensor] | None = None
    ) -> Tensor:
        """Logits (B, num_labels) of unpadded id sequences: a thin classify_packed wrapper."""
        lens = [int(t.shape[0]) for t in input_ids]
        types = None if token_type_ids is None else torch.cat(token_type_ids)
        return self.classify_packed(torch.cat(input_ids), cumulative(lens), types)
