"""OIP inputs of decoder models, with PyTorch's argument names: a transformer_decoder takes `tgt`
and `memory`, a whole transformer takes `src` and `tgt`; padding masks are optional BOOL inputs
under their PyTorch names, `tgt_is_causal` a request parameter.

A request is checked here and packed into the same Payload as an attention request: `query` is
tgt, `key` the memory (or src), `key_padding_mask` memory_key_padding_mask, `is_causal`
tgt_is_causal; the decoder's other masks ride in tgt_key_padding_mask / src_key_padding_mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from service.oip.codecs import InferRequest
from service.pipeline.errors import BadInput

if TYPE_CHECKING:
    from service.oip.inputs import ModelLimits, Payload

DECODER = "transformer_decoder"
TRANSFORMER = "transformer"
DECODER_ARCHITECTURES = (DECODER, TRANSFORMER)
# The input that plays the part of the memory (key/value of cross-attention), per architecture.
MEMORY_INPUT = {DECODER: "memory", TRANSFORMER: "src"}
# Required float inputs then optional BOOL masks, in the order metadata lists them.
FLOAT_INPUTS = {DECODER: ("tgt", "memory"), TRANSFORMER: ("src", "tgt")}
MASK_INPUTS = {
    DECODER: ("tgt_key_padding_mask", "memory_key_padding_mask"),
    TRANSFORMER: ("src_key_padding_mask", "tgt_key_padding_mask", "memory_key_padding_mask"),
}
CAUSAL_PARAMETER = "tgt_is_causal"


def decoder_input_name(architecture: str, payload_name: str) -> str:
    """The OIP input name behind a Payload field name ("input" -> tgt, "key" -> the memory)."""
    return {"input": "tgt", "key": MEMORY_INPUT[architecture]}.get(payload_name, payload_name)


def input_names(architecture: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required float inputs, optional BOOL mask inputs) of a decoder architecture."""
    return FLOAT_INPUTS[architecture], MASK_INPUTS[architecture]


def _mask(
    request: InferRequest, name: str, batch: int, length: int, batched: bool
) -> np.ndarray | None:
    """The (B, L) bool mask `name`, or None; refuses a sequence whose every position is hidden."""
    tensor = request.inputs.get(name)
    if tensor is None:
        return None
    expected = [batch, length] if batched else [length]
    if tensor.datatype != "BOOL":
        raise BadInput(f"input '{name}' must be BOOL, got {tensor.datatype}")
    if list(tensor.shape) != expected:
        raise BadInput(
            f"input '{name}' has shape {list(tensor.shape)}; expected {expected} "
            "(True = ignore that position)"
        )
    mask = tensor.array.reshape(batch, length)
    fully = np.flatnonzero(mask.all(axis=1))
    if fully.size:
        raise BadInput(
            f"input '{name}' ignores every position of sequence {int(fully[0])}; "
            "at least one must be attended to"
        )
    return mask


def prepare_decoder(request: InferRequest, limits: ModelLimits) -> Payload:
    """Validate a decoder request; raises BadInput naming the input or parameter at fault."""
    from service.oip.inputs import (
        OUTPUT_NAME,
        Payload,
        bool_param,
        check_length,
        float_tensor,
    )
    from service.oip.model_inputs import check_input_names

    arch = limits.architecture
    floats, masks = input_names(arch)
    memory_name = MEMORY_INPUT[arch]
    check_input_names(request.inputs, limits, f"{arch} model")
    for name in floats:
        if name not in request.inputs:
            raise BadInput(f"missing input '{name}'; this {arch} model needs {list(floats)}")
    for name in request.outputs:
        if name != OUTPUT_NAME:
            raise BadInput(f"unknown output '{name}'; this model has output '{OUTPUT_NAME}'")

    batched = len(request.inputs["tgt"].shape) == 3
    tgt = float_tensor(request, "tgt", limits.embed_dim, "d_model")  # (B, T, E)
    memory = float_tensor(request, memory_name, limits.embed_dim, "d_model")  # (B, S, E)
    if (len(request.inputs[memory_name].shape) == 3) != batched:
        raise BadInput(f"input '{memory_name}' must have the same rank as 'tgt'")
    batch, tgt_len, mem_len = tgt.shape[0], tgt.shape[1], memory.shape[1]
    if memory.shape[0] != batch:
        raise BadInput(f"input '{memory_name}' has batch size {memory.shape[0]}; 'tgt' has {batch}")
    if request.inputs[memory_name].datatype != request.inputs["tgt"].datatype:
        raise BadInput(f"input '{memory_name}' must have the datatype of 'tgt'")
    if batch == 0:
        raise BadInput("input 'tgt' has batch size 0")
    if batch > limits.max_sequences:
        raise BadInput(
            f"request has {batch} sequences; at most {limits.max_sequences} per request "
            "(--max-batch-size)"
        )
    for name, length in (("tgt", tgt_len), (memory_name, mem_len)):
        check_length(name, length, limits)
        if batch * length > limits.max_tokens:
            raise BadInput(
                f"input '{name}' has {batch * length} tokens; at most {limits.max_tokens} per "
                "request (--max-batch-tokens)"
            )

    lengths = {"tgt": tgt_len, "memory": mem_len, "src": mem_len}
    found = {
        name: _mask(request, name, batch, lengths[name.split("_")[0]], batched) for name in masks
    }
    is_causal = bool_param(request.parameters, CAUSAL_PARAMETER)
    tgt_kpm = found.get("tgt_key_padding_mask")
    if is_causal and tgt_kpm is not None and tgt_kpm[:, 0].any():
        raise BadInput(
            "input 'tgt_key_padding_mask' hides the first target position; with tgt_is_causal "
            "that position would attend to nothing (pad at the end)"
        )

    def packed(mask: np.ndarray | None) -> np.ndarray | None:
        return None if mask is None else mask.reshape(-1)

    return Payload(
        query=tgt.reshape(batch * tgt_len, -1),  # (N, E), a view
        lengths=[tgt_len] * batch,
        key=memory.reshape(batch * mem_len, -1),  # (M, E)
        key_lengths=[mem_len] * batch,
        key_padding_mask=packed(found.get("memory_key_padding_mask")),  # (M,)
        tgt_key_padding_mask=packed(tgt_kpm),  # (N,)
        src_key_padding_mask=packed(found.get("src_key_padding_mask")),  # (M,)
        is_causal=is_causal,
        datatype=request.inputs["tgt"].datatype,
        batched=batched,
    )
