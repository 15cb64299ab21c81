"""Hugging Face Llama-family directories (Llama, Mistral, Qwen2: e5-mistral-7b-instruct,
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
  refused.
Refused naming the field, as for Qwen3: other activations, RoPE scaling (Llama 3's `llama3`
type among them), a bad `is_causal`.
"""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from . import hf_qwen3
from .errors import CheckpointError, positive_int
from .score_head import ScoreSpec
from .st_files import LogitScore
from .text_config import Qwen3EncoderConfig

MODEL_TYPES = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"llama": "LlamaModel", "mistral": "MistralModel", "qwen2": "Qwen2Model"}
base_prefix = hf_qwen3.base_prefix  # the same token table name


def engine_config(config: dict) -> Qwen3EncoderConfig:
    """HF Llama / Mistral / Qwen2 config -> Qwen3EncoderConfig without head norms."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(
            f"config.hidden_act {act!r} is not supported; {model_type}'s is 'silu'"
        )
    types = config.get("layer_types") or []
    if model_type == "qwen2" and (config.get("use_sliding_window") or set(types) - {hf_qwen3.FULL}):
        raise CheckpointError(
            "config.use_sliding_window / layer_types ask for sliding-window layers; the engine "
            "runs Qwen2 with full attention only"
        )
    causal = config.get("is_causal", True)  # transformers 5: False turns attention bidirectional
    if not isinstance(causal, bool):
        raise CheckpointError(f"config.is_causal must be true or false, got {causal!r}")
    heads = positive_int(config, "num_attention_heads")
    hidden = positive_int(config, "hidden_size")
    positions = positive_int(config, "max_position_embeddings")
    window = config.get("sliding_window", 4096) if model_type == "mistral" else None  # its default
    if window is not None:
        positions = min(positions, positive_int({"sliding_window": window}, "sliding_window"))
    llama = model_type == "llama"
    qkv_bias = model_type == "qwen2" or (llama and _flag(config, "attention_bias"))
    pad = config.get("pad_token_id")
    return Qwen3EncoderConfig(
        model_type=model_type,
        d_model=hidden,
        nhead=heads,
        num_kv_heads=positive_int(config, "num_key_value_heads", heads),
        head_dim=config.get("head_dim") or hidden // heads,
        num_layers=positive_int(config, "num_hidden_layers"),
        dim_feedforward=positive_int(config, "intermediate_size"),
        layer_norm_eps=hf_qwen3.rms_eps(config),
        norm_first=True,
        bias=False,
        final_norm=True,
        attention_bias=qkv_bias,
        out_bias=llama and qkv_bias,
        mlp_bias=llama and _flag(config, "mlp_bias"),
        head_norms=False,
        vocab_size=positive_int(config, "vocab_size"),
        max_position_embeddings=positions,
        pad_token_id=pad if isinstance(pad, int) else None,
        rope_theta=hf_qwen3.rope_theta(config),
        causal=causal,
    )


def _flag(config: dict, name: str) -> bool:
    """config[name] (default false) as a bool, else CheckpointError."""
    value = config.get(name, False)
    if not isinstance(value, bool):
        raise CheckpointError(f"config.{name} must be true or false, got {value!r}")
    return value


def engine_state(
    state: dict[str, Tensor], config: Qwen3EncoderConfig
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(stack state, embeddings state) from HF weights, shapes checked."""
    return hf_qwen3.engine_state(state, config)


def classifier_head(
    weights: dict[str, Tensor],
    hf_config: dict,
    config: Qwen3EncoderConfig,
    num_labels: int,
    logit_score: LogitScore | None,
) -> tuple[ScoreSpec, dict[str, Tensor]]:
    """`...ForSequenceClassification`'s score, or a LogitScore reranker's LM-head row (as
    Qwen3's: hf_qwen3.classifier_head)."""
    return hf_qwen3.classifier_head(weights, hf_config, config, num_labels, logit_score)


def hf_config(config: Qwen3EncoderConfig) -> dict:
    """The Hugging Face config.json of a loaded Llama-family model (inverse of engine_config)."""
    out = hf_qwen3.hf_config(replace(config, model_type="qwen3"))
    del out["use_sliding_window"], out["attention_bias"]
    out.update(model_type=config.model_type, architectures=[ARCHITECTURES[config.model_type]])
    if config.model_type == "llama":
        out.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
    elif config.model_type == "mistral":  # the window loaded capped the length: the same window
        out["sliding_window"] = config.max_position_embeddings
    else:
        out["use_sliding_window"] = False
    return out


def hf_state(
    encoder: dict[str, Tensor], embeddings: dict[str, Tensor], config: Qwen3EncoderConfig
) -> dict[str, Tensor]:
    """HF base-model weight names (inverse of engine_state)."""
    return hf_qwen3.hf_state(encoder, embeddings, config)
