"""The one table of Open Inference Protocol datatypes: wire name, numpy and torch dtypes, size.

BF16 has no numpy dtype: its raw bits travel as little-endian uint16 and are reinterpreted as
torch.bfloat16 on the way into the engine (and back). Every other module asks this table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Datatype:
    """One OIP datatype: how it is held in numpy (the wire layout) and in torch."""

    name: str  # OIP / Triton name, e.g. "FP32"
    numpy: np.dtype  # little-endian wire layout (BF16: its bits as uint16)
    torch: torch.dtype
    is_float: bool  # accepted as hidden states

    @property
    def itemsize(self) -> int:
        """Bytes per element on the wire."""
        return self.numpy.itemsize


DATATYPES: dict[str, Datatype] = {
    d.name: d
    for d in (
        Datatype("FP32", np.dtype("<f4"), torch.float32, True),
        Datatype("FP16", np.dtype("<f2"), torch.float16, True),
        Datatype("BF16", np.dtype("<u2"), torch.bfloat16, True),
        Datatype("FP64", np.dtype("<f8"), torch.float64, False),
        Datatype("BOOL", np.dtype("?"), torch.bool, False),
        Datatype("INT8", np.dtype("<i1"), torch.int8, False),
        Datatype("INT16", np.dtype("<i2"), torch.int16, False),
        Datatype("INT32", np.dtype("<i4"), torch.int32, False),
        Datatype("INT64", np.dtype("<i8"), torch.int64, False),
        Datatype("UINT8", np.dtype("<u1"), torch.uint8, False),
    )
}
# Named by the protocol but not decoded here: a request using one gets a 400 saying so.
UNSUPPORTED = frozenset({"UINT16", "UINT32", "UINT64", "BYTES"})
FLOAT_TYPES = tuple(name for name, d in DATATYPES.items() if d.is_float)  # FP32, FP16, BF16
BY_TORCH: dict[torch.dtype, str] = {d.torch: name for name, d in DATATYPES.items()}


def of_torch(dtype: torch.dtype) -> str:
    """The OIP name of a torch dtype (a model's compute dtype -> its metadata datatype)."""
    return BY_TORCH[dtype]


def to_torch(array: np.ndarray, datatype: str, device: torch.device, dtype: torch.dtype):
    """A wire array as a tensor on `device` in `dtype` (no copy when both already match and the
    array is writable; a read-only view of a request body is copied first)."""
    tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    if datatype == "BF16":
        tensor = tensor.view(torch.bfloat16)
    return tensor.to(device=device, dtype=dtype, non_blocking=True)


def to_numpy(tensor: torch.Tensor, datatype: str) -> np.ndarray:
    """A tensor in the wire layout of `datatype` on the CPU (BF16 as uint16 bits)."""
    tensor = tensor.to(dtype=DATATYPES[datatype].torch).cpu().contiguous()
    if datatype == "BF16":
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def bf16_from_floats(values: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 bits (round to nearest even), as uint16."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    return (rounded >> 16).astype(np.uint16)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bits (uint16) to float32 values; exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)
