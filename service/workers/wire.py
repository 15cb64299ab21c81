"""What crosses between a front-end and the engine process, in one place: a request's payload
as slab regions (or inline arrays when the slab is full), a result the same way back, and the
model facts a front-end needs (ModelView) without holding the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from service.oip.inputs import Payload
from service.text.kinds import text_kind
from service.workers.slab import Slab

PAYLOAD_FIELDS = tuple(f.name for f in fields(Payload))  # once: fields() is slow per call
# Payload's array fields (decoder masks; a text pair's token types)
ARRAYS = (
    "query", "key", "value", "key_padding_mask", "tgt_key_padding_mask", "src_key_padding_mask",
    "token_types",
)  # fmt: skip
# ("shm", offset, shape, dtype): a view of the slab; else the array itself (pickled inline)
Ref = tuple | np.ndarray | None


def put(slab: Slab | None, array: np.ndarray, regions: list[tuple[int, int]]) -> Ref:
    """Copy `array` into a new region of `slab` (recorded in `regions`, to free after the
    reply); the array itself when there is no room (it then travels inline, pickled)."""
    offset = None if slab is None else slab.alloc(array.nbytes)
    if offset is None:
        return np.ascontiguousarray(array)
    regions.append((offset, array.nbytes))
    slab.array(offset, array.shape, array.dtype.str)[...] = array
    return ("shm", offset, array.shape, array.dtype.str)


def get(slab: Slab, ref: Ref) -> np.ndarray | None:
    """The array a Ref stands for: a view of the slab, no copy."""
    if isinstance(ref, tuple):
        _, offset, shape, dtype = ref
        return slab.array(offset, shape, dtype)
    return ref


def payload_to_wire(
    payload: Payload, slab: Slab | None, regions: list[tuple[int, int]]
) -> dict[str, Any]:
    """The payload's fields, its arrays moved into the slab."""
    wire = {name: getattr(payload, name) for name in PAYLOAD_FIELDS}
    for name in ARRAYS:
        if wire[name] is not None:
            wire[name] = put(slab, wire[name], regions)
    return wire


def payload_from_wire(wire: dict[str, Any], slab: Slab) -> Payload:
    """The engine's Payload: its arrays are views of the front-end's slab."""
    values = dict(wire)
    for name in ARRAYS:
        values[name] = get(slab, values[name])
    return Payload(**values)


def result_to_wire(slab: Slab, out: tuple[int, int] | None, result: Any) -> tuple:
    """A runner's result for one request: an array written into the request's output region
    when it fits, else the object itself (pickled; small: embeddings, logits, debug weights)."""
    if out is not None and isinstance(result, np.ndarray) and result.nbytes <= out[1]:
        view = slab.array(out[0], result.shape, result.dtype.str)
        np.copyto(view, result)
        return ("shm", result.shape, result.dtype.str)
    return ("obj", result)


def result_from_wire(slab: Slab | None, out: tuple[int, int] | None, reply: tuple) -> Any:
    """The result a front-end hands to its handler: its own copy (the region is freed next)."""
    if reply[0] == "shm":
        _, shape, dtype = reply
        return slab.array(out[0], shape, dtype).copy()
    return reply[1]


# The ServedModel attributes the routes read (metadata, limits, text kind); methods are not
# here: computing happens in the engine process.
VIEW_ATTRIBUTES = (
    "architecture", "config", "device", "dtype", "embed_dim", "kdim", "vdim", "num_heads",
    "num_layers", "precision", "is_cross_attention_capable", "max_seq_len", "vocab_size",
    "pooling", "info", "embedding_dim", "offers_sparse",
)  # fmt: skip


class ModelView:
    """A served model as a front-end sees it: its attributes as the engine process read them.
    Asking for anything else (a forward, the weights) is a bug: front-ends never compute."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    @classmethod
    def of(cls, model: Any) -> ModelView:
        values = {name: getattr(model, name) for name in VIEW_ATTRIBUTES if hasattr(model, name)}
        values["text_kind"] = text_kind(model)
        return cls(values)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"a worker front-end has no '{name}' of the model: it lives in the engine process "
            "(send the work through the batcher)"
        )


@dataclass
class EntryInfo:
    """One served model version, as the engine's welcome describes it to a front-end."""

    name: str
    version: str
    view: ModelView
    limits: Any  # service.oip.inputs.ModelLimits
    info: dict[str, Any]
    version_policy: dict[str, Any]
    max_batch_size: int
    max_batch_delay_s: float
    max_queue: int
