"""Hugging Face Gemma 3 text directories (EmbeddingGemma: `model_type` `gemma3_text` with
`use_bidirectional_attention`) in engine terms: config.json to Gemma3EncoderConfig, the weights
onto Gemma3Stack and Gemma3Embeddings (Qwen3's names plus two more norms per layer: hf_qwen3's
mapping), and back (save_model).

Both config forms are read (transformers 5's `layer_types` / `rope_parameters`, the earlier
`sliding_window_pattern` / `rope_theta` / `rope_local_base_freq`). Refused naming the field:
causal Gemma 3 (a generative model), logit soft-capping, a query scale other than head_dim's,
RoPE scaling on the sliding layers (the full layers' static kinds run: hf_rope.py).
"""

from __future__ import annotations

from torch import Tensor

from . import hf_qwen3, hf_rope
from .errors import CheckpointError, positive_int
from .hf_bert import ACTIVATIONS, HF_ACTIVATIONS
from .text_config import LAYER_TYPES, Gemma3EncoderConfig

MODEL_TYPE = "gemma3_text"
FULL, SLIDING = LAYER_TYPES
NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
base_prefix = hf_qwen3.base_prefix  # the same token table name
TANH_GELU = "gelu_pytorch_tanh"  # Gemma's name: F.gelu(approximate="tanh"), the engine's kernel
# WINDOW: a bidirectional config.json's sliding_window w becomes w // 2 + 1 in transformers'
# config object (Gemma3TextConfig), and its mask keeps |query - key| < w // 2 + 1: keys at most
# w // 2 away, as ModernBERT's local_attention. EmbeddingGemma's 512: 256 each way.


def engine_config(config: dict) -> Gemma3EncoderConfig:
    """HF Gemma 3 text config -> Gemma3EncoderConfig (pooling settings at their defaults)."""
    if not config.get("use_bidirectional_attention"):
        raise CheckpointError(
            "config.use_bidirectional_attention is not set: a causal Gemma 3 is a generative "
            "model; the engine runs Gemma 3 as an encoder (EmbeddingGemma)"
        )
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(name) is not None:
            raise CheckpointError(f"config.{name} is set; soft-capping is not supported")
    act = config.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise CheckpointError(
            f"config.hidden_activation {act!r} is not supported; use one of {list(ACTIVATIONS)}"
        )
    layers = positive_int(config, "num_hidden_layers")
    heads = positive_int(config, "num_attention_heads")
    head_dim = positive_int(config, "head_dim", 256)
    scalar = config.get("query_pre_attn_scalar", 256)  # Gemma3TextConfig's default
    if scalar != head_dim:
        raise CheckpointError(
            f"config.query_pre_attn_scalar {scalar!r} is not head_dim "
            f"{head_dim}; the engine scales queries by head_dim ** -0.5 only"
        )
    types = config.get("layer_types")
    if types is None:
        every = positive_int(config, "sliding_window_pattern", 6)
        types = [FULL if (i + 1) % every == 0 else SLIDING for i in range(layers)]
    if not isinstance(types, list | tuple):
        raise CheckpointError(f"config.layer_types must be a list, got {types!r}")
    window = config.get("sliding_window", 512)
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise CheckpointError(f"config.sliding_window must be an integer >= 2, got {window!r}")
    pad = config.get("pad_token_id")
    full = hf_rope.per_kind(config, FULL, "rope_theta", 1000000.0, True)  # legacy scaling: here
    return Gemma3EncoderConfig(
        model_type=MODEL_TYPE,
        d_model=positive_int(config, "hidden_size"),
        nhead=heads,
        num_kv_heads=positive_int(config, "num_key_value_heads", heads),
        head_dim=head_dim,
        num_layers=layers,
        dim_feedforward=positive_int(config, "intermediate_size"),
        activation=ACTIVATIONS[act],
        layer_norm_eps=hf_qwen3.rms_eps(config),
        norm_first=True,
        bias=False,
        final_norm=True,
        attention_bias=bool(config.get("attention_bias", False)),
        vocab_size=positive_int(config, "vocab_size"),
        max_position_embeddings=config.get("max_position_embeddings", 131072),
        pad_token_id=pad if isinstance(pad, int) else None,
        layer_types=tuple(types),
        rope_theta=full[0],
        rope_scaling=full[1],
        local_rope_theta=hf_rope.per_kind(config, SLIDING, "rope_local_base_freq", 1e4, False)[0],
        sliding_window=window // 2,  # see WINDOW
    )


def engine_state(
    state: dict[str, Tensor], config: Gemma3EncoderConfig
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(Gemma3Stack state, Gemma3Embeddings state) from HF weights, shapes checked."""
    return hf_qwen3.engine_state(state, config, NORMS)


def hf_config(config: Gemma3EncoderConfig) -> dict:
    """The Hugging Face config.json of a Gemma 3 encoder (inverse of engine_config)."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["Gemma3TextModel"],
        "hidden_size": config.d_model,
        "num_attention_heads": config.nhead,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "query_pre_attn_scalar": config.head_dim,
        "num_hidden_layers": config.num_layers,
        "intermediate_size": config.dim_feedforward,
        "hidden_activation": {**HF_ACTIVATIONS, "gelu_tanh": TANH_GELU}[config.activation],
        "rms_norm_eps": config.layer_norm_eps,
        "attention_bias": config.attention_bias,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "pad_token_id": config.pad_token_id,
        "layer_types": list(config.layer_types),
        "sliding_window": 2 * config.sliding_window,
        "rope_parameters": {
            FULL: hf_rope.hf_entry(config.rope_theta, config.rope_scaling),
            SLIDING: hf_rope.hf_entry(config.local_rope_theta, None),
        },
        "use_bidirectional_attention": True,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    }


def hf_state(
    encoder: dict[str, Tensor], embeddings: dict[str, Tensor], config: Gemma3EncoderConfig
) -> dict[str, Tensor]:
    """HF base-model weight names from the stack's and the embeddings' states."""
    return hf_qwen3.hf_state(encoder, embeddings, config, NORMS)
