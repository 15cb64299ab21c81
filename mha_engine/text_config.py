"""Frozen, typed configs of the text models (config.py's conventions): the BERT-family encoder
with its embeddings and pooling settings, sentence-transformers' Dense modules after pooling, and
the families with their own stacks (ModernBERT, Qwen3, Gemma 3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

from .config import TransformerEncoderConfig, check_flag, check_positive, known_fields
from .errors import CheckpointError

POOLING_MODES = ("mean", "cls", "last_token")
LAYER_TYPES = ("full_attention", "sliding_attention")  # attention per layer (ModernBERT, Gemma 3)
# Relative position buckets the engine runs (MPNet's, mha_engine.position_bias); 0: none.
RELATIVE_BUCKETS = (0, 32)
DENSE_ACTIVATIONS = ("tanh", "identity", "relu", "gelu", "sigmoid")  # after a Dense module
JINA_BERT = "jina_bert"  # the engine's model_type for JinaBERT (ALiBi and a GLU; hf_jina.py)
# RoPE scalings the engine runs (rope_parameters' rope_type besides "default"): the static ones;
# ntk only where a family's own code defines it (GTE's gte-*-en-v1.5)
ROPE_SCALINGS = ("linear", "llama3", "yarn", "ntk")


@dataclass(frozen=True)
class RopeScaling:
    """Static RoPE scaling as transformers computes it: `linear` divides every frequency by
    factor; `llama3` (Llama 3.1 and later) divides the low ones, keeps the high ones and smooths
    between; `yarn` blends divided and original frequencies by dimension and scales cos/sin by
    attention_factor; `ntk` (fixed NTK, GTE's remote code) multiplies the base by factor and
    divides every frequency by factor^(2 / head_dim). The kinds that change with the input's
    length (dynamic, longrope) are not here: a sequence's numbers would depend on its
    batch-mates."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int = 0  # llama3, yarn: the pre-training length
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # yarn: cos/sin scale (from factor, mscale at load)
    truncate: bool = True  # yarn: whole dimensions bound the ramp

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALINGS:
            raise CheckpointError(
                f"RoPE scaling rope_type must be one of {ROPE_SCALINGS}, got {self.rope_type!r}"
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                     "attention_factor"):  # fmt: skip
            _check_theta(f"rope_parameters.{name}", getattr(self, name))
        check_flag("truncate", self.truncate)
        if self.rope_type not in ("linear", "ntk"):  # the others read the pre-training length
            length = self.original_max_position_embeddings
            check_positive("original_max_position_embeddings", length)
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise CheckpointError(
                "config.rope_parameters.high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


@dataclass(frozen=True)
class DenseConfig:
    """sentence-transformers' Dense module after pooling: activation(linear(vector))."""

    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "tanh"

    def __post_init__(self) -> None:
        check_positive("in_features", self.in_features)
        check_positive("out_features", self.out_features)
        check_flag("bias", self.bias)
        if self.activation not in DENSE_ACTIVATIONS:
            raise CheckpointError(
                f"a Dense module's activation must be one of {DENSE_ACTIVATIONS}, got "
                f"{self.activation!r}"
            )


@dataclass(frozen=True, kw_only=True)
class TextEncoderConfig(TransformerEncoderConfig):
    """A BERT-family text encoder: the post-norm encoder plus embeddings and pooling settings."""

    model_type: str  # bert | roberta | xlm-roberta | camembert | distilbert | mpnet | jina_bert
    # | modernbert | qwen3 | llama | mistral | qwen2 | gemma3_text | nomic_bert | gte
    vocab_size: int
    max_position_embeddings: int
    type_vocab_size: int = 0  # 0: no token-type table (DistilBERT, MPNet)
    pad_token_id: int | None = None
    position_offset: int = 0  # RoBERTa-like (positions from padding): pad_token_id + 1
    relative_attention_num_buckets: int = 0  # MPNet: 32 (a relative position bias)
    alibi: bool = False  # JinaBERT: ALiBi score biases instead of a position table
    gated_ffn: bool = False  # JinaBERT: a GLU feed-forward (linear1 gives [gate; up])
    pooling: str = "mean"  # mean | cls | last_token
    normalize: bool = False
    max_seq_len: int = 0  # 0: as many tokens as the position table holds
    dense: tuple[DenseConfig, ...] = ()  # sentence-transformers' Dense modules, in order

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("vocab_size", "max_position_embeddings"):
            check_positive(name, getattr(self, name))
        if self.pooling not in POOLING_MODES:
            raise CheckpointError(f"pooling must be one of {POOLING_MODES}, got {self.pooling!r}")
        if self.positions_from_padding and self.pad_token_id is None:
            raise CheckpointError(
                f"config.pad_token_id is needed for {self.model_type} position ids"
            )
        check_flag("alibi", self.alibi)
        check_flag("gated_ffn", self.gated_ffn)
        jina = self.model_type == JINA_BERT  # hf_bert reads JinaBERT's weight names by it
        if self.alibi != jina or self.gated_ffn != jina:
            raise CheckpointError(
                f"alibi and gated_ffn are JinaBERT's (model_type {JINA_BERT!r}) and go together; "
                f"got model_type {self.model_type!r}, alibi {self.alibi}, gated_ffn "
                f"{self.gated_ffn}"
            )
        if self.relative_attention_num_buckets not in RELATIVE_BUCKETS:
            raise CheckpointError(
                "relative_attention_num_buckets must be 32 (MPNet's) or 0 (none), got "
                f"{self.relative_attention_num_buckets!r}"
            )
        dense = tuple(d if isinstance(d, DenseConfig) else DenseConfig(**d) for d in self.dense)
        object.__setattr__(self, "dense", dense)
        width = self.d_model
        for i, d in enumerate(dense):
            if d.in_features != width:
                raise CheckpointError(
                    f"Dense module {i} takes {d.in_features} features, but gets {width} (the "
                    f"{'pooled vector' if i == 0 else 'previous Dense module'}'s width)"
                )
            width = d.out_features
        table = self.max_position_embeddings - self.position_offset
        if table < 1:
            raise CheckpointError("max_position_embeddings leaves no positions after the offset")
        length = table if self.max_seq_len == 0 else min(table, self.max_seq_len)
        object.__setattr__(self, "max_seq_len", check_positive("max_seq_len", length))

    @property
    def embedding_dim(self) -> int:
        """The width of a sentence vector: d_model, or the last Dense module's out_features."""
        return self.dense[-1].out_features if self.dense else self.d_model

    @property
    def positions_from_padding(self) -> bool:
        """Position ids count only non-pad tokens, from pad_token_id + 1 (RoBERTa, XLM-R,
        CamemBERT, MPNet: the families hf_bert maps with an offset; BERT's is 0)."""
        return self.position_offset > 0

    @classmethod
    def from_dict(cls, data: dict) -> TextEncoderConfig:
        """From to_dict's output (the Hugging Face form is read by hf_bert.engine_config)."""
        base = TransformerEncoderConfig.from_dict(data)
        return cls(**{**asdict(base), **known_fields(cls, data)})


@dataclass(frozen=True, kw_only=True)
class ModernBertEncoderConfig(TextEncoderConfig):
    """ModernBERT: pre-norm rotary layers without biases, each attending to every key
    ("full_attention") or to those within sliding_window positions ("sliding_attention")."""

    layer_types: tuple[str, ...]
    rope_theta: float = 160000.0  # full-attention layers' RoPE base
    local_rope_theta: float = 10000.0  # sliding layers'
    sliding_window: int = 64  # half of HF's local_attention

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_layer_types(self)
        for name in ("rope_theta", "local_rope_theta"):
            _check_theta(name, getattr(self, name))
        check_positive("sliding_window", self.sliding_window)


def _check_theta(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise CheckpointError(f"config.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class GroupedRotaryConfig(TextEncoderConfig):
    """What the decoder-derived families share (Qwen3, the Llama family, Gemma 3): nhead query
    heads and num_kv_heads key/value heads of head_dim each (nhead * head_dim need not be
    d_model), a norm over each query and key head (not in the Llama family), RoPE with base
    rope_theta, optional projection biases."""

    head_dim: int
    num_kv_heads: int
    rope_theta: float = 10000.0  # transformers' default (the checkpoints set their own)
    attention_bias: bool = False  # biases on the Q/K/V projections (and the output's: out_bias)
    out_bias: bool | None = None  # the output projection's bias; None: as attention_bias
    mlp_bias: bool = False  # biases on the feed-forward's projections (Llama's mlp_bias)
    head_norms: bool = True  # an RMSNorm over each query and key head (Qwen3, Gemma 3)
    rope_scaling: RopeScaling | None = None  # the full-attention layers' (None: plain RoPE)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise CheckpointError(f"config.head_dim must be even (RoPE), got {self.head_dim}")
        if check_positive("num_kv_heads", self.num_kv_heads) > self.nhead or (
            self.nhead % self.num_kv_heads
        ):
            raise CheckpointError(
                f"config.num_attention_heads {self.nhead} must be a multiple of "
                f"config.num_key_value_heads {self.num_kv_heads}"
            )
        check_flag("attention_bias", self.attention_bias)
        if self.out_bias is None:
            object.__setattr__(self, "out_bias", self.attention_bias)
        for name in ("out_bias", "mlp_bias", "head_norms"):
            check_flag(name, getattr(self, name))
        _check_theta("rope_theta", self.rope_theta)
        scaling = self.rope_scaling
        if isinstance(scaling, dict):  # from to_dict's output
            if not {"rope_type", "factor"} <= scaling.keys():
                raise CheckpointError(f"rope_scaling needs rope_type and factor, got {scaling!r}")
            scaling = RopeScaling(**known_fields(RopeScaling, scaling))
            object.__setattr__(self, "rope_scaling", scaling)
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise CheckpointError(f"rope_scaling must be a RopeScaling or None, got {scaling!r}")
        if scaling is not None and scaling.rope_type == "yarn" and self.rope_theta == 1:
            raise CheckpointError("config.rope_theta must not be 1 with YaRN (log(base) divides)")


@dataclass(frozen=True, kw_only=True)
class Qwen3EncoderConfig(GroupedRotaryConfig):
    """Qwen3 (Qwen3-Embedding) and the Llama family (Llama, Mistral, Qwen2: no per-head norms,
    their own biases) as encoders: pre-RMSNorm layers with RoPE, grouped-query attention
    (GroupedRotaryConfig), causal unless `causal` is False (config.json's is_causal), and a
    SwiGLU feed-forward; model_type says which."""

    activations: ClassVar[tuple[str, ...]] = ("silu",)  # SwiGLU's gate

    activation: str = "silu"
    causal: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flag("causal", self.causal)


@dataclass(frozen=True, kw_only=True)
class RotaryBertConfig(GroupedRotaryConfig):
    """BERT with rotary positions (NomicBERT: nomic-embed-text; GTE: gte-multilingual-base and
    its reranker): post-norm layers (LayerNorm after each residual sum), multi-head attention
    with RoPE and no position table, a gated feed-forward down(act(gate(x)) * up(x)) with a
    bias on `down` only where down_bias; model_type says which."""

    activations: ClassVar[tuple[str, ...]] = ("silu", "gelu", "gelu_tanh")

    activation: str = "silu"  # NomicBERT's SwiGLU; GTE's "gelu"
    down_bias: bool = False  # GTE's down projection has one; nothing else in the MLP does

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flag("down_bias", self.down_bias)
        if self.num_kv_heads != self.nhead or self.head_norms or self.norm_first:
            raise CheckpointError(
                f"{self.model_type}: multi-head attention (num_kv_heads = nhead), no head "
                "norms, post-norm layers"
            )


@dataclass(frozen=True, kw_only=True)
class Gemma3EncoderConfig(GroupedRotaryConfig):
    """Gemma 3 as a bidirectional encoder (EmbeddingGemma): each layer's attention and
    feed-forward between two RMSNorms, grouped-query attention (GroupedRotaryConfig), full
    layers (RoPE base rope_theta) and sliding ones attending to keys at most sliding_window
    positions away (RoPE base local_rope_theta), a GeGLU feed-forward."""

    layer_types: tuple[str, ...]
    activation: str = "gelu_tanh"
    local_rope_theta: float = 10000.0
    sliding_window: int = 256  # half of config.json's sliding_window (see hf_gemma3)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_layer_types(self)
        _check_theta("local_rope_theta", self.local_rope_theta)
        check_positive("sliding_window", self.sliding_window)


def _check_layer_types(config: TextEncoderConfig) -> None:
    """layer_types as a tuple naming every layer, each one of LAYER_TYPES."""
    types = tuple(config.layer_types)
    object.__setattr__(config, "layer_types", types)
    if len(types) != config.num_layers or not set(types) <= set(LAYER_TYPES):
        raise CheckpointError(
            f"config.layer_types must name {config.num_layers} layers, each one of "
            f"{LAYER_TYPES}, got {list(types)}"
        )
