"""Frozen, typed model configs: the one source of every dimension, read from and written to JSON.

Field names are PyTorch's (nn.MultiheadAttention, nn.TransformerEncoderLayer). Construction
validates, raising CheckpointError naming the field, so a config object is always usable;
`from_dict` fills PyTorch's defaults from a config.json object and `to_dict` writes one back.
The text models' configs build on these in text_config.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from .errors import CheckpointError

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")


def check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"config.{name} must be a positive integer, got {value!r}")
    return value


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise CheckpointError(f"config.{name} must be true or false, got {value!r}")
    return value


def known_fields(cls: type, data: dict) -> dict[str, Any]:
    """The entries of `data` that are fields of `cls`, with None meaning 'use the default'."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names and v is not None}


def _layer_fields(cls: type, data: object) -> dict[str, Any]:
    """A transformer config.json object's known fields, flags and eps coerced, d_model/nhead/
    dim_feedforward required (PyTorch's defaults for the rest come from the dataclass)."""
    data = _check_architecture(cls, data)
    for name in ("d_model", "nhead", "dim_feedforward"):
        check_positive(name, data.get(name))
    known = known_fields(cls, data)
    for name in ("norm_first", "bias", "final_norm"):
        if name in known:
            known[name] = bool(known[name])
    if "layer_norm_eps" in known:
        known["layer_norm_eps"] = float(known["layer_norm_eps"])
    return known


def _check_architecture(cls: type, data: object) -> dict:
    if not isinstance(data, dict):
        raise CheckpointError(f"config.json must hold an object, got {type(data).__name__}")
    if data.get("architecture", cls.architecture) != cls.architecture:
        raise CheckpointError(
            f"config.architecture is {data.get('architecture')!r}, expected {cls.architecture!r}"
        )
    return data


@dataclass(frozen=True)
class MultiheadAttentionConfig:
    """nn.MultiheadAttention(batch_first=True) plus grouped-query attention (num_kv_heads)."""

    architecture: ClassVar[str] = "multihead_attention"
    cross_attention: ClassVar[bool] = True  # query, key and value may differ

    embed_dim: int
    num_heads: int
    num_kv_heads: int = 0  # 0: num_heads (plain multi-head attention)
    kdim: int = 0  # 0: embed_dim
    vdim: int = 0  # 0: embed_dim
    bias: bool = True
    add_bias_kv: bool = False
    add_zero_attn: bool = False
    attention_layout: str | None = None  # the source file's projection names, when not PyTorch's

    def __post_init__(self) -> None:
        E, H = (
            check_positive("embed_dim", self.embed_dim),
            check_positive("num_heads", self.num_heads),
        )
        for name in ("num_kv_heads", "kdim", "vdim"):
            value = getattr(self, name)
            default = H if name == "num_kv_heads" else E
            object.__setattr__(self, name, default if value == 0 else check_positive(name, value))
        for name in ("bias", "add_bias_kv", "add_zero_attn"):
            check_flag(name, getattr(self, name))
        if E % H:
            raise CheckpointError(f"embed_dim {E} is not divisible by num_heads {H}")
        if H % self.num_kv_heads:
            raise CheckpointError(
                f"num_heads {H} is not divisible by num_kv_heads {self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of K and V after projection: embed_dim without GQA."""
        return self.num_kv_heads * self.head_dim

    @property
    def same_embed_dim(self) -> bool:
        """kdim == vdim == embed_dim: Q/K/V weights stack into one in_proj (PyTorch's test)."""
        return self.kdim == self.embed_dim and self.vdim == self.embed_dim

    @property
    def attention(self) -> MultiheadAttentionConfig:
        """The attention block's config (itself), as every config offers."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """config.json contents (PyTorch's names; attention_layout only when set)."""
        data = {"architecture": self.architecture, **asdict(self)}
        if data["attention_layout"] is None:
            del data["attention_layout"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> MultiheadAttentionConfig:
        """From a config.json object: missing fields get nn.MultiheadAttention's defaults."""
        data = _check_architecture(cls, data)
        for name in ("embed_dim", "num_heads"):
            check_positive(name, data.get(name))
        known = known_fields(cls, data)
        for name in ("num_kv_heads", "kdim", "vdim"):
            if name in known:
                check_positive(name, known[name])
        for name in ("bias", "add_bias_kv", "add_zero_attn"):
            if name in known:
                known[name] = bool(known[name])
        return cls(**known)


@dataclass(frozen=True)
class LayerStackConfig:
    """Identical nn.Transformer{Encoder,Decoder}Layer(batch_first=True) layers plus a final norm.

    The fields every PyTorch transformer layer stack shares; subclasses name the architecture.
    """

    architecture: ClassVar[str] = ""
    cross_attention: ClassVar[bool] = False  # self-attention only
    activations: ClassVar[tuple[str, ...]] = ACTIVATIONS  # what `activation` may name

    d_model: int
    nhead: int
    dim_feedforward: int
    num_layers: int = 1
    activation: str = "relu"  # relu | gelu (exact, erf) | gelu_tanh
    layer_norm_eps: float = 1e-5
    norm_first: bool = False
    bias: bool = True
    final_norm: bool = False  # nn.TransformerEncoder/Decoder(norm=LayerNorm(d_model))

    def __post_init__(self) -> None:
        for name in ("d_model", "nhead", "dim_feedforward", "num_layers"):
            check_positive(name, getattr(self, name))
        if self.activation not in self.activations:
            raise CheckpointError(
                f"config.activation must be one of {self.activations}, got {self.activation!r}"
            )
        for name in ("norm_first", "bias", "final_norm"):
            check_flag(name, getattr(self, name))
        if self.d_model % self.nhead:
            raise CheckpointError(
                f"embed_dim {self.d_model} is not divisible by num_heads {self.nhead}"
            )

    @property
    def attention(self) -> MultiheadAttentionConfig:
        """Config of each layer's self_attn (and a decoder layer's multihead_attn)."""
        return MultiheadAttentionConfig(self.d_model, self.nhead, bias=self.bias)

    def to_dict(self) -> dict[str, Any]:
        """config.json contents (PyTorch's names)."""
        return {"architecture": self.architecture, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict):
        """From a config.json object: missing fields get PyTorch's layer defaults."""
        return cls(**_layer_fields(cls, data))


@dataclass(frozen=True)
class TransformerEncoderConfig(LayerStackConfig):
    """nn.TransformerEncoder of identical nn.TransformerEncoderLayer(batch_first=True) layers."""

    architecture: ClassVar[str] = "transformer_encoder"


@dataclass(frozen=True)
class TransformerDecoderConfig(LayerStackConfig):
    """nn.TransformerDecoder of identical nn.TransformerDecoderLayer(batch_first=True) layers.

    Each layer holds causal-capable self-attention over the target (self_attn) and
    cross-attention from the target to the memory (multihead_attn), then the feed-forward.
    """

    architecture: ClassVar[str] = "transformer_decoder"


@dataclass(frozen=True)
class TransformerConfig:
    """nn.Transformer(batch_first=True): encoder stack + its norm, decoder stack + its norm."""

    architecture: ClassVar[str] = "transformer"
    cross_attention: ClassVar[bool] = False

    d_model: int
    nhead: int
    dim_feedforward: int
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    activation: str = "relu"
    layer_norm_eps: float = 1e-5
    norm_first: bool = False
    bias: bool = True

    def __post_init__(self) -> None:
        check_positive("num_encoder_layers", self.num_encoder_layers)
        check_positive("num_decoder_layers", self.num_decoder_layers)
        self.decoder  # noqa: B018 (validates the shared fields, naming them)

    def _stack(self, cls: type, num_layers: int):
        shared = {f.name: getattr(self, f.name) for f in fields(self)}
        del shared["num_encoder_layers"], shared["num_decoder_layers"]
        return cls(**shared, num_layers=num_layers, final_norm=True)

    @property
    def encoder(self) -> TransformerEncoderConfig:
        """Config of nn.Transformer.encoder (its norm included)."""
        return self._stack(TransformerEncoderConfig, self.num_encoder_layers)

    @property
    def decoder(self) -> TransformerDecoderConfig:
        """Config of nn.Transformer.decoder (its norm included)."""
        return self._stack(TransformerDecoderConfig, self.num_decoder_layers)

    @property
    def attention(self) -> MultiheadAttentionConfig:
        return self.decoder.attention

    @property
    def num_layers(self) -> int:
        return self.num_encoder_layers + self.num_decoder_layers

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": self.architecture, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> TransformerConfig:
        """From a config.json object: missing fields get nn.Transformer's defaults."""
        return cls(**_layer_fields(cls, data))


EngineConfig = (
    MultiheadAttentionConfig
    | TransformerEncoderConfig
    | TransformerDecoderConfig
    | TransformerConfig
)
CONFIG_CLASSES: dict[str, type] = {
    cls.architecture: cls
    for cls in (
        MultiheadAttentionConfig,
        TransformerEncoderConfig,
        TransformerDecoderConfig,
        TransformerConfig,
    )
}


def config_from_dict(data: object) -> EngineConfig:
    """The typed config of a config.json object, chosen by its `architecture`."""
    if not isinstance(data, dict):
        raise CheckpointError(f"config.json must hold an object, got {type(data).__name__}")
    arch = data.get("architecture")
    if arch not in CONFIG_CLASSES:
        raise CheckpointError(
            f"unknown architecture {arch!r}; expected one of {tuple(CONFIG_CLASSES)}"
        )
    return CONFIG_CLASSES[arch].from_dict(data)
