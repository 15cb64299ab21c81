"""Hugging Face Llama-family directories (Llama, Mistral, Qwen2, EuroBERT: e5-mistral-7b-instruct,
SFR-Embedding-Mistral, gte-Qwen2-instruct and the rerankers built on them) in engine terms: the
same layers as Qwen3 without its per-head norms, each family with its own biases, run by Qwen3's
stack (qwen3.py); the weight names are Qwen3's (hf_qwen3.py), which transformers shares across
these families.

- llama: `attention_bias` on Q/K/V and the output projection, `mlp_bias` on the feed-forward;
- mistral: no biases; its `sliding_window` (4096 when the config names none: keys at most that
  far back) changes nothing on inputs no longer than the window, so the engine's max length is
  capped there: longer inputs are truncated as any input past the max length (where
  transformers would attend through the window instead);
- qwen2: biases on Q/K/V only; sliding-window layers (`use_sliding_window`, `layer_types`) are
  refused;
- eurobert (EuroBERT): Llama's layers and biases as a bidirectional encoder (every sequence
  attends both ways, as transformers' EuroBertModel); its own classification head is refused.
RoPE scaling of the static kinds runs (Llama 3.1's `llama3`, `linear`, `yarn`: hf_rope.py).
Refused naming the field, as for Qwen3: other activations, the RoPE kinds that change with the
input's length, a bad `is_causal`.
"""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from . import hf_qwen3
from .errors import CheckpointError, positive_int
from .heads import is_sequence_classifier
from .score_head import ScoreSpec
from .st_files import LogitScore
from .text_config import Qwen3EncoderConfig

MODEL_TYPES = ("llama", "mistral", "qwen2", "eurobert")
ARCHITECTURES = {"llama": "LlamaModel", "mistral": "MistralModel", "qwen2": "Qwen2Model",
                 "eurobert": "EuroBertModel"}  # fmt: skip
LLAMA_BIASES = ("llama", "eurobert")  # attention_bias on Q/K/V/O, mlp_bias on the feed-forward
base_prefix = hf_qwen3.base_prefix  # the same token table name


def engine_config(config: dict) -> Qwen3EncoderConfig:
    """HF Llama / Mistral / Qwen2 config -> Qwen3EncoderConfig without head norms."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
    types = config.get("layer_types") or []
    if model_type == "qwen2" and (config.get("use_sliding_window") or set(types) - {hf_qwen3.FULL}):
        raise CheckpointError(
            "config.use_sliding_window / layer_types ask for sliding-window layers; the engine "
            "runs Qwen2 with full attention only"
        )
    positions = positive_int(config, "max_position_embeddings")
    if model_type == "mistral" and config.get("sliding_window", 4096) is not None:  # its default
        positions = min(positions, positive_int(config, "sliding_window", 4096))
    llama = model_type in LLAMA_BIASES
    qkv_bias = model_type == "qwen2" or (llama and hf_qwen3.flag(config, "attention_bias"))
    hidden, heads = positive_int(config, "hidden_size"), positive_int(config, "num_attention_heads")
    encoder = {}
    if model_type == "eurobert":  # an encoder: both ways; EuroBertConfig's own eps default
        if is_sequence_classifier(config):
            raise CheckpointError(
                "EuroBertForSequenceClassification's head (dense, activation, classifier) is "
                "not supported; its base model serves embeddings"
            )
        encoder = {"causal": False, "layer_norm_eps": hf_qwen3.rms_eps(config, 1e-5)}
    return hf_qwen3.decoder_config(
        config,
        model_type,
        **encoder,
        head_dim=config.get("head_dim") or hidden // heads,
        attention_bias=qkv_bias,
        out_bias=llama and qkv_bias,
        mlp_bias=llama and hf_qwen3.flag(config, "mlp_bias"),
        head_norms=False,
        max_position_embeddings=positions,
    )


# the weights, and a classifier's or LogitScore reranker's head, are named as Qwen3's
engine_state = hf_qwen3.engine_state
hf_state = hf_qwen3.hf_state


def classifier_head(
    weights: dict[str, Tensor],
    hf_config: dict,
    config: Qwen3EncoderConfig,
    num_labels: int,
    logit_score: LogitScore | None,
) -> tuple[ScoreSpec, dict[str, Tensor]]:
    """Qwen3's score head (hf_qwen3.classifier_head); EuroBERT, an encoder, has no LM head
    for a LogitScore (its own classifier head is refused in engine_config)."""
    if config.model_type == "eurobert":
        raise CheckpointError(
            "modules.json's LogitScore scores a causal LM's logits; EuroBERT is an encoder"
        )
    return hf_qwen3.classifier_head(weights, hf_config, config, num_labels, logit_score)


def hf_config(config: Qwen3EncoderConfig) -> dict:
    """The Hugging Face config.json of a loaded Llama-family model (inverse of engine_config)."""
    out = hf_qwen3.hf_config(replace(config, model_type="qwen3"))
    del out["use_sliding_window"], out["attention_bias"]
    out.update(model_type=config.model_type, architectures=[ARCHITECTURES[config.model_type]])
    if config.model_type in LLAMA_BIASES:
        out.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
    elif config.model_type == "mistral":  # the window loaded capped the length: the same window
        out["sliding_window"] = config.max_position_embeddings
    elif config.model_type == "qwen2":
        out["use_sliding_window"] = False
    return out
