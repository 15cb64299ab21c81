"""Hugging Face ModernBERT directories in engine terms: config.json to ModernBertEncoderConfig, the
weights (checked under their HF names) onto ModernBertStack and ModernBertEmbeddings.

Both config forms are read: transformers 5's (`layer_types`, `rope_parameters`) and the original
checkpoints' (`global_attn_every_n_layers`, `global_rope_theta`, `local_rope_theta`). What the
engine does not run is refused naming the field: biases (`attention_bias`, `mlp_bias`,
`norm_bias`; every published checkpoint has none) and RoPE scaling (hf_rope.py).
`hf_config` / `hf_state` write a loaded model back in transformers 5's form (save_model).
"""

from __future__ import annotations

from torch import Tensor

from . import hf_bert, hf_rope
from .errors import CheckpointError, check_state, positive_int
from .hf_bert import ACTIVATIONS, HF_ACTIVATIONS
from .text_config import LAYER_TYPES, ModernBertEncoderConfig

MODEL_TYPE = "modernbert"
FULL, SLIDING = LAYER_TYPES
TOKENS = "embeddings.tok_embeddings.weight"
# a layer's weights: HF's name -> ModernBertLayer's (PyTorch's names for the attention)
NAMES = (
    ("attn.Wqkv.weight", "self_attn.in_proj_weight"),  # rows [Q; K; V], as PyTorch's
    ("attn.Wo.weight", "self_attn.out_proj.weight"),
    ("attn_norm.weight", "attn_norm.weight"),
    ("mlp_norm.weight", "mlp_norm.weight"),
    ("mlp.Wi.weight", "Wi.weight"),
    ("mlp.Wo.weight", "Wo.weight"),
)


def engine_config(config: dict) -> ModernBertEncoderConfig:
    """HF ModernBERT config -> ModernBertEncoderConfig (pooling settings at their defaults)."""
    if config.get("rope_scaling"):  # transformers would merge it into both kinds
        raise CheckpointError("config.rope_scaling is not supported for ModernBERT (plain RoPE)")
    for flag in ("attention_bias", "mlp_bias", "norm_bias"):
        if config.get(flag):
            raise CheckpointError(f"config.{flag} is set; ModernBERT with biases is not supported")
    act = config.get("hidden_activation", "gelu")
    if act not in ACTIVATIONS:
        raise CheckpointError(
            f"config.hidden_activation {act!r} is not supported; use one of {list(ACTIVATIONS)}"
        )
    layers = positive_int(config, "num_hidden_layers")
    types = config.get("layer_types")
    if types is None:
        every = config.get("global_attn_every_n_layers", 3)
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise CheckpointError(
                f"config.global_attn_every_n_layers must be a positive integer, got {every!r}"
            )
        types = [SLIDING if i % every else FULL for i in range(layers)]
    if not isinstance(types, list | tuple):
        raise CheckpointError(f"config.layer_types must be a list, got {types!r}")
    window = config.get("local_attention", 128)
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise CheckpointError(f"config.local_attention must be an integer >= 2, got {window!r}")
    d_model, nhead = (
        positive_int(config, "hidden_size"),
        positive_int(config, "num_attention_heads"),
    )
    if d_model % nhead:
        raise CheckpointError(
            f"hidden size {d_model} is not divisible by the number of heads {nhead}"
        )
    pad = config.get("pad_token_id")
    return ModernBertEncoderConfig(
        model_type=MODEL_TYPE,
        d_model=d_model,
        nhead=nhead,
        num_layers=layers,
        dim_feedforward=positive_int(config, "intermediate_size"),
        activation=ACTIVATIONS[act],
        layer_norm_eps=float(config.get("norm_eps", 1e-5)),
        norm_first=True,
        bias=False,
        final_norm=True,
        vocab_size=positive_int(config, "vocab_size"),
        max_position_embeddings=config.get("max_position_embeddings", 8192),
        pad_token_id=pad if isinstance(pad, int) else None,
        layer_types=tuple(types),
        rope_theta=hf_rope.per_kind(config, FULL, "global_rope_theta", 160000.0, False)[0],
        local_rope_theta=hf_rope.per_kind(config, SLIDING, "local_rope_theta", 10000.0, False)[0],
        sliding_window=window // 2,
    )


def base_prefix(state: dict) -> str:
    """'' for a base model's keys, 'model.' for a model with a task head."""
    return hf_bert.base_prefix(state, TOKENS)


def expected_shapes(config: ModernBertEncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every HF key of the base model (without the task prefix) with its shape."""
    E, F = config.d_model, config.dim_feedforward
    shapes = {
        TOKENS: (config.vocab_size, E),
        "embeddings.norm.weight": (E,),
        "final_norm.weight": (E,),
    }
    for i in range(config.num_layers):
        p = f"layers.{i}."
        if i > 0:
            shapes[f"{p}attn_norm.weight"] = (E,)
        shapes.update({
            f"{p}attn.Wqkv.weight": (3 * E, E), f"{p}attn.Wo.weight": (E, E),
            f"{p}mlp_norm.weight": (E,), f"{p}mlp.Wi.weight": (2 * F, E),
            f"{p}mlp.Wo.weight": (E, F),
        })  # fmt: skip
    return shapes


def engine_state(
    state: dict[str, Tensor], config: ModernBertEncoderConfig
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(ModernBertStack state, ModernBertEmbeddings state) from HF weights, shapes checked."""
    prefix = base_prefix(state)
    base = {
        k[len(prefix) :]: v
        for k, v in state.items()
        if k.startswith(prefix)
        and k[len(prefix) :].startswith(("embeddings.", "layers.", "final_norm."))
    }
    check_state(base, expected_shapes(config), f"{MODEL_TYPE} config")
    encoder = {"final_norm.weight": base["final_norm.weight"]}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        for theirs, ours in NAMES:
            if f"{p}{theirs}" in base:  # layer 0 has no attn_norm
                encoder[f"{p}{ours}"] = base[f"{p}{theirs}"]
    embeddings = {
        k.removeprefix("embeddings."): v for k, v in base.items() if k.startswith("embeddings.")
    }
    return encoder, embeddings


def _every_n(types: tuple[str, ...]) -> dict:
    """global_attn_every_n_layers where the layer types follow its pattern, else nothing."""
    for every in range(1, len(types) + 1):
        if list(types) == [SLIDING if i % every else FULL for i in range(len(types))]:
            return {"global_attn_every_n_layers": every}
    return {}


def hf_config(config: ModernBertEncoderConfig) -> dict:
    """The Hugging Face config.json of a ModernBERT model (inverse of engine_config)."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["ModernBertModel"],
        "hidden_size": config.d_model,
        "num_attention_heads": config.nhead,
        "num_hidden_layers": config.num_layers,
        "intermediate_size": config.dim_feedforward,
        "hidden_activation": HF_ACTIVATIONS[config.activation],
        "norm_eps": config.layer_norm_eps,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "pad_token_id": config.pad_token_id,
        "layer_types": list(config.layer_types),
        "rope_parameters": {
            FULL: hf_rope.hf_entry(config.rope_theta, None),
            SLIDING: hf_rope.hf_entry(config.local_rope_theta, None),
        },
        "local_attention": 2 * config.sliding_window,
        # the original checkpoints' fields too, for transformers 4 (which reads only these)
        "global_rope_theta": config.rope_theta,
        "local_rope_theta": config.local_rope_theta,
        **_every_n(config.layer_types),
        "attention_bias": False,
        "mlp_bias": False,
        "norm_bias": False,
    }


def hf_state(
    encoder: dict[str, Tensor], embeddings: dict[str, Tensor], config: ModernBertEncoderConfig
) -> dict[str, Tensor]:
    """HF base-model weight names from the stack's and the embeddings' states (inverse of
    engine_state)."""
    out = {f"embeddings.{k}": v for k, v in embeddings.items()}
    out["final_norm.weight"] = encoder["final_norm.weight"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        for theirs, ours in NAMES:
            if f"{p}{ours}" in encoder:  # layer 0 has no attn_norm
                out[f"{p}{theirs}"] = encoder[f"{p}{ours}"]
    return out
