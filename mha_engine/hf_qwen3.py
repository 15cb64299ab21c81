"""Hugging Face Qwen3 directories (Qwen3-Embedding) in engine terms: config.json to
Qwen3EncoderConfig, the weights (checked under their HF names) onto Qwen3Stack and
TokenEmbeddings; `hf_config` / `hf_state` write a loaded model back (save_model).

Both config forms are read (transformers 5's `rope_parameters`, transformers 4's `rope_theta` and
`rope_scaling`: hf_rope.py). Refused naming the field: an activation other than SiLU, RoPE
scaling that changes with the input's length, sliding-window layers.
A causal-LM checkpoint (`model.` prefix, an `lm_head`) loads its base model; the head is unused,
but for a LogitScore reranker (two of its rows). `classifier_head` reads a reranker's or
classifier's head (score_head.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from . import hf_bert, hf_rope
from .errors import CheckpointError, check_state, positive_int, positive_number
from .score_head import ScoreSpec, score_state
from .st_files import LogitScore
from .text_config import LAYER_TYPES, GroupedRotaryConfig, Qwen3EncoderConfig

MODEL_TYPE = "qwen3"
TOKENS = "embed_tokens.weight"
FULL = LAYER_TYPES[0]
NORMS = ("input_layernorm", "post_attention_layernorm")  # a layer's RMSNorms (Gemma 3: four)
# a layer's other weights one to one: HF's name -> the layer's
NAMES = (
    ("self_attn.q_norm.weight", "self_attn.q_norm.weight"),
    ("self_attn.k_norm.weight", "self_attn.k_norm.weight"),
    ("self_attn.o_proj.weight", "self_attn.out_proj.weight"),
    ("self_attn.o_proj.bias", "self_attn.out_proj.bias"),
    ("mlp.down_proj.weight", "down.weight"),
    ("mlp.down_proj.bias", "down.bias"),
)
# weights stacked into one GEMM: Qwen3Layer's name <- HF's names, in row order
STACKED = (
    ("self_attn.in_proj_weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight")),
    ("self_attn.in_proj_bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                "self_attn.v_proj.bias")),
    ("gate_up.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("gate_up.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias")),
)  # fmt: skip


def rms_eps(config: dict, default: float = 1e-6) -> float:
    """config.rms_norm_eps (`default` when absent: Qwen3's and Llama's) as a positive float,
    else CheckpointError."""
    return positive_number(config, "rms_norm_eps", default)


def flag(config: dict, name: str, default: bool = False) -> bool:
    """config[name] as a bool (`default` when absent), else CheckpointError."""
    value = config.get(name, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"config.{name} must be true or false, got {value!r}")
    return value


def decoder_config(config: dict, model_type: str, **family: object) -> Qwen3EncoderConfig:
    """The fields Qwen3 and the Llama family (hf_llama.py) read alike from config.json (SiLU,
    heads, layers, RMSNorm eps, RoPE base, is_causal: transformers 5's switch to bidirectional
    attention), plus `family`'s own (head_dim, biases, head norms, position table)."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(
            f"config.hidden_act {act!r} is not supported; {model_type}'s is 'silu'"
        )
    heads = positive_int(config, "num_attention_heads")
    pad = config.get("pad_token_id")
    theta, scaling = hf_rope.single(config, 10000.0)  # Qwen3Config's and LlamaConfig's default
    fields = dict(
        model_type=model_type,
        d_model=positive_int(config, "hidden_size"),
        nhead=heads,
        num_kv_heads=positive_int(config, "num_key_value_heads", heads),
        num_layers=positive_int(config, "num_hidden_layers"),
        dim_feedforward=positive_int(config, "intermediate_size"),
        layer_norm_eps=rms_eps(config),
        norm_first=True,
        bias=False,
        final_norm=True,
        vocab_size=positive_int(config, "vocab_size"),
        pad_token_id=pad if isinstance(pad, int) else None,
        rope_theta=theta,
        rope_scaling=scaling,
        causal=flag(config, "is_causal", True),
    )
    return Qwen3EncoderConfig(**{**fields, **family})


def engine_config(config: dict) -> Qwen3EncoderConfig:
    """HF Qwen3 config -> Qwen3EncoderConfig (pooling settings at their defaults)."""
    layers = positive_int(config, "num_hidden_layers")
    types = config.get("layer_types") or [FULL] * layers
    if config.get("use_sliding_window") or any(t != FULL for t in types):
        raise CheckpointError(
            "config.use_sliding_window / layer_types ask for sliding-window layers; the engine "
            "runs Qwen3 with full attention only"
        )
    return decoder_config(
        config,
        MODEL_TYPE,
        head_dim=positive_int(config, "head_dim", 128),  # Qwen3Config's default
        attention_bias=flag(config, "attention_bias"),
        max_position_embeddings=config.get("max_position_embeddings", 32768),
    )


def base_prefix(state: dict) -> str:
    """'' for a base model's keys, 'model.' for a causal LM or a model with a task head."""
    return hf_bert.base_prefix(state, TOKENS)


def classifier_head(
    weights: dict[str, Tensor],
    hf_config: dict,
    config: GroupedRotaryConfig,
    num_labels: int,
    logit_score: LogitScore | None,
) -> tuple[ScoreSpec, dict[str, Tensor]]:
    """The head of a Qwen3ForSequenceClassification (`score`, read at the last token that is not
    padding) or of a LogitScore reranker (one LM-head row, read at the last token; Qwen3Config
    ties the head to the token table only when tie_word_embeddings says so)."""
    spec = ScoreSpec(None if logit_score else config.pad_token_id)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    prefix, D, V = base_prefix(weights), config.d_model, config.vocab_size
    return spec, score_state(weights, prefix, D, V, num_labels, logit_score, tied)


def _names(norms: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    return (*((f"{n}.weight", f"{n}.weight") for n in norms), *NAMES)


def expected_shapes(
    config: GroupedRotaryConfig, norms: tuple[str, ...] = NORMS
) -> dict[str, tuple[int, ...]]:
    """Every HF key of the base model (without the prefix) with its shape; `norms`: the names
    of a layer's RMSNorms."""
    D, F, hd = config.d_model, config.dim_feedforward, config.head_dim
    Q, KV = config.nhead * hd, config.num_kv_heads * hd
    shapes = {TOKENS: (config.vocab_size, D), "norm.weight": (D,)}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes.update({f"{p}{n}.weight": (D,) for n in norms})
        shapes.update({
            f"{p}self_attn.q_proj.weight": (Q, D), f"{p}self_attn.k_proj.weight": (KV, D),
            f"{p}self_attn.v_proj.weight": (KV, D), f"{p}self_attn.o_proj.weight": (D, Q),
            f"{p}mlp.gate_proj.weight": (F, D), f"{p}mlp.up_proj.weight": (F, D),
            f"{p}mlp.down_proj.weight": (D, F),
        })  # fmt: skip
        if config.head_norms:
            shapes.update(
                {f"{p}self_attn.q_norm.weight": (hd,), f"{p}self_attn.k_norm.weight": (hd,)}
            )
        if config.attention_bias:
            shapes.update({
                f"{p}self_attn.q_proj.bias": (Q,), f"{p}self_attn.k_proj.bias": (KV,),
                f"{p}self_attn.v_proj.bias": (KV,),
            })  # fmt: skip
        if config.out_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (D,)
        if config.mlp_bias:
            shapes.update({
                f"{p}mlp.gate_proj.bias": (F,), f"{p}mlp.up_proj.bias": (F,),
                f"{p}mlp.down_proj.bias": (D,),
            })  # fmt: skip
    return shapes


def engine_state(
    state: dict[str, Tensor], config: GroupedRotaryConfig, norms: tuple[str, ...] = NORMS
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(stack state, embeddings state) from HF weights, shapes checked (Qwen3's, or Gemma 3's
    with its `norms`)."""
    prefix = base_prefix(state)
    parts = ("embed_tokens.", "layers.", "norm.")  # not lm_head, nor a task head
    base = {
        k[len(prefix) :]: v
        for k, v in state.items()
        if k.startswith(prefix) and k[len(prefix) :].startswith(parts)
    }
    check_state(base, expected_shapes(config, norms), f"{config.model_type} config")
    encoder = stack_layers(base, config.num_layers, _names(norms), STACKED)
    return {**encoder, "norm.weight": base["norm.weight"]}, {TOKENS: base[TOKENS]}


def stack_layers(
    base: dict[str, Tensor],
    num_layers: int,
    names: tuple[tuple[str, str], ...],
    stacked: tuple[tuple[str, tuple[str, ...]], ...],
) -> dict[str, Tensor]:
    """Every layer's weights under the stack's names (`layers.{i}.`): one to one (`names`:
    HF's -> ours) and stacked along rows into one GEMM's (`stacked`: ours <- HF's, in row order),
    each only where the checkpoint has it (biases, head norms: where the family does)."""
    out = {}
    for i in range(num_layers):
        p = f"layers.{i}."
        for theirs, ours in names:
            if f"{p}{theirs}" in base:
                out[f"{p}{ours}"] = base[f"{p}{theirs}"]
        for ours, theirs in stacked:
            if f"{p}{theirs[0]}" in base:
                out[f"{p}{ours}"] = torch.cat([base[f"{p}{t}"] for t in theirs])
    return out


def unstack_layers(
    encoder: dict[str, Tensor],
    num_layers: int,
    names: tuple[tuple[str, str], ...],
    stacked: tuple[tuple[str, tuple[str, ...]], ...],
    sizes: Callable[[str, Tensor], tuple[int, ...]],
) -> dict[str, Tensor]:
    """The inverse of stack_layers: HF's names again, each stacked tensor split into
    `sizes(ours, tensor)` rows."""
    out = {}
    for i in range(num_layers):
        p = f"layers.{i}."
        for theirs, ours in names:
            if f"{p}{ours}" in encoder:
                out[f"{p}{theirs}"] = encoder[f"{p}{ours}"]
        for ours, theirs in stacked:
            if f"{p}{ours}" in encoder:
                parts = encoder[f"{p}{ours}"].split(sizes(ours, encoder[f"{p}{ours}"]))
                out.update(zip((f"{p}{t}" for t in theirs), parts, strict=True))
    return out


def rope_scaling_v4(config: Qwen3EncoderConfig) -> dict | None:
    """The scaling as transformers 4 reads it (`rope_scaling`, without the base)."""
    if config.rope_scaling is None:
        return None
    entry = hf_rope.hf_entry(config.rope_theta, config.rope_scaling)
    return {k: v for k, v in entry.items() if k != "rope_theta"}


def hf_config(config: Qwen3EncoderConfig) -> dict:
    """The Hugging Face config.json of a Qwen3 model (inverse of engine_config)."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["Qwen3Model"],
        "hidden_size": config.d_model,
        "num_attention_heads": config.nhead,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.num_layers,
        "intermediate_size": config.dim_feedforward,
        "hidden_act": "silu",
        "rms_norm_eps": config.layer_norm_eps,
        "attention_bias": config.attention_bias,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "pad_token_id": config.pad_token_id,
        "rope_parameters": hf_rope.hf_entry(config.rope_theta, config.rope_scaling),
        "rope_theta": config.rope_theta,  # transformers 4 reads this one, and rope_scaling
        "rope_scaling": rope_scaling_v4(config),
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "is_causal": config.causal,
    }


def hf_state(
    encoder: dict[str, Tensor],
    embeddings: dict[str, Tensor],
    config: GroupedRotaryConfig,
    norms: tuple[str, ...] = NORMS,
) -> dict[str, Tensor]:
    """HF base-model weight names from the stack's and the embeddings' states (inverse of
    engine_state)."""
    D, KV = config.nhead * config.head_dim, config.num_kv_heads * config.head_dim

    def sizes(ours: str, stacked: Tensor) -> tuple[int, ...]:
        return (D, KV, KV) if ours.startswith("self_attn") else (len(stacked) // 2,) * 2

    layers = unstack_layers(encoder, config.num_layers, _names(norms), STACKED, sizes)
    return {TOKENS: embeddings[TOKENS], "norm.weight": encoder["norm.weight"], **layers}
