"""Where queued requests meet the engine: numpy wire arrays to torch and back, and one batch of
works run as packed engine calls (on the engine thread)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mha_engine import ServedModel
from service.errors import NonFiniteOutput, ServiceError

if TYPE_CHECKING:
    from service.batcher import Runner, Work

TORCH_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}


def to_torch(array: np.ndarray, datatype: str, device: torch.device, dtype: torch.dtype):
    """A wire array as a tensor on the model's device and dtype (BF16 arrives as uint16 bits)."""
    tensor = torch.from_numpy(array)
    if datatype == "BF16":
        tensor = tensor.view(torch.bfloat16)
    return tensor.to(device=device, dtype=dtype, non_blocking=True)


def to_numpy(tensor: torch.Tensor, datatype: str) -> np.ndarray:
    """A tensor in the wire's `datatype` on the CPU (BF16 as uint16 bits)."""
    tensor = tensor.to(dtype=TORCH_DTYPES[datatype]).cpu().contiguous()
    if datatype == "BF16":
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def forward_works(model: ServedModel, works: list[Work]) -> list[list[np.ndarray] | ServiceError]:
    """Forward every sequence of `works`; each request's outputs (or its own error), in order.

    Self- and cross-attention requests go in separate engine calls, so a sequence's numbers
    never depend on which kind of request it was batched with; works with a runner (e.g. token
    ids for /v1/embeddings) go to their runner in one call per runner.
    """
    results: dict[int, Any] = {}
    for group in (
        [w for w in works if w.runner is None and w.payload.key is None],
        [w for w in works if w.runner is None and w.payload.key is not None],
    ):
        if group:
            for work, out in zip(group, _forward_tensors(model, group), strict=True):
                results[id(work)] = out
    by_runner: dict[Runner, list[Work]] = {}
    for work in works:
        if work.runner is not None:
            by_runner.setdefault(work.runner, []).append(work)
    for runner, group in by_runner.items():
        outputs = runner(model, [w.payload for w in group])
        for work, out in zip(group, outputs, strict=True):
            results[id(work)] = out
    return [results[id(w)] for w in works]


def _forward_tensors(
    model: ServedModel, works: list[Work]
) -> list[list[np.ndarray] | ServiceError]:
    """Hidden-state works through model.forward_varlen: one packed call for all sequences."""
    device, dtype = model.device, model.dtype
    cross = works[0].payload.key is not None
    query, key, value, masks, causal = [], [], [], [], []
    for work in works:
        p = work.payload
        query += [to_torch(q, p.datatype, device, dtype) for q in p.query]
        if cross:
            key += [to_torch(k, p.datatype, device, dtype) for k in p.key]
            value += [to_torch(v, p.datatype, device, dtype) for v in p.value]
        if p.key_padding_mask is not None:
            masks += [torch.from_numpy(m).to(device) for m in p.key_padding_mask]
        else:
            masks += [None] * p.num_sequences
        causal += [p.is_causal] * p.num_sequences
    outputs = model.forward_varlen(
        query,
        key=key if cross else None,
        value=value if cross else None,
        key_padding_mask=masks if any(m is not None for m in masks) else None,
        is_causal=causal,
    )
    results: list[list[np.ndarray] | ServiceError] = []
    start = 0
    for work in works:
        mine = outputs[start : start + work.payload.num_sequences]
        start += work.payload.num_sequences
        # NaN/Inf survive a float64 sum; a request whose values overflowed fails alone.
        if all(torch.isfinite(o.sum(dtype=torch.float64)) for o in mine):
            results.append([to_numpy(o, work.payload.datatype) for o in mine])
        else:
            results.append(
                NonFiniteOutput(
                    "the model's output for this request is not finite (NaN or Inf); its "
                    f"inputs are out of range for the model's {model.dtype}"
                )
            )
    return results
