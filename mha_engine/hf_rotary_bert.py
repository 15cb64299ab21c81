"""Hugging Face NomicBERT and GTE directories in engine terms: config.json to RotaryBertConfig, the
weights onto RotaryBertStack and RotaryBertEmbeddings, and back (save_model).

Both forms of each load: transformers 5's own classes (`nomic_bert`, `gte`: their config fields
and weight names), and the forms the Hub's checkpoints were written in for their own code, which
transformers 5 renames the same way at load:
- nomic-embed-text: config fields `n_embd`, `n_head`, `n_layer`, `n_inner`, `n_positions`,
  `layer_norm_epsilon`, `rotary_emb_base`; weights `encoder.layers.{i}.attn.Wqkv`, `mlp.fc11`
  (up), `mlp.fc12` (gate), `mlp.fc2`, `norm1`, `norm2`, `emb_ln`;
- gte-multilingual (`model_type` `new`): weights `encoder.layer.{i}.attention.qkv_proj`,
  `attention.o_proj`, `mlp.up_gate_proj` (rows [up; gate]), `attn_ln`, `mlp_ln`, under `new.`
  in a task model.
nomic's `rotary_scaling_factor` (dynamic NTK: its code rescales RoPE when a batch runs past
`max_trained_positions`, so a sequence's numbers would depend on its batch-mates) caps the max
length at `max_trained_positions`, where the scaling never applies: exact up to there, longer
inputs truncated. gte-*-en-v1.5's `rope_scaling` {"type": "ntk"} (fixed NTK, as its remote code,
TEI and vLLM compute it; transformers 5 cannot load it) runs as the linear scaling it equals on
base rope_theta * factor, and save_model writes it in that form. Refused naming the field: what
neither transformers' classes nor the engine run (pre-norm or parallel blocks, RMSNorm, causal
attention, partial, interleaved or xPos rotary, unscaled attention, NomicBERT's biases, GTE's
mixed NTK and log-n attention scaling).
"""

from __future__ import annotations

import re

from torch import Tensor

from . import hf_bert, hf_qwen3, hf_rope, rope
from .errors import CheckpointError, check_state, positive_int, positive_number
from .text_config import RotaryBertConfig

MODEL_TYPES = ("nomic_bert", "gte", "new")  # new: GTE as its Hub checkpoints name it
ARCHITECTURES = {"nomic_bert": "NomicBertModel", "gte": "GteModel"}
TOKENS = "embeddings.word_embeddings.weight"
# RoPE scalings per family: GTE's remote code also defines fixed NTK (gte-*-en-v1.5)
ROPE_KINDS = {
    "nomic_bert": hf_rope.TRANSFORMERS_KINDS,
    "gte": (*hf_rope.TRANSFORMERS_KINDS, hf_rope.NTK),
}
HIDDEN_ACT = {"silu": "silu", "swiglu": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
              "gelu_pytorch_tanh": "gelu_tanh"}  # fmt: skip
# transformers' defaults where config.json is silent (NomicBertConfig, GteConfig)
DEFAULTS = {
    "nomic_bert": dict(vocab_size=30528, hidden_size=768, num_hidden_layers=12,
                       num_attention_heads=12, intermediate_size=3072, hidden_act="silu",
                       max_position_embeddings=2048, type_vocab_size=2, layer_norm_eps=1e-12,
                       pad_token_id=0, rope_theta=1000.0),
    "gte": dict(vocab_size=250048, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072, hidden_act="gelu", max_position_embeddings=8192,
                type_vocab_size=1, layer_norm_eps=1e-12, pad_token_id=1, rope_theta=160000.0),
}  # fmt: skip
# nomic-embed-text's own config fields (GPT-2's names) -> transformers'
NOMIC_FIELDS = {"hidden_size": "n_embd", "num_attention_heads": "n_head",
                "num_hidden_layers": "n_layer", "intermediate_size": "n_inner",
                "max_position_embeddings": "n_positions", "layer_norm_eps": "layer_norm_epsilon",
                "hidden_act": "activation_function", "rope_theta": "rotary_emb_base"}  # fmt: skip
# fields of those forms that change the computation, and the value the engine runs
REQUIRED = {
    "nomic_bert": {"prenorm": False, "parallel_block": False, "use_rms_norm": False,
                   "causal": False, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
                   "qkv_proj_bias": False, "mlp_fc1_bias": False, "rotary_emb_scale_base": None,
                   "scale_attn_weights": True,
                   "mlp_fc2_bias": False},
    "gte": {"position_embedding_type": "rope", "layer_norm_type": "layer_norm",
            "logn_attention_scale": False, "logn_attention_clip1": False},
}  # fmt: skip
NAMES = (  # a layer's weights: HF's name -> RotaryBertLayer's
    ("self_attn.o_proj.weight", "self_attn.out_proj.weight"),
    ("self_attn.o_proj.bias", "self_attn.out_proj.bias"),
    ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
    ("post_attention_layernorm.bias", "post_attention_layernorm.bias"),
    ("mlp.down_proj.weight", "down.weight"),
    ("mlp.down_proj.bias", "down.bias"),
    ("post_mlp_layernorm.weight", "post_mlp_layernorm.weight"),
    ("post_mlp_layernorm.bias", "post_mlp_layernorm.bias"),
)
STACKED = (  # stacked into one GEMM: ours <- HF's, in row order
    ("self_attn.in_proj_weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight")),
    ("self_attn.in_proj_bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                "self_attn.v_proj.bias")),
    ("gate_up.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
)  # fmt: skip
# the Hub forms' names -> transformers' (regex on a key without the base prefix)
RENAMES = (
    (r"^emb_ln\.", "embeddings.LayerNorm."),
    (r"^encoder\.layers?\.(\d+)\.", r"layers.\1."),
    (r"\.attn\.out_proj\.", ".self_attn.o_proj."),
    (r"\.attention\.o_proj\.", ".self_attn.o_proj."),
    (r"\.mlp\.fc11\.", ".mlp.up_proj."),
    (r"\.mlp\.fc12\.", ".mlp.gate_proj."),
    (r"\.mlp\.fc2\.", ".mlp.down_proj."),
    (r"\.(norm1|attn_ln)\.", ".post_attention_layernorm."),
    (r"\.(norm2|mlp_ln)\.", ".post_mlp_layernorm."),
)
SPLITS = (  # fused Hub tensors -> transformers' parts (equal chunks along rows)
    (".attn.Wqkv.", (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.")),
    (".attention.qkv_proj.", (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.")),
    (".mlp.up_gate_proj.", (".mlp.up_proj.", ".mlp.gate_proj.")),
)


def family(config: dict) -> str:
    """'nomic_bert' or 'gte' (the Hub's `new`)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
    return "gte" if model_type == "new" else model_type


def engine_config(config: dict) -> RotaryBertConfig:
    """HF NomicBERT / GTE config (either form) -> RotaryBertConfig."""
    kind = family(config)
    for name, value in REQUIRED[kind].items():
        if config.get(name, value) != value:
            raise CheckpointError(
                f"config.{name} is {config[name]!r}; the engine runs {kind} with {value!r}"
            )
    fields = dict(DEFAULTS[kind])
    if kind == "nomic_bert":  # the Hub form's names where transformers' are absent
        fields.update({k: config[o] for k, o in NOMIC_FIELDS.items() if config.get(o) is not None})
    fields.update({k: config[k] for k in DEFAULTS[kind] if config.get(k) is not None})
    act = fields["hidden_act"]
    if not isinstance(act, str) or act not in HIDDEN_ACT:
        raise CheckpointError(
            f"config.hidden_act {act!r} is not supported; use one of {list(HIDDEN_ACT)}"
        )
    theta, scaling = hf_rope.single(
        {**config, "rope_theta": fields["rope_theta"]}, 0.0, ROPE_KINDS[kind]
    )
    heads = positive_int(fields, "num_attention_heads")
    hidden = positive_int(fields, "hidden_size")
    pad = fields["pad_token_id"]
    types = fields["type_vocab_size"]
    if isinstance(types, bool) or not isinstance(types, int) or types < 0:
        raise CheckpointError(f"config.type_vocab_size must be an integer >= 0, got {types!r}")
    positions = positive_int(fields, "max_position_embeddings")
    if kind == "nomic_bert" and config.get("rotary_scaling_factor"):  # dynamic NTK past training
        positions = min(positions, positive_int(config, "max_trained_positions", 2048))
    gte = kind == "gte"
    return RotaryBertConfig(
        model_type=kind,
        d_model=hidden,
        nhead=heads,
        num_kv_heads=heads,
        head_dim=positive_int(config, "head_dim", hidden // heads),
        num_layers=positive_int(fields, "num_hidden_layers"),
        dim_feedforward=positive_int(fields, "intermediate_size"),
        activation=HIDDEN_ACT[act],
        layer_norm_eps=positive_number(fields, "layer_norm_eps"),
        norm_first=False,
        vocab_size=positive_int(fields, "vocab_size"),
        max_position_embeddings=positions,
        type_vocab_size=types,
        pad_token_id=pad if isinstance(pad, int) else None,
        rope_theta=theta,
        rope_scaling=scaling,
        head_norms=False,
        attention_bias=gte,
        down_bias=gte,
    )


def base_prefix(state: dict) -> str:
    """'' for a base model's keys, 'nomic_bert.' / 'gte.' / 'new.' for a model with a head."""
    return hf_bert.base_prefix(state, TOKENS)


def _transformers_names(base: dict[str, Tensor]) -> dict[str, Tensor]:
    """Base-model keys in transformers' names, whichever form they came in."""
    out: dict[str, Tensor] = {}
    for key, value in base.items():
        for old, new in RENAMES:
            key = re.sub(old, new, key)
        for fused, parts in SPLITS:
            if fused in key:
                chunks = value.chunk(len(parts))
                out.update((key.replace(fused, p), c) for p, c in zip(parts, chunks, strict=True))
                break
        else:
            out[key] = value
    return out


def expected_shapes(config: RotaryBertConfig) -> dict[str, tuple[int, ...]]:
    """Every transformers key of the base model (without the prefix) with its shape."""
    D, F, Q = config.d_model, config.dim_feedforward, config.nhead * config.head_dim
    shapes = {TOKENS: (config.vocab_size, D), "embeddings.LayerNorm.weight": (D,),
              "embeddings.LayerNorm.bias": (D,)}  # fmt: skip
    if config.type_vocab_size:
        shapes["embeddings.token_type_embeddings.weight"] = (config.type_vocab_size, D)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v"):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (Q, D)
            if config.attention_bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (Q,)
        shapes[f"{p}self_attn.o_proj.weight"] = (D, Q)
        if config.attention_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (D,)
        for norm in ("post_attention_layernorm", "post_mlp_layernorm"):
            shapes.update({f"{p}{norm}.weight": (D,), f"{p}{norm}.bias": (D,)})
        shapes.update({f"{p}mlp.gate_proj.weight": (F, D), f"{p}mlp.up_proj.weight": (F, D),
                       f"{p}mlp.down_proj.weight": (D, F)})  # fmt: skip
        if config.down_bias:
            shapes[f"{p}mlp.down_proj.bias"] = (D,)
    return shapes


def engine_state(
    state: dict[str, Tensor], config: RotaryBertConfig
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(RotaryBertStack state, RotaryBertEmbeddings state) from HF weights, shapes checked."""
    prefix = base_prefix(state)
    parts = ("embeddings.", "emb_ln.", "layers.", "encoder.")  # not the pooler, nor a head
    base = _transformers_names({
        k[len(prefix):]: v for k, v in state.items()
        if k.startswith(prefix) and k[len(prefix):].startswith(parts)
        and not k.endswith(("inv_freq", "position_ids"))  # buffers some Hub files hold
    })  # fmt: skip
    check_state(base, expected_shapes(config), f"{config.model_type} config")
    encoder = hf_qwen3.stack_layers(base, config.num_layers, NAMES, STACKED)
    embeddings = {k[len("embeddings.") :]: v for k, v in base.items() if k.startswith("embed")}
    return encoder, embeddings


def hf_config(config: RotaryBertConfig) -> dict:
    """transformers 5's config.json of a loaded model (inverse of engine_config)."""
    act = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[config.activation]
    return {
        "model_type": config.model_type,
        "architectures": [ARCHITECTURES[config.model_type]],
        "hidden_size": config.d_model,
        "num_attention_heads": config.nhead,
        "num_hidden_layers": config.num_layers,
        "intermediate_size": config.dim_feedforward,
        "hidden_act": act,
        "layer_norm_eps": config.layer_norm_eps,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "type_vocab_size": config.type_vocab_size,
        "pad_token_id": config.pad_token_id,
        "head_dim": config.head_dim,
        "rope_parameters": hf_rope.hf_entry(  # fixed NTK as the linear scaling it equals
            *rope.transformers_form(config.rope_theta, config.rope_scaling, config.head_dim)
        ),
    }


def hf_state(
    encoder: dict[str, Tensor], embeddings: dict[str, Tensor], config: RotaryBertConfig
) -> dict[str, Tensor]:
    """transformers' base-model weight names from the stack's and the embeddings' states."""
    Q, F = config.nhead * config.head_dim, config.dim_feedforward

    def sizes(ours: str, stacked: Tensor) -> tuple[int, ...]:
        return (Q, Q, Q) if ours.startswith("self_attn") else (F, F)

    layers = hf_qwen3.unstack_layers(encoder, config.num_layers, NAMES, STACKED, sizes)
    return {**{f"embeddings.{k}": v for k, v in embeddings.items()}, **layers}
