"""Check a decoded request against the served model and split it into per-sequence work."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from service.codecs import InferRequest
from service.datatypes import FLOAT_TYPES
from service.errors import BadInput

if TYPE_CHECKING:
    from mha_engine import EngineConfig

OUTPUT_NAME = "output"


@dataclass
class ModelLimits:
    """What a request may ask of the served model."""

    embed_dim: int
    kdim: int
    vdim: int
    cross_attention: bool
    max_seq_len: int
    max_sequences: int
    max_tokens: int

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, max_seq_len: int, max_sequences: int, max_tokens: int
    ) -> ModelLimits:
        """Dimensions from the model's typed config; the rest from the service's settings."""
        attention = config.attention
        return cls(
            embed_dim=attention.embed_dim,
            kdim=attention.kdim,
            vdim=attention.vdim,
            cross_attention=config.cross_attention,
            max_seq_len=max_seq_len,
            max_sequences=max_sequences,
            max_tokens=max_tokens,
        )

    @property
    def needs_key_value(self) -> bool:
        """kdim/vdim differ from embed_dim: the query cannot serve as key and value."""
        return self.cross_attention and (self.kdim, self.vdim) != (self.embed_dim, self.embed_dim)


@dataclass
class Payload:
    """A request's sequences, ready for the batcher: arrays are per sequence, row-major."""

    query: list[np.ndarray]  # each (T, embed_dim)
    key: list[np.ndarray] | None  # each (S, kdim)
    value: list[np.ndarray] | None  # each (S, vdim)
    key_padding_mask: list[np.ndarray] | None  # each (S,) bool, True = ignore
    is_causal: bool
    datatype: str  # the input's datatype; the output comes back in it
    batched: bool  # input was [B, T, E] (else [T, E])

    @property
    def num_sequences(self) -> int:
        return len(self.query)

    @property
    def num_tokens(self) -> int:
        return sum(q.shape[0] for q in self.query)


def _bool_param(parameters: dict[str, Any], name: str) -> bool:
    value = parameters.get(name, False)
    if not isinstance(value, bool):
        raise BadInput(f"parameter '{name}' must be true or false, got {value!r}")
    return value


def _check_finite(name: str, datatype: str, array: np.ndarray) -> None:
    if datatype == "BF16":  # raw bits: an all-ones exponent is Inf or NaN
        finite = not ((array & 0x7F80) == 0x7F80).any()
    else:  # one pass, no temporary: NaN/Inf survive a float64 sum, finite values can't overflow it
        with np.errstate(invalid="ignore", over="ignore"):
            finite = math.isfinite(array.sum(dtype=np.float64))
    if not finite:
        raise BadInput(f"input '{name}' holds NaN or Inf values")


def _float_tensor(request: InferRequest, name: str, width: int, label: str) -> np.ndarray:
    tensor = request.inputs[name]
    if tensor.datatype not in FLOAT_TYPES:
        raise BadInput(
            f"input '{name}' has datatype {tensor.datatype}; use one of {', '.join(FLOAT_TYPES)}"
        )
    if len(tensor.shape) not in (2, 3):
        raise BadInput(
            f"input '{name}' has shape {list(tensor.shape)}; "
            f"expected [B, T, {label}] or [T, {label}]"
        )
    if tensor.shape[-1] != width:
        raise BadInput(
            f"input '{name}' has last dimension {tensor.shape[-1]}; the model's {label} is {width}"
        )
    _check_finite(name, tensor.datatype, tensor.array)
    return tensor.array if len(tensor.shape) == 3 else tensor.array[None]


def _check_length(name: str, length: int, limits: ModelLimits) -> None:
    if length == 0:
        raise BadInput(f"input '{name}' has sequence length 0; send at least one token")
    if length > limits.max_seq_len:
        raise BadInput(
            f"input '{name}' has sequence length {length}, over the limit of "
            f"{limits.max_seq_len} (--max-seq-len)"
        )


def prepare(request: InferRequest, limits: ModelLimits) -> Payload:
    """Validate `request` for the model; raises BadInput naming the first problem found."""
    allowed = {"input", "key_padding_mask"} | (
        {"key", "value"} if limits.cross_attention else set()
    )
    unknown = sorted(set(request.inputs) - allowed)
    if unknown:
        raise BadInput(f"unknown input(s) {unknown}; this model takes {sorted(allowed)}")
    if "input" not in request.inputs:
        raise BadInput("missing input 'input'")
    for name in request.outputs:
        if name != OUTPUT_NAME:
            raise BadInput(f"unknown output '{name}'; this model has output '{OUTPUT_NAME}'")

    batched = len(request.inputs["input"].shape) == 3
    query = _float_tensor(request, "input", limits.embed_dim, "embed_dim")  # (B, T, E)
    batch, tgt_len = query.shape[0], query.shape[1]
    if batch == 0:
        raise BadInput("input 'input' has batch size 0")
    if batch > limits.max_sequences:
        raise BadInput(
            f"request has {batch} sequences; at most {limits.max_sequences} per request "
            "(--max-batch-size)"
        )
    _check_length("input", tgt_len, limits)
    if batch * tgt_len > limits.max_tokens:
        raise BadInput(
            f"request has {batch * tgt_len} tokens; at most {limits.max_tokens} per request "
            "(--max-batch-tokens)"
        )

    key = value = None
    src_len = tgt_len
    if "key" in request.inputs or "value" in request.inputs:
        if not ("key" in request.inputs and "value" in request.inputs):
            raise BadInput("inputs 'key' and 'value' go together; send both or neither")
        key = _float_tensor(request, "key", limits.kdim, "kdim")  # (B, S, kdim)
        value = _float_tensor(request, "value", limits.vdim, "vdim")  # (B, S, vdim)
        for name, tensor in (("key", key), ("value", value)):
            if (len(request.inputs[name].shape) == 3) != batched:
                raise BadInput(f"input '{name}' must have the same rank as 'input'")
            if tensor.shape[0] != batch:
                raise BadInput(f"input '{name}' has batch {tensor.shape[0]}; 'input' has {batch}")
        if key.shape[1] != value.shape[1]:
            raise BadInput(
                f"'key' has {key.shape[1]} positions but 'value' has {value.shape[1]}; "
                "they must match"
            )
        src_len = key.shape[1]
        _check_length("key", src_len, limits)
    elif limits.needs_key_value:
        raise BadInput(
            f"this model needs inputs 'key' and 'value' (kdim {limits.kdim}, vdim {limits.vdim}, "
            f"embed_dim {limits.embed_dim})"
        )

    mask = None
    if "key_padding_mask" in request.inputs:
        tensor = request.inputs["key_padding_mask"]
        expected = [batch, src_len] if batched else [src_len]
        if tensor.datatype != "BOOL":
            raise BadInput(f"input 'key_padding_mask' must be BOOL, got {tensor.datatype}")
        if list(tensor.shape) != expected:
            raise BadInput(
                f"input 'key_padding_mask' has shape {list(tensor.shape)}; expected {expected} "
                "(True = ignore that key)"
            )
        mask = tensor.array.reshape(batch, src_len)
        fully_masked = np.flatnonzero(mask.all(axis=1))
        if fully_masked.size:
            raise BadInput(
                f"key_padding_mask ignores every key of sequence {int(fully_masked[0])}; "
                "at least one key must be attended to"
            )

    is_causal = _bool_param(request.parameters, "is_causal")
    if is_causal and src_len != tgt_len:
        raise BadInput(
            f"is_causal needs as many keys as queries; got {tgt_len} queries and {src_len} keys"
        )

    datatype = request.inputs["input"].datatype
    return Payload(
        query=list(query),
        key=None if key is None else list(key),
        value=None if value is None else list(value),
        key_padding_mask=None if mask is None else list(mask),
        is_causal=is_causal,
        datatype=datatype,
        batched=batched,
    )
