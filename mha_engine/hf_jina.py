"""Jina's own checkpoint forms, written for its remote code, in the terms hf_bert reads:

- JinaBERT (jina-embeddings-v2, jina-reranker-v1): a `bert` config with position_embedding_type
  `alibi`; its fields (the GLU's activation from feed_forward_type) and the config written back;
- Jina's XLM-RoBERTa code (`XLMRobertaFlashConfig`: jina-reranker-v2-base-multilingual): a
  config.json with no model_type, and weights named for flash-attention modules
  (`emb_ln`, `encoder.layers.{i}.mixer.Wqkv` rows [q; k; v], `mixer.out_proj`, `norm1`,
  `mlp.fc1`, `mlp.fc2`, `norm2`), which compute XLM-RoBERTa itself: read as `xlm-roberta` with
  transformers' names. Its rotary, LoRA-adapted form (jina-embeddings-v3) is refused.
"""

from __future__ import annotations

import re

from torch import Tensor

from .errors import CheckpointError

# JinaBERT's feed_forward_type -> the activation on the gate (its code: nn.GELU(), exact; ReLU)
FEED_FORWARD = {"geglu": "gelu", "reglu": "relu"}
CODE = "jinaai/jina-bert-implementation--"  # JinaBERT's remote code, as its auto_map names it
AUTO_MAP = {
    "AutoConfig": CODE + "configuration_bert.JinaBertConfig",
    "AutoModel": CODE + "modeling_bert.JinaBertModel",
    "AutoModelForSequenceClassification": CODE + "modeling_bert.JinaBertForSequenceClassification",
}
FLASH_CONFIG = "XLMRobertaFlashConfig"  # Jina's XLM-RoBERTa code's config class
FLASH_RENAMES = (  # Jina's XLM-RoBERTa names -> transformers' (on a key without its prefix)
    (r"^emb_ln\.", "embeddings.LayerNorm."),
    (r"^encoder\.layers\.(\d+)\.", r"encoder.layer.\1."),
    (r"\.mixer\.out_proj\.", ".attention.output.dense."),
    (r"\.norm1\.", ".attention.output.LayerNorm."),
    (r"\.mlp\.fc1\.", ".intermediate.dense."),
    (r"\.mlp\.fc2\.", ".output.dense."),
    (r"\.norm2\.", ".output.LayerNorm."),
)
FLASH_QKV = ".mixer.Wqkv."
QKV = (".attention.self.query.", ".attention.self.key.", ".attention.self.value.")


def _code_names(config: dict) -> list[str]:
    """The remote code config.json names: _name_or_path and auto_map's entries."""
    auto_map = config.get("auto_map")
    names = [str(config.get("_name_or_path", ""))]
    return names + (list(map(str, auto_map.values())) if isinstance(auto_map, dict) else [])


def jina_bert_fields(config: dict) -> dict:
    """JinaBERT's engine fields beyond BERT's, its variants refused naming the field."""
    if any("qk-post-norm" in name for name in _code_names(config)):
        raise CheckpointError(
            "jina-bert-v2-qk-post-norm (jina-embeddings-v2-base-code) is not supported: its "
            "layers add LayerNorms on queries and keys and a second residual"
        )
    kind = config.get("feed_forward_type", "original")
    if kind not in FEED_FORWARD:
        raise CheckpointError(
            f"config.feed_forward_type {kind!r} is not supported with ALiBi (JinaBERT's "
            f"{list(FEED_FORWARD)})"
        )
    return {"activation": FEED_FORWARD[kind], "alibi": True, "gated_ffn": True}


def jina_bert_config(activation: str) -> dict:
    """The fields save_model writes for JinaBERT, as its Hub files (and its code) read them."""
    gate = {v: k for k, v in FEED_FORWARD.items()}[activation]
    return {"model_type": "bert", "position_embedding_type": "alibi", "hidden_act": "gelu",
            "feed_forward_type": gate, "architectures": ["JinaBertModel"],
            "auto_map": AUTO_MAP}  # fmt: skip


def with_model_type(config: dict) -> dict:
    """config.json as hf_bert reads it: one of Jina's XLM-RoBERTa code (no model_type, its
    auto_map naming XLMRobertaFlashConfig) as `xlm-roberta`; any other unchanged."""
    if "model_type" in config or not any(FLASH_CONFIG in n for n in _code_names(config)):
        return config
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(
            f"config.position_embedding_type {config['position_embedding_type']!r}: Jina's "
            "rotary XLM-RoBERTa (jina-embeddings-v3, with LoRA task adapters) is not supported"
        )
    for name in ("lora_adaptations", "load_trained_adapters"):
        if config.get(name):
            raise CheckpointError(f"config.{name} is set: LoRA task adapters are not supported")
    return {**config, "model_type": "xlm-roberta"}


def flash_names(base: dict[str, Tensor]) -> dict[str, Tensor]:
    """Base-model weights (keys without their prefix) in transformers' XLM-RoBERTa names: Jina's
    flash names renamed and Wqkv split into query, key and value; other keys unchanged."""
    out: dict[str, Tensor] = {}
    for key, value in base.items():
        for old, new in FLASH_RENAMES:
            key = re.sub(old, new, key)
        if FLASH_QKV in key:
            if value.shape[0] % 3:
                raise CheckpointError(f"{key} has {value.shape[0]} rows, not 3 equal parts")
            chunks = value.chunk(3)
            out.update((key.replace(FLASH_QKV, p), c) for p, c in zip(QKV, chunks, strict=True))
        else:
            out[key] = value
    return out
