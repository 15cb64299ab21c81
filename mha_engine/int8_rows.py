"""The per-row passes around Int8Linear's GEMM as compiled C (int8_rows.c), with eager fallback.

Each int8 linear quantizes its input rows and rescales its output rows. As eager torch ops that
is about nine passes over the batch, and they took as long as the int8 GEMMs themselves on
MiniLM (BENCHMARKS.md, "int8 row kernels"). int8_rows.c does the same float32 operations in the
same order, one row at a time while the row is in cache: bit-identical results, fewer passes.

It is loaded prebuilt or compiled at first use (cbuild.py: the host's `cc -march=native`,
about 0.3 s per process, nothing cached on disk). Without a compiler, or with
MHA_ENGINE_INT8_KERNEL=eager, the eager torch ops run instead: same numbers, slower.
`kernel_status()` says which, and why; model diagnostics report it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from . import cbuild

SOURCE = Path(__file__).with_name("int8_rows.c")
# no fused multiply-adds beyond the explicit fmaf calls (bit-exact with eager)
FLAGS = ("-ffp-contract=off",)
TINY = torch.finfo(torch.float32).tiny
# below this many elements a pass runs on one thread
PARALLEL_MIN = 1 << 16
# torch's vectorised addcmul fuses y * scale + bias into one rounding on AVX2 / AVX-512; its
# DEFAULT kernels round the product first. The C epilogue follows whichever runs here.
FUSED_MULTIPLY_ADD = int(torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


class _Library(cbuild.Bindings):
    """The two C functions, bound with ctypes (each call releases the GIL)."""

    openmp_probe = "mha_int8_openmp"
    parallel_min = PARALLEL_MIN  # elements

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        self.quantize_rows = lib.mha_int8_quantize_rows
        self.quantize_rows.argtypes = [p, i64, i64, i64, i32, p, p, p, i32]
        self.quantize_rows.restype = None
        self.epilogue = lib.mha_int8_epilogue
        self.epilogue.argtypes = [p, i64, i64, p, p, p, p, p, i64, i32, i32]
        self.epilogue.restype = None


KERNEL = cbuild.Kernel(
    "int8 row kernels",
    SOURCE,
    FLAGS,
    _Library,
    switch="MHA_ENGINE_INT8_KERNEL",
    off="eager",
    fallback="same numbers, slower int8",
)


def kernel_status() -> str:
    """'compiled (cc -march=native)', or 'eager: <why>' (diagnostics, benchmarks, logs)."""
    return KERNEL.status()


def quantize_rows(x: Tensor, levels: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows x (N, K) float32 as uint8 q in [1, 2 * levels + 1], scales (N,) and midpoints (N,):
    x ~ scale * (q - (levels + 1)) + mid per row. Compiled where available, else eager."""
    lib = KERNEL.library()
    if lib is None or not _f32_cpu(x) or x.dim() != 2 or x.shape[1] == 0:
        return _quantize_rows_eager(x, levels)
    if x.stride(-1) != 1:
        x = x.contiguous()
    n, k = x.shape
    q = torch.empty(n, k, dtype=torch.uint8)
    scale, mid = torch.empty(n), torch.empty(n)
    lib.quantize_rows(
        x.data_ptr(), n, k, x.stride(0), levels, q.data_ptr(), scale.data_ptr(), mid.data_ptr(),
        lib.threads(n * k),
    )  # fmt: skip
    return q, scale, mid


def rescale_rows(
    y: Tensor,
    scale: Tensor,
    mid: Tensor,
    bias: Tensor | None,
    weight_sums: Tensor,
    residual: Tensor | None = None,
) -> Tensor:
    """In place on the GEMM output y (N, M): y * scale + bias + mid * weight_sums (+ residual),
    per row; returns y. Compiled where available, else eager (the same bits)."""
    lib = KERNEL.library()
    dense = (y, scale, mid, weight_sums) if bias is None else (y, scale, mid, weight_sums, bias)
    if (
        lib is None
        or not all(_f32_cpu(t) and t.is_contiguous() for t in dense)
        or y.dim() != 2
        or scale.shape != (y.shape[0],)
        or mid.shape != scale.shape
        or weight_sums.shape != (y.shape[1],)
        or (bias is not None and bias.shape != weight_sums.shape)
        or (residual is not None and residual.shape != y.shape)
    ):  # the C code reads exactly these extents: anything else (broadcasts) goes the eager way
        return _rescale_rows_eager(y, scale, mid, bias, weight_sums, residual)
    if residual is not None and not (_f32_cpu(residual) and residual.stride(-1) == 1):
        residual = residual.float().contiguous()
    n, m = y.shape
    lib.epilogue(
        y.data_ptr(), n, m, scale.data_ptr(), mid.data_ptr(),
        None if bias is None else bias.data_ptr(), weight_sums.data_ptr(),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), FUSED_MULTIPLY_ADD, lib.threads(n * m),
    )  # fmt: skip
    return y


def _f32_cpu(t: Tensor) -> bool:
    """What the C code reads: float32 in CPU memory (callers check the strides)."""
    return t.dtype == torch.float32 and t.is_cpu


def _quantize_rows_eager(x: Tensor, levels: int) -> tuple[Tensor, Tensor, Tensor]:
    """The reference: elementwise ops and exact min/max, each value computed the same way in
    any batch. float -> int8 is a fast vectorised cast where float -> uint8 is not (0.35 ms
    against 0.04 ms at 446 x 1536), hence the detour through int8 bytes."""
    lo, hi = x.amin(dim=1), x.amax(dim=1)  # (N,) exact
    mid = (hi + lo).mul_(0.5)  # (N,)
    scale = (hi - lo).div_(2 * levels).clamp_(min=TINY)  # (N,)
    t = x.sub(mid[:, None]).mul_(scale.reciprocal()[:, None])  # (N, K) in [-levels, levels]
    q = t.round_().to(torch.int8).view(torch.uint8)  # two's complement bytes of round(t)
    return q.add_(levels + 1), scale, mid  # wraps to round(t) + zero point, no overflow


def _rescale_rows_eager(
    y: Tensor,
    scale: Tensor,
    mid: Tensor,
    bias: Tensor | None,
    weight_sums: Tensor,
    residual: Tensor | None,
) -> Tensor:
    if bias is None:
        y.mul_(scale[:, None])
    else:
        torch.addcmul(bias, y, scale[:, None], out=y)  # one pass: y * scale + bias
    y.addcmul_(mid[:, None], weight_sums)  # + mid * sums (addcmul: fused multiply-adds
    # in every column; addr_'s scalar tail past the last full vector rounds the product first)
    return y if residual is None else y.add_(residual)
