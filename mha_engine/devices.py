"""Where a model runs: the torch device and compute dtype, checked before any weight is read, so
a device this host lacks or a dtype it cannot run fails in one line that says what would work."""

from __future__ import annotations

import logging

import torch

from . import fused
from .errors import DeviceError
from .quantize import Int8Unsupported, int8_unsupported_reason

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INT8 = "int8"  # not a torch compute dtype: float32 weights quantized at load (quantize.py)
DEVICE_FORMS = "cpu, cuda or cuda:N"

log = logging.getLogger(__name__)
_slow_bf16_said = False


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device `device` names (None: cuda when available, else cpu), checked to exist here.

    Raises DeviceError for a malformed name, a device type other than cpu/cuda, CUDA on a host
    or build without it, or a CUDA ordinal past the host's devices.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise DeviceError(f"{device!r} is not a device name; use {DEVICE_FORMS}") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise DeviceError(f"device type {resolved.type!r} is not supported; use {DEVICE_FORMS}")
    if not torch.cuda.is_available():
        why = (
            f"this torch build ({torch.__version__}) has no CUDA"
            if torch.version.cuda is None
            else "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)"
        )
        raise DeviceError(f"{resolved} was asked for, but {why}; use cpu")
    count = torch.cuda.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise DeviceError(
            f"{resolved} does not exist: this host has {count} CUDA device(s), "
            f"cuda:0 to cuda:{count - 1}"
        )
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A torch floating dtype or one of the names float32 | bfloat16 | float16 (default float32)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise DeviceError(f"unsupported dtype {dtype}; use one of {list(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise DeviceError(f"unsupported dtype {dtype!r}; use one of {[*DTYPES, INT8]}")
    return DTYPES[dtype]


def resolve_precision(
    dtype: str | torch.dtype | None, device: torch.device
) -> tuple[torch.dtype, bool]:
    """(weights' dtype, quantize to int8?) for `dtype` on `device`: "int8" loads float32
    weights, then quantize_int8.

    Raises DeviceError (Int8Unsupported for int8) where the device or build cannot compute in it.
    """
    if dtype == INT8:
        reason = int8_unsupported_reason(device)
        if reason is not None:
            raise Int8Unsupported(reason)
        return torch.float32, True
    resolved = resolve_dtype(dtype)
    cuda = device.type == "cuda"
    if resolved == torch.bfloat16 and cuda and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise DeviceError(f"{device} ({name}) cannot compute in bfloat16; use float16")
    if resolved == torch.bfloat16 and device.type == "cpu":
        _say_slow_bf16()
    return resolved, False


def _say_slow_bf16() -> None:
    """Once per process: bf16 on a CPU without bf16 instructions is no faster than float32 (its
    GEMMs run as float32 or emulated; docs/engine-cpu.md), though it halves weight memory."""
    global _slow_bf16_said
    if fused.NATIVE_BF16 or _slow_bf16_said:
        return
    _slow_bf16_said = True
    log.warning(
        "bfloat16 on this CPU (%s), which has no bf16 instructions (AVX512-BF16 or AMX), is "
        "no faster than float32 and only halves weight memory; int8 is the faster precision",
        fused.cpu_capability(),
    )


def check_device(
    device: str | torch.device | None, dtype: str | torch.dtype | None = None
) -> tuple[torch.device, torch.dtype, bool]:
    """(device, weights' dtype, quantize to int8?) for a model to run with, or DeviceError naming
    what this host cannot do. Cheap: reads no weights, allocates nothing."""
    resolved = resolve_device(device)
    return (resolved, *resolve_precision(dtype, resolved))


def moved(
    tensor: torch.Tensor,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    non_blocking: bool = False,
) -> torch.Tensor:
    """tensor on `device` in `dtype` (None: as it is): the tensor itself, with no dispatch, when
    it already is. `.to()` returns it too, but through a dispatch, which costs host time per op
    on CUDA and the engine thread a GIL hand-off beside a busy event loop."""
    if (device is None or tensor.device == device) and (dtype is None or tensor.dtype == dtype):
        return tensor
    return tensor.to(device=device, dtype=dtype, non_blocking=non_blocking)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to CUDA from pinned memory without blocking the host, so the
    index tensors a forward builds from host lengths never stall it."""
    if device.type != "cuda":
        return moved(host, device)
    return host.pin_memory().to(device, non_blocking=True)
