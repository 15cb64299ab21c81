"""Check a decoded request against the served model and split it into per-sequence work."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from service.oip.codecs import InferRequest
from service.oip.datatypes import FLOAT_TYPES
from service.oip.decoder_inputs import DECODER_ARCHITECTURES, prepare_decoder
from service.oip.model_inputs import check_input_names
from service.pipeline.errors import BadInput

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
    architecture: str = ""  # decoders take their own inputs (service.oip.decoder_inputs)
    optional_inputs: bool = True  # false: only the required inputs (service.oip.model_inputs)

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        max_seq_len: int,
        max_sequences: int,
        max_tokens: int,
        optional_inputs: bool = True,
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
            architecture=config.architecture,
            optional_inputs=optional_inputs,
        )

    @property
    def needs_key_value(self) -> bool:
        """kdim/vdim differ from embed_dim: the query cannot serve as key and value."""
        return self.cross_attention and (self.kdim, self.vdim) != (self.embed_dim, self.embed_dim)


@dataclass
class Payload:
    """A request's sequences, packed: each input is one contiguous (tokens, width) array (a view
    of the request body where possible) split by per-sequence lengths."""

    query: np.ndarray  # (N, embed_dim) hidden states, or (N,) token ids; N = sum(lengths)
    lengths: list[int]  # tokens per sequence (B entries)
    key: np.ndarray | None = None  # (M, kdim); M = sum(key_lengths)
    value: np.ndarray | None = None  # (M, vdim)
    key_lengths: list[int] | None = None  # None: the query's (self-attention)
    key_padding_mask: np.ndarray | None = None  # (M,) bool, True = ignore
    is_causal: bool = False
    # decoders only (service.oip.decoder_inputs): key is the memory (or src), key_padding_mask
    # the memory_key_padding_mask, is_causal tgt_is_causal; these two masks besides
    tgt_key_padding_mask: np.ndarray | None = None  # (N,) bool
    src_key_padding_mask: np.ndarray | None = None  # (M,) bool (transformer)
    datatype: str = "FP32"  # the input's wire datatype; the output comes back in it
    batched: bool = True  # input was [B, T, E] (else [T, E])
    token_types: np.ndarray | None = None  # (N,) token type ids beside token-id queries (pairs)
    # the output's rows on the device go here as well (an output in CUDA shared memory: written
    # device-to-device on the engine thread, service.shm.tensors); None: host only
    output_sink: Callable[[Any], None] | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    @property
    def kv_lengths(self) -> list[int]:
        """Keys per sequence (the query lengths for self-attention)."""
        return self.lengths if self.key_lengths is None else self.key_lengths

    def dense(self, packed: np.ndarray, lengths: list[int]) -> np.ndarray:
        """A packed input of equal-length sequences as (B, T, ...) (a view)."""
        return packed.reshape(len(lengths), lengths[0], *packed.shape[1:])


def nonfinite_input(payload: Payload) -> str | None:
    """The name of the first float input holding NaN or Inf, else None. The batch path checks
    its staged tensors instead (service.runtime.forward); this is for payloads checked on their
    own."""
    for name, array in (("input", payload.query), ("key", payload.key), ("value", payload.value)):
        if array is not None and not _finite(payload.datatype, array):
            return name
    return None


def _finite(datatype: str, array: np.ndarray) -> bool:
    if datatype == "BF16":  # raw bits: an all-ones exponent is Inf or NaN
        return not ((array & 0x7F80) == 0x7F80).any()
    # one pass, no temporary: NaN/Inf survive a sum. A finite float32 sum settles it (fast);
    # one that is not is redone in float64, which finite values cannot overflow.
    with np.errstate(invalid="ignore", over="ignore"):
        if array.dtype != np.float64 and math.isfinite(array.sum(dtype=np.float32)):
            return True
        return math.isfinite(array.sum(dtype=np.float64))


def check_finite(payload: Payload) -> None:
    """400 naming the input that holds NaN or Inf (for paths that check before computing)."""
    name = nonfinite_input(payload)
    if name is not None:
        raise BadInput(f"input '{name}' holds NaN or Inf values")


def bool_param(parameters: dict[str, Any], name: str) -> bool:
    value = parameters.get(name, False)
    if not isinstance(value, bool):
        raise BadInput(f"parameter '{name}' must be true or false, got {value!r}")
    return value


def float_tensor(request: InferRequest, name: str, width: int, label: str) -> np.ndarray:
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
    return tensor.array if len(tensor.shape) == 3 else tensor.array[None]


def check_length(name: str, length: int, limits: ModelLimits) -> None:
    if length == 0:
        raise BadInput(f"input '{name}' has sequence length 0; send at least one token")
    if length > limits.max_seq_len:
        raise BadInput(
            f"input '{name}' has sequence length {length}, over the limit of "
            f"{limits.max_seq_len} (--max-seq-len)"
        )


def prepare(request: InferRequest, limits: ModelLimits) -> Payload:
    """Validate `request` for the model; raises BadInput naming the first problem found."""
    if limits.architecture in DECODER_ARCHITECTURES:
        return prepare_decoder(request, limits)
    check_input_names(request.inputs, limits)
    if "input" not in request.inputs:
        raise BadInput("missing input 'input'")
    for name in request.outputs:
        if name != OUTPUT_NAME:
            raise BadInput(f"unknown output '{name}'; this model has output '{OUTPUT_NAME}'")

    batched = len(request.inputs["input"].shape) == 3
    query = float_tensor(request, "input", limits.embed_dim, "embed_dim")  # (B, T, E)
    batch, tgt_len = query.shape[0], query.shape[1]
    if batch == 0:
        raise BadInput("input 'input' has batch size 0")
    if batch > limits.max_sequences:
        raise BadInput(
            f"request has {batch} sequences; at most {limits.max_sequences} per request "
            "(--max-batch-size)"
        )
    check_length("input", tgt_len, limits)
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
        key = float_tensor(request, "key", limits.kdim, "kdim")  # (B, S, kdim)
        value = float_tensor(request, "value", limits.vdim, "vdim")  # (B, S, vdim)
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
        check_length("key", src_len, limits)
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

    is_causal = bool_param(request.parameters, "is_causal")
    if is_causal and src_len != tgt_len:
        raise BadInput(
            f"is_causal needs as many keys as queries; got {tgt_len} queries and {src_len} keys"
        )

    datatype = request.inputs["input"].datatype
    if key is not None and request.inputs["key"].datatype != datatype:
        raise BadInput("inputs 'key' and 'value' must have the datatype of 'input'")
    if value is not None and request.inputs["value"].datatype != datatype:
        raise BadInput("inputs 'key' and 'value' must have the datatype of 'input'")
    return Payload(
        query=query.reshape(batch * tgt_len, -1),  # (N, E), a view
        lengths=[tgt_len] * batch,
        key=None if key is None else key.reshape(batch * src_len, -1),  # (M, kdim)
        value=None if value is None else value.reshape(batch * src_len, -1),  # (M, vdim)
        key_lengths=None if key is None else [src_len] * batch,
        key_padding_mask=None if mask is None else mask.reshape(-1),  # (M,)
        is_causal=is_causal,
        datatype=datatype,
        batched=batched,
    )


def request_timeout_s(default_s: float, parameters: dict[str, Any]) -> float:
    """Seconds a request may wait: --request-timeout-s (`default_s`), or less if the client asks
    with the `timeout` parameter (µs, as tritonclient sends it) over HTTP or gRPC."""
    timeout = default_s
    asked = parameters.get("timeout")
    if asked is not None:
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 0:
            raise BadInput(
                f"parameter 'timeout' must be a non-negative integer (µs), got {asked!r}"
            )
        if asked > 0:
            timeout = min(timeout, asked / 1e6)
    return timeout
