"""Slow-path attention weights for one validated request; `compute` runs on the engine thread.

The fast path never materialises attention probabilities (that is why it is fast). This module
calls the engine's `attention_weights` (explicit softmax, need_weights=True semantics) on the
request's dense [B, T, E] batch and hands numpy arrays back, so nothing here touches the event
loop or the batched fast path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from service.oip.datatypes import to_numpy, to_torch
from service.oip.inputs import Payload
from service.pipeline.errors import BadInput

WEIGHTS_NAME = "attention_weights"


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
    if model.architecture == "multihead_attention":
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
    return WeightsResult(to_numpy(output, datatype), to_numpy(weights, datatype), has_layer_axis)


def panels(result: WeightsResult, options: WeightsOptions) -> np.ndarray:
    """First sequence's weights as float32 (L, H, T, S) for the heatmap (H=1 when averaged).

    `result` must come from a batched payload (see first_sequence) in FP32.
    """
    weights = result.weights if result.has_layer_axis else result.weights[None]  # (L, B, [H,] T, S)
    weights = weights[:, 0]  # (L, [H,] T, S)
    if options.average:
        weights = weights[:, None]  # (L, 1, T, S)
    return np.asarray(weights, dtype=np.float32)
