"""Where queued requests meet the engine: numpy wire arrays to torch and back, and one batch of
works run as packed engine calls (on the engine thread)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mha_engine import ServedModel
from service.datatypes import to_numpy, to_torch
from service.errors import NonFiniteOutput, ServiceError

if TYPE_CHECKING:
    from service.inputs import Payload
    from service.work import Runner, Work


def run_batch(model: ServedModel, works: list[Work]) -> list[Any]:
    """Run one batch: the works sharing a runner go to it in one call; each work's result (or
    its own ServiceError), in order."""
    by_runner: dict[Runner, list[Work]] = {}
    for work in works:
        by_runner.setdefault(work.runner, []).append(work)
    results: dict[int, Any] = {}
    for runner, group in by_runner.items():
        outputs = runner(model, [w.payload for w in group])
        for work, out in zip(group, outputs, strict=True):
            results[id(work)] = out
    return [results[id(w)] for w in works]


def hidden_states(model: ServedModel, payloads: list[Payload]) -> list[Any]:
    """Runner for hidden-state requests (/infer). Self- and cross-attention payloads go in
    separate engine calls, so a sequence's numbers never depend on which kind of request it was
    batched with."""
    results: dict[int, Any] = {}
    for group in (
        [p for p in payloads if p.key is None],
        [p for p in payloads if p.key is not None],
    ):
        if group:
            for payload, out in zip(group, _forward_tensors(model, group), strict=True):
                results[id(payload)] = out
    return [results[id(p)] for p in payloads]


def _packed(arrays: list[np.ndarray], datatype: str, device, dtype) -> torch.Tensor:
    """One request's per-sequence arrays as one packed (tokens, width) tensor."""
    return to_torch(np.concatenate(arrays), datatype, device, dtype)


def _forward_tensors(
    model: ServedModel, payloads: list[Payload]
) -> list[list[np.ndarray] | ServiceError]:
    """Hidden-state payloads through model.forward_packed: one packed call for all sequences."""
    device, dtype = model.device, model.dtype
    cross = payloads[0].key is not None
    q_lens = [q.shape[0] for p in payloads for q in p.query]
    query = torch.cat([_packed(p.query, p.datatype, device, dtype) for p in payloads])  # (N, E)
    key = value = cu_k = None
    kv_lens = q_lens
    if cross:
        kv_lens = [k.shape[0] for p in payloads for k in p.key]
        key = torch.cat([_packed(p.key, p.datatype, device, dtype) for p in payloads])
        value = torch.cat([_packed(p.value, p.datatype, device, dtype) for p in payloads])
        cu_k = np.cumsum([0, *kv_lens]).tolist()
    masks = None
    if any(p.key_padding_mask is not None for p in payloads):
        parts = [
            np.concatenate(p.key_padding_mask)
            if p.key_padding_mask is not None
            else np.zeros(sum(_kv_lens(p)), dtype=bool)  # all-False: same as no mask
            for p in payloads
        ]
        masks = torch.from_numpy(np.concatenate(parts)).to(device)  # (M,)
    causal = [p.is_causal for p in payloads for _ in p.query]
    out = model.forward_packed(
        query,
        np.cumsum([0, *q_lens]).tolist(),
        key=key,
        value=value,
        cu_seqlens_k=cu_k,
        key_padding_mask=masks,
        is_causal=causal,
    )  # (N, E)
    results: list[list[np.ndarray] | ServiceError] = []
    for p, mine in zip(payloads, out.split([p.num_tokens for p in payloads]), strict=True):
        # NaN/Inf survive a float64 sum; a request whose values overflowed fails alone.
        if torch.isfinite(mine.sum(dtype=torch.float64)):
            arrays = to_numpy(mine, p.datatype)  # (tokens, E)
            results.append(np.split(arrays, np.cumsum([q.shape[0] for q in p.query])[:-1]))
        else:
            results.append(
                NonFiniteOutput(
                    "the model's output for this request is not finite (NaN or Inf); its "
                    f"inputs are out of range for the model's {model.dtype}"
                )
            )
    return results


def _kv_lens(payload: Payload) -> list[int]:
    """Key lengths of a payload's sequences (its query lengths for self-attention)."""
    return [t.shape[0] for t in (payload.key if payload.key is not None else payload.query)]
