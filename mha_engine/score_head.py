"""Scores of decoder families read at one token, for their rerankers and classifiers.

Two checkpoint forms give the same head, a Linear without bias on one token's final state:
- transformers' `...ForSequenceClassification` (Qwen3-Reranker-seq-cls and its fine-tunes): its
  `score` weight (num_labels, D), read at each sequence's last token that is not the pad token
  (transformers' rule, which skips a trailing pad-id token);
- sentence-transformers' LogitScore over a causal LM (Qwen/Qwen3-Reranker-*): the logit of the
  "yes" token minus that of "no" at the last token, one row `lm_head[yes] - lm_head[no]` (the
  conversion vLLM and the seq-cls checkpoints use); with no "no" token, the "yes" row alone.
`ScoreClassifierModel` adds it to a family's encoder: ids in, logits out, like
`heads.TextClassifierModel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .devices import upload
from .errors import CheckpointError
from .fused import linear
from .heads import ClassifierInfo, SequenceClassifier
from .st_files import LogitScore
from .text import segment_ids
from .text_model import TextEncoderModel

RERANKER_INFO = ClassifierInfo({0: "LABEL_0"})  # one score, as TEI names a reranker's label


@dataclass(frozen=True)
class ScoreSpec:
    """Which token a sequence is scored at: the last that is not `pad_token_id` (transformers'
    sequence classifiers), or the last (None: LogitScore, as sentence-transformers reads it)."""

    pad_token_id: int | None = None


def score_state(
    weights: dict[str, Tensor],
    base_prefix: str,
    d_model: int,
    vocab_size: int,
    num_labels: int,
    logit_score: LogitScore | None,
    tied: bool = False,
) -> dict[str, Tensor]:
    """The head's weight {"weight": (num_labels, D)}: a classifier's `score.weight`, or one row
    from the LM head for LogitScore (the token table when `tied`, config.tie_word_embeddings, as
    transformers ties them), the difference taken in float32."""
    if logit_score is None:
        weight = weights.get("score.weight")
        if weight is None or tuple(weight.shape) != (num_labels, d_model):
            found = None if weight is None else tuple(weight.shape)
            raise CheckpointError(
                f"the sequence-classification head needs score.weight of shape "
                f"{(num_labels, d_model)}, found {found}"
            )
        return {"weight": weight}
    name = f"{base_prefix}embed_tokens.weight" if tied else "lm_head.weight"
    table = weights.get(name)
    if table is None or tuple(table.shape) != (vocab_size, d_model):
        raise CheckpointError(
            f"LogitScore reads the LM head: {name} (the LM head, tied to the token table: "
            f"{tied}) of shape {(vocab_size, d_model)} is missing or of another shape"
        )
    ids = [logit_score.true_token_id, logit_score.false_token_id]
    for name, i in zip(("true_token_id", "false_token_id"), ids, strict=True):
        if i is not None and not 0 <= i < vocab_size:
            raise CheckpointError(
                f"LogitScore's {name} {i} is outside the vocabulary of {vocab_size} tokens"
            )
    row = table[ids[0]].float()
    if ids[1] is not None:
        row = row - table[ids[1]].float()
    return {"weight": row[None]}  # (1, D)


def scored_rows(input_ids: Tensor, lens: list[int], pad_token_id: int | None) -> Tensor:
    """Each packed sequence's scored row (B,): its last token, or its last token that is not
    `pad_token_id` (its first when every token is; transformers reads position 0 then)."""
    ends = torch.tensor(lens, dtype=torch.long).cumsum(0)  # (B,)
    if pad_token_id is None:
        return ends - 1
    device = input_ids.device
    rows = torch.arange(input_ids.shape[0], device=device)  # (N,)
    real = torch.where(input_ids != pad_token_id, rows, -1)  # (N,)
    best = torch.full((len(lens),), -1, dtype=torch.long, device=device)
    best.scatter_reduce_(0, segment_ids(lens, device), real, "amax")  # (B,)
    starts = upload(ends - torch.tensor(lens), device)  # (B,), built on the host
    return torch.where(best >= 0, best, starts)


class ScoreClassifierModel(SequenceClassifier, TextEncoderModel):
    """An encoder with a score head read at one token (set `stack_class` and
    `embeddings_class` as the family's encoder does): ids in, logits (B, num_labels) out."""

    def __init__(self, config, info: ClassifierInfo, spec: ScoreSpec | None = None) -> None:
        super().__init__(config)
        self.info = info
        self.spec = spec or ScoreSpec()
        self.head = nn.Linear(config.d_model, info.num_labels, bias=False)

    def _pooled(self, hidden: Tensor, lens: list[int], input_ids: Tensor) -> Tensor:
        rows = scored_rows(input_ids, lens, self.spec.pad_token_id)  # (B,), where the ids are
        rows = rows if rows.device == hidden.device else upload(rows, hidden.device)
        return hidden.index_select(0, rows)  # (B, D)

    def _scores(self, pooled: Tensor) -> Tensor:
        return linear(self.head, pooled)
