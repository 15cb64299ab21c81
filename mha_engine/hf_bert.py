"""Hugging Face BERT-family directories (bert, roberta, xlm-roberta, camembert, distilbert, mpnet)
in engine terms.

`engine_config` turns the HF config.json into a post-norm transformer_encoder config plus the
text fields (vocabulary, positions); `engine_state` checks every tensor under its HF name, then
fuses query/key/value into in_proj and renames the rest onto EncoderStack and TextEmbeddings.
MPNet is RoBERTa-like (positions from padding, no token types) plus a relative position bias
table shared by all layers (EncoderStack.position_bias). JinaBERT (jina-embeddings-v2: a `bert`
config with position_embedding_type `alibi`, written for its remote code) is BERT with ALiBi
instead of a position table and a GLU feed-forward (`mlp.gated_layers` rows [gate; up], `mlp.wo`,
`mlp.layernorm`); the engine names it `jina_bert`.
Heads outside the base model (pooler, MLM/classification heads) are ignored here; heads.py
loads sequence-classification heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from . import hf_jina
from .config import MultiheadAttentionConfig
from .errors import CheckpointError, check_state, positive_int
from .layouts import AttentionKeys, to_pytorch_names
from .text_config import JINA_BERT as JINA  # the engine's model_type for JinaBERT
from .text_config import TextEncoderConfig

# hidden_act -> the engine's activation; the tanh forms are the same function under two names.
ACTIVATIONS = {
    "gelu": "gelu",
    "relu": "relu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}


@dataclass(frozen=True)
class Family:
    """Where a model type keeps its config fields and layer weights."""

    fields: dict[str, str]  # engine field -> HF config field
    layers: str  # prefix of layer i, with {i}
    attention: AttentionKeys  # names inside layer i
    norm1: str
    linear1: str
    linear2: str
    norm2: str
    token_types: bool
    positions_from_padding: bool  # RoBERTa numbers positions from pad_token_id + 1
    layer_norm_eps: float = 1e-12  # when config.json has none (the family's config default)
    relative_bias: str | None = None  # MPNet: the (buckets, H) relative position bias table
    alibi: bool = False  # JinaBERT: ALiBi, no position table
    gated: bool = False  # JinaBERT: linear1 is a GLU's [gate; up] rows, without bias


BERT = Family(
    fields={
        "d_model": "hidden_size",
        "nhead": "num_attention_heads",
        "num_layers": "num_hidden_layers",
        "dim_feedforward": "intermediate_size",
        "activation": "hidden_act",
    },
    layers="encoder.layer.{i}.",
    attention=AttentionKeys(
        q="attention.self.query",
        k="attention.self.key",
        v="attention.self.value",
        out="attention.output.dense",
    ),
    norm1="attention.output.LayerNorm",
    linear1="intermediate.dense",
    linear2="output.dense",
    norm2="output.LayerNorm",
    token_types=True,
    positions_from_padding=False,
)
ROBERTA = replace(BERT, positions_from_padding=True)
DISTILBERT = Family(
    fields={
        "d_model": "dim",
        "nhead": "n_heads",
        "num_layers": "n_layers",
        "dim_feedforward": "hidden_dim",
        "activation": "activation",
    },
    layers="transformer.layer.{i}.",
    attention=AttentionKeys(
        q="attention.q_lin", k="attention.k_lin", v="attention.v_lin", out="attention.out_lin"
    ),
    norm1="sa_layer_norm",
    linear1="ffn.lin1",
    linear2="ffn.lin2",
    norm2="output_layer_norm",
    token_types=False,
    positions_from_padding=False,
)
MPNET = replace(
    ROBERTA,
    attention=AttentionKeys(
        q="attention.attn.q", k="attention.attn.k", v="attention.attn.v", out="attention.attn.o"
    ),
    norm1="attention.LayerNorm",
    token_types=False,
    relative_bias="encoder.relative_attention_bias.weight",
)
# transformers' MPNetEmbeddings number positions from a padding index fixed at 1, whatever
# config.pad_token_id says
MPNET_PADDING_IDX = 1
JINA_BERT = replace(
    BERT, linear1="mlp.gated_layers", linear2="mlp.wo", norm2="mlp.layernorm", alibi=True,
    gated=True,
)  # fmt: skip
FAMILIES = {  # by config.json's model_type
    "bert": BERT,
    "roberta": ROBERTA,
    "xlm-roberta": ROBERTA,
    "camembert": ROBERTA,  # CamemBERT is RoBERTa's architecture under its own model_type
    "distilbert": DISTILBERT,
    "mpnet": MPNET,
}
BUFFERS = ("position_ids", "token_type_ids", "alibi")  # non-persistent buffers some files carry
BIAS_KEY = "position_bias.relative_attention_bias.weight"  # EncoderStack's name for MPNet's table


def family_of(model_type: str) -> Family:
    """The Family of an engine model_type (config.json's, or `jina_bert`)."""
    return JINA_BERT if model_type == JINA else FAMILIES[model_type]


def is_hf_config(config: object) -> bool:
    """A Hugging Face config.json (has model_type) rather than an engine one (architecture)."""
    return isinstance(config, dict) and "model_type" in config and "architecture" not in config


def engine_config(config: dict) -> TextEncoderConfig:
    """HF config -> the engine's TextEncoderConfig (pooling settings at their defaults)."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise CheckpointError(
            f"model_type {model_type!r} is not a BERT-family one ({list(FAMILIES)})"
        )
    for flag in ("is_decoder", "add_cross_attention"):
        if config.get(flag):
            raise CheckpointError(f"config.{flag} is set; only encoder-only models are supported")
    position_type = config.get("position_embedding_type", "absolute")
    jina = model_type == "bert" and position_type == "alibi"
    if jina:
        model_type, family = JINA, JINA_BERT
    elif position_type != "absolute":
        raise CheckpointError(
            f"config.position_embedding_type {position_type!r} is not supported (absolute; "
            "alibi for JinaBERT's bert configs)"
        )
    c: dict = {"model_type": model_type, **(hf_jina.jina_bert_fields(config) if jina else {})}
    for field, hf_field in family.fields.items():
        if field in c:  # JinaBERT's activation comes from feed_forward_type
            continue
        if field == "activation":
            act = config.get(hf_field, "gelu")
            if act not in ACTIVATIONS:
                raise CheckpointError(
                    f"config.{hf_field} {act!r} is not supported; use one of {list(ACTIVATIONS)}"
                )
            c[field] = ACTIVATIONS[act]
        else:
            c[field] = positive_int(config, hf_field)
    if c["d_model"] % c["nhead"]:
        raise CheckpointError(
            f"hidden size {c['d_model']} is not divisible by the number of heads {c['nhead']}"
        )
    # DistilBERT hard-codes eps=1e-12 in its LayerNorms; the others read it from config.
    c["layer_norm_eps"] = float(config.get("layer_norm_eps", family.layer_norm_eps))
    c.update(norm_first=False, bias=True, final_norm=False)
    c["vocab_size"] = positive_int(config, "vocab_size")
    c["max_position_embeddings"] = positive_int(config, "max_position_embeddings")
    c["type_vocab_size"] = int(config.get("type_vocab_size", 0)) if family.token_types else 0
    pad = MPNET_PADDING_IDX if model_type == "mpnet" else config.get("pad_token_id")
    c["pad_token_id"] = pad if isinstance(pad, int) else None
    if family.relative_bias is not None:
        buckets = config.get("relative_attention_num_buckets", 32)
        if buckets != 32:  # transformers' MPNet indexes its table with 32 buckets regardless
            raise CheckpointError(
                f"config.relative_attention_num_buckets is {buckets!r}; MPNet uses 32"
            )
        c["relative_attention_num_buckets"] = buckets
    if family.positions_from_padding and c["pad_token_id"] is None:
        raise CheckpointError(f"config.pad_token_id is needed for {model_type} position ids")
    c["position_offset"] = c["pad_token_id"] + 1 if family.positions_from_padding else 0
    return TextEncoderConfig(**c)


def base_prefix(state: dict, name: str = "embeddings.word_embeddings.weight") -> str:
    """'' for a base model's keys, 'bert.' (etc.) for a model with a task head: the prefix of
    the one key ending in `name` (a base-model tensor every file of the family has)."""
    if name in state:
        return ""
    prefixes = sorted(k[: -len(name)] for k in state if k.endswith("." + name))
    if len(prefixes) != 1:
        raise CheckpointError(
            f"no {name} in the weights (found {len(state)} keys, e.g. {sorted(state)[:5]})"
        )
    return prefixes[0]


def legacy_names(key: str) -> str:
    """TF-converted checkpoints name LayerNorm parameters gamma/beta; transformers renames too."""
    if key.endswith(".gamma"):
        return key[: -len("gamma")] + "weight"
    if key.endswith(".beta"):
        return key[: -len("beta")] + "bias"
    return key


def expected_shapes(config: TextEncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every HF key (without the task prefix) the config implies, with its shape."""
    family = family_of(config.model_type)
    E, F = config.d_model, config.dim_feedforward
    shapes = {
        "embeddings.word_embeddings.weight": (config.vocab_size, E),
        "embeddings.LayerNorm.weight": (E,),
        "embeddings.LayerNorm.bias": (E,),
    }
    if not family.alibi:
        shapes["embeddings.position_embeddings.weight"] = (config.max_position_embeddings, E)
    if family.token_types and config.type_vocab_size > 0:
        shapes["embeddings.token_type_embeddings.weight"] = (config.type_vocab_size, E)
    if family.relative_bias is not None:
        shapes[family.relative_bias] = (config.relative_attention_num_buckets, config.nhead)
    a = family.attention
    for i in range(config.num_layers):
        p = family.layers.format(i=i)
        for name, rows, cols in (
            (a.q, E, E),
            (a.k, E, E),
            (a.v, E, E),
            (a.out, E, E),
            (family.linear1, 2 * F if family.gated else F, E),
            (family.linear2, E, F),
        ):
            shapes[f"{p}{name}.weight"] = (rows, cols)
            if not (family.gated and name == family.linear1):  # a GLU's gate/up has no bias
                shapes[f"{p}{name}.bias"] = (rows,)
        for norm in (family.norm1, family.norm2):
            shapes[f"{p}{norm}.weight"] = shapes[f"{p}{norm}.bias"] = (E,)
    return shapes


def engine_state(
    state: dict[str, Tensor], config: TextEncoderConfig
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(encoder state in nn.TransformerEncoder names, TextEmbeddings state) from HF weights."""
    family = family_of(config.model_type)
    prefix = base_prefix(state)
    section = family.layers.split(".", 1)[0] + "."  # 'encoder.' or 'transformer.'
    ours = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    base = {
        legacy_names(k): v
        for k, v in hf_jina.flash_names(ours).items()  # Jina's XLM-RoBERTa names, if any
        if k.startswith(("embeddings.", section)) and k.rsplit(".", 1)[-1] not in BUFFERS
    }
    check_state(base, expected_shapes(config), f"{config.model_type} config")

    dims = MultiheadAttentionConfig(config.d_model, config.nhead)
    encoder: dict[str, Tensor] = {}
    for i in range(config.num_layers):
        src, dst = family.layers.format(i=i), f"layers.{i}."
        attn, _ = to_pytorch_names(base, family.attention, dims, prefix=src, strict=False)
        encoder.update({f"{dst}self_attn.{k}": v for k, v in attn.items()})
        for name, ours in (
            (family.norm1, "norm1"),
            (family.linear1, "linear1"),
            (family.linear2, "linear2"),
            (family.norm2, "norm2"),
        ):
            for kind in ("weight", "bias"):
                if f"{src}{name}.{kind}" in base:  # checked above: only a GLU's has no bias
                    encoder[f"{dst}{ours}.{kind}"] = base[f"{src}{name}.{kind}"]
    if family.relative_bias is not None:
        encoder[BIAS_KEY] = base[family.relative_bias]
    embeddings = {  # TextEmbeddings uses HF's names under `embeddings.`
        k.removeprefix("embeddings."): v for k, v in base.items() if k.startswith("embeddings.")
    }
    return encoder, embeddings


# engine activation -> the HF name written back (gelu_new is the tanh form every family reads)
HF_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_tanh": "gelu_new"}


def hf_config(config: TextEncoderConfig) -> dict:
    """The Hugging Face config.json of a text model (inverse of engine_config)."""
    family = family_of(config.model_type)
    c: dict = {"model_type": config.model_type, "position_embedding_type": "absolute"}
    for field, hf_field in family.fields.items():
        value = getattr(config, field)
        c[hf_field] = HF_ACTIVATIONS[value] if field == "activation" else value
    if family.alibi:  # JinaBERT's own form
        c.update(hf_jina.jina_bert_config(config.activation))
    c.update(
        layer_norm_eps=config.layer_norm_eps,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        pad_token_id=config.pad_token_id,
    )
    if family.token_types:
        c["type_vocab_size"] = config.type_vocab_size
    if family.relative_bias is not None:
        c["relative_attention_num_buckets"] = config.relative_attention_num_buckets
    return c


def hf_state(
    encoder: dict[str, Tensor], embeddings: dict[str, Tensor], config: TextEncoderConfig
) -> dict[str, Tensor]:
    """HF base-model weight names from the encoder (PyTorch names) and embeddings states."""
    family, E = family_of(config.model_type), config.d_model
    a = family.attention
    out = {f"embeddings.{k}": v for k, v in embeddings.items()}
    if family.relative_bias is not None:
        out[family.relative_bias] = encoder[BIAS_KEY]
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", family.layers.format(i=i)
        in_w = encoder[f"{src}self_attn.in_proj_weight"]  # (3E, E): rows [Q; K; V]
        in_b = encoder[f"{src}self_attn.in_proj_bias"]
        for name, w, b in zip((a.q, a.k, a.v), in_w.split(E), in_b.split(E), strict=True):
            out[f"{dst}{name}.weight"], out[f"{dst}{name}.bias"] = w, b
        for ours, theirs in (
            ("self_attn.out_proj", a.out),
            ("norm1", family.norm1),
            ("linear1", family.linear1),
            ("linear2", family.linear2),
            ("norm2", family.norm2),
        ):
            for kind in ("weight", "bias"):
                if f"{src}{ours}.{kind}" in encoder:  # a GLU's linear1 has no bias
                    out[f"{dst}{theirs}.{kind}"] = encoder[f"{src}{ours}.{kind}"]
    return out
