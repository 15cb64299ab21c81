"""What a text model is and which routes it answers (embedding, classifier, reranker, sparse),
as TEI's /info and the v2 metadata describe it, and a classifier's scores from its logits."""

from __future__ import annotations

import json
import weakref
from typing import Any

import numpy as np

from mha_engine import ServedClassifierModel, ServedModel, ServedTextModel

_kinds: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


def text_kind(model: Any) -> str | None:
    """embedding | classifier | reranker (one label) for a text model, else None. A worker
    front-end's ModelView (service.workers.wire) carries what its engine process answered.

    Worked out once per model object: the runtime Protocol checks call every member of the
    protocol (properties such as `precision` walk the modules), ~0.3 ms per text request."""
    try:
        return _kinds[model]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: no cache
        return _text_kind(model)
    kind = _kinds[model] = _text_kind(model)
    return kind


def _text_kind(model: Any) -> str | None:
    declared = getattr(model, "text_kind", None)  # a sparse encoder, or a worker's ModelView
    if declared is not None:
        return declared
    if isinstance(model, ServedClassifierModel):
        return model.info.kind
    if isinstance(model, ServedTextModel):
        return "embedding"
    return None


def offers(model: ServedModel, kind: str) -> bool:
    """Whether the (text) model answers the routes of `kind`: its own kind's, and /embed_sparse
    too for an embedding model with lexical weights (BGE-M3: mha_engine.LexicalEncoderModel)."""
    if model_kind(model) == kind:
        return True
    return kind == "sparse" and bool(getattr(model, "offers_sparse", False))


def model_kind(model: ServedModel) -> str:
    """embedding | classifier | reranker | sparse: which text routes the (text) model
    answers."""
    return text_kind(model) or "embedding"


def tei_model_type(model: ServedTextModel) -> dict:
    """TEI's /info model_type: {"embedding": {"pooling"}} or {"classifier" | "reranker":
    {"id2label", "label2id", "problem_type"}} (label keys as strings, as in config.json)."""
    kind = model_kind(model)
    if kind == "embedding":
        return {"embedding": {"pooling": model.pooling}}
    if kind == "sparse":  # TEI serves SPLADE as an embedding model with splade pooling
        return {"embedding": {"pooling": "splade"}}
    info = model.info
    return {
        kind: {
            "id2label": {str(i): name for i, name in info.id2label.items()},
            "label2id": info.label2id,
            "problem_type": info.problem_type,
        }
    }


def text_properties(model: ServedModel) -> dict[str, str]:
    """The text model's kind, pooling or labels (and an embedding model's vector width) for the
    v2 model metadata's properties."""
    if text_kind(model) is None:
        return {}
    details = next(iter(tei_model_type(model).values()))
    kind = model_kind(model)
    width = {"embedding_dim": str(model.embedding_dim)} if kind == "embedding" else {}
    return {"task": kind, **{k: json.dumps(v) for k, v in details.items()}, **width}


def scores(logits: np.ndarray, problem_type: str | None, raw: bool) -> np.ndarray:
    """Scores (L,) from one input's logits (L,) as transformers' text-classification pipeline
    gives them: raw logits when asked or for regression, sigmoid for one label or multi-label,
    softmax otherwise."""
    logits = np.asarray(logits, dtype=np.float64)
    if raw or problem_type == "regression":
        return logits
    if len(logits) == 1 or problem_type == "multi_label_classification":
        return 1.0 / (1.0 + np.exp(-logits))
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()
