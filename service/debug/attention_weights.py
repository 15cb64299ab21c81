"""Slow-path attention weights for one validated request; `compute` runs on the engine thread.

The fast path never materialises attention probabilities (that is why it is fast). This module
calls the engine's `attention_weights` (explicit softmax, need_weights=True semantics) on the
request's dense [B, T, E] batch and hands numpy arrays back, so nothing here touches the event
loop or the batched fast path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from service.oip.datatypes import to_numpy, to_torch
from service.oip.decoder_inputs import DECODER_ARCHITECTURES, TRANSFORMER
from service.oip.inputs import Payload
from service.pipeline.errors import BadInput

WEIGHTS_NAME = "attention_weights"
# Decoders: attention_weights is the decoder's self-attention; these besides (PyTorch's
# multihead_attn, and nn.Transformer's encoder self-attention, every encoder layer).
CROSS_WEIGHTS_NAME = "cross_attention_weights"
ENCODER_WEIGHTS_NAME = "encoder_attention_weights"


@dataclass
class WeightsOptions:
    """Request parameters of the attention endpoint."""

    layer: int | None  # None: every layer (transformer_encoder) / the only one (MHA)
    average: bool  # average_attn_weights: mean over heads


@dataclass
class WeightsResult:
    """Numpy outputs in the requested datatype (BF16 as raw uint16 bits)."""

    output: np.ndarray  # (B, T, E), or (T, E) for an unbatched request
    weights: np.ndarray  # ([L,] [B,] [H,] T, S): L for all encoder layers, H unless averaged
    has_layer_axis: bool  # weights has a leading L axis
    # decoders: output name -> weights of the other attentions (cross_attention_weights with
    # the layout of `weights`; encoder_attention_weights (Le, B, [H,] S, S))
    extra: dict[str, np.ndarray] = field(default_factory=dict)


def weight_layers(model: Any) -> int:
    """Layers the `layer` parameter indexes: a transformer's decoder layers, else all."""
    return getattr(model.config, "num_decoder_layers", model.num_layers)


def parse_options(parameters: dict[str, Any], architecture: str, num_layers: int) -> WeightsOptions:
    """Read `layer` and `average_attn_weights`; raises BadInput naming the bad parameter."""
    average = parameters.get("average_attn_weights", False)
    if not isinstance(average, bool):
        raise BadInput(f"parameter 'average_attn_weights' must be true or false, got {average!r}")
    layer = parameters.get("layer")
    if layer is not None:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise BadInput(f"parameter 'layer' must be an integer, got {layer!r}")
        if not -num_layers <= layer < num_layers:
            raise BadInput(
                f"parameter 'layer' is {layer}; this {architecture} model has {num_layers} "
                f"layer(s): use 0..{num_layers - 1} (negative counts from the end)"
            )
        layer %= num_layers
        if architecture == "multihead_attention":
            layer = None  # one attention block: no layer axis either way
    return WeightsOptions(layer, average)


def first_sequence(payload: Payload) -> Payload:
    """The request's first sequence only, as a batch of one (what the heatmap shows)."""
    t, s = payload.lengths[0], payload.kv_lengths[0]

    def head(packed: np.ndarray | None) -> np.ndarray | None:
        return None if packed is None else packed[:s]

    return replace(
        payload,
        query=payload.query[:t],
        lengths=[t],
        key=head(payload.key),
        value=head(payload.value),
        key_lengths=None if payload.key_lengths is None else [s],
        key_padding_mask=head(payload.key_padding_mask),
        tgt_key_padding_mask=None
        if payload.tgt_key_padding_mask is None
        else payload.tgt_key_padding_mask[:t],
        src_key_padding_mask=head(payload.src_key_padding_mask),
        batched=True,
    )


def _dense(payload: Payload, packed: np.ndarray, lengths: list[int], model: Any) -> torch.Tensor:
    dense = payload.dense(packed, lengths)  # (B, T, width): a request's sequences share T
    return to_torch(dense, payload.datatype, model.device, model.dtype)


def compute(
    model: Any, payload: Payload, options: WeightsOptions, datatype: str | None = None
) -> WeightsResult:
    """Run the engine's weights path on `payload`; outputs in `datatype` (default: the input's).

    Fully masked query rows (possible with causal + left padding) come back as zeros.
    """
    datatype = datatype or payload.datatype
    query = _dense(payload, payload.query, payload.lengths, model)  # (B, T, E)
    mask = None
    if payload.key_padding_mask is not None:
        mask = payload.dense(payload.key_padding_mask, payload.kv_lengths)  # (B, S)
        mask = torch.from_numpy(np.ascontiguousarray(mask)).to(model.device)
    extra: dict[str, np.ndarray] = {}
    if model.architecture in DECODER_ARCHITECTURES:
        output, found = _decoder_weights(model, payload, query, mask, options)
        weights = found.pop("self_attn")  # ([L,] B, [H,] T, T)
        extra[CROSS_WEIGHTS_NAME] = found.pop("cross_attn")  # ([L,] B, [H,] T, S)
        if "encoder_self_attn" in found:
            extra[ENCODER_WEIGHTS_NAME] = found.pop("encoder_self_attn")  # (Le, B, [H,] S, S)
        has_layer_axis = options.layer is None
    elif model.architecture == "multihead_attention":
        key = value = None
        if payload.key is not None:
            key = _dense(payload, payload.key, payload.kv_lengths, model)  # (B, S, kdim)
            value = _dense(payload, payload.value, payload.kv_lengths, model)  # (B, S, vdim)
        output, weights = model.attention_weights(
            query,
            key,
            value,
            key_padding_mask=mask,
            is_causal=payload.is_causal,
            average_attn_weights=options.average,
        )  # (B, T, E), (B, [H,] T, S)
        has_layer_axis = False
    else:
        output, weights = model.attention_weights(
            query,
            src_key_padding_mask=mask,
            is_causal=payload.is_causal,
            layer=options.layer,
            average_attn_weights=options.average,
        )  # (B, T, E), ([L,] B, [H,] T, S)
        has_layer_axis = options.layer is None
    if not payload.batched:
        output = output[0]  # (T, E)
        weights = weights.select(1 if has_layer_axis else 0, 0)  # drop B
        extra = {
            name: w.select(1 if has_layer_axis or name == ENCODER_WEIGHTS_NAME else 0, 0)
            for name, w in extra.items()
        }
    return WeightsResult(
        to_numpy(output, datatype),
        to_numpy(weights, datatype),
        has_layer_axis,
        {name: to_numpy(w, datatype) for name, w in extra.items()},
    )


def _decoder_weights(model: Any, payload: Payload, tgt, memory_mask, options: WeightsOptions):
    """A decoder's (or transformer's) output and its weights dict, PyTorch's argument names."""
    memory = _dense(payload, payload.key, payload.kv_lengths, model)  # (B, S, E)

    def dense_mask(packed: np.ndarray | None, lengths: list[int]) -> torch.Tensor | None:
        if packed is None:
            return None
        return torch.from_numpy(np.ascontiguousarray(payload.dense(packed, lengths))).to(
            model.device
        )

    common = {
        "tgt_key_padding_mask": dense_mask(payload.tgt_key_padding_mask, payload.lengths),
        "memory_key_padding_mask": memory_mask,
        "tgt_is_causal": payload.is_causal,
        "layer": options.layer,
        "average_attn_weights": options.average,
    }
    if model.architecture == TRANSFORMER:
        src_mask = dense_mask(payload.src_key_padding_mask, payload.kv_lengths)
        return model.attention_weights(memory, tgt, src_key_padding_mask=src_mask, **common)
    return model.attention_weights(tgt, memory, **common)


def panels(result: WeightsResult, options: WeightsOptions) -> np.ndarray:
    """First sequence's weights as float32 (L, H, T, S) for the heatmap (H=1 when averaged).

    `result` must come from a batched payload (see first_sequence) in FP32.
    """
    weights = result.weights if result.has_layer_axis else result.weights[None]  # (L, B, [H,] T, S)
    weights = weights[:, 0]  # (L, [H,] T, S)
    if options.average:
        weights = weights[:, None]  # (L, 1, T, S)
    return np.asarray(weights, dtype=np.float32)
