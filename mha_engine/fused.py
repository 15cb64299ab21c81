"""Fused CPU linears: prepacked oneDNN weights, fused activation / residual, padded tiny batches.

`linear(module, x, activation, residual)` is what every engine layer calls for its projections
and feed-forward. On CPU, for float32 and bfloat16 nn.Linear weights, it runs oneDNN's linear
(`torch.ops.mkldnn._linear_pointwise`, the op Inductor lowers CPU linears to) on a weight
reordered once into oneDNN's blocked layout, with GELU/ReLU or the residual add fused into the
GEMM (bf16 only where oneDNN has bf16 kernels for the CPU: elsewhere bf16 linears run as
float32 GEMMs of the widened values). Measured on torch 2.13 (BENCHMARKS.md, "CPU engine"):
the fused GELU gives the same bits as F.gelu on the linear's output, the fused add the same bits
as a separate add. Small float32 weights (at most PLAIN_FP32_WEIGHT elements) take the plain
call instead: oneDNN's ~20-40 us per call costs more than the GEMM there. The choice depends on
the weight alone, never on the batch.

Batch invariance: a GEMM kernel may pick another code path for very few rows (MKL's fp32 sgemm
gives other bits for 1-3 rows on AMD EPYC, 1-15 on an AMX Xeon; oneDNN's for 1 row at
K=1536), so inputs with fewer than MIN_ROWS rows are padded with zero rows up to MIN_ROWS
and the padding cut off. On AMX CPUs oneDNN's bf16 kernel also changes with larger row counts,
so bf16 GEMMs there run in blocks of exactly AMX_BF16_BLOCK rows. A sequence then gets the
same bits alone or in any batch (tests/mha_engine/test_tiny_batch.py).

Anything else (int8 Linears, CUDA, autograd, torch.compile tracing, MHA_ENGINE_FUSED_CPU=0)
takes the plain module call, with the same row padding for float nn.Linear (none while
torch.compile / torch.export trace: compiled graphs pick their own kernels).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .quantize import Int8Linear

# Measured on torch 2.13 CPU (MKL sgemm, oneDNN fp32/bf16, AVX-512): a GEMM over few rows
# (MKL on AMD EPYC: 1-3, 5-7, 9-11 rows with 2 threads; MKL on an AMX Xeon: 1-15 rows; oneDNN
# prepacked: 1 row at K=1536) rounds differently from the same rows inside a larger GEMM; from
# 16 rows on, a row's bits do not depend on M there. The one threshold for every padding in the
# engine.
MIN_ROWS = 16
# bf16 on AMX (measured on a Sapphire Rapids-class Xeon, oneDNN in torch 2.13): at K >= 768
# the kernel's blocking depends on the row count M (1-32 rows, 33-387, 388 on, other regions
# with 2 threads and other shapes), and the bf16 rounding of some outputs flips with it (2 of 64
# MiniLM sentences differed alone and in an 892-token batch). With one M for every call a row's
# bits depend on nothing else (checked over shapes, positions, neighbours, 1 and 2 threads), so
# bf16 GEMMs there run in blocks of exactly AMX_BF16_BLOCK rows, the last padded: as fast as
# one call for MiniLM at 446 rows (0.94-1.01x; blocks of 32 were 0.48x).
AMX_BF16_BLOCK = 128
# float32 weights up to this many elements run as a plain F.linear (MKL): oneDNN's linear costs
# ~20-40 us per call beyond its GEMM; F.linear took 0.27-0.67x its time at 16 rows up to
# 128 x 384, 0.94-1.15x at 256 x 768 and up to 1.5x past it (`python -m benchmarks.small_layers`,
# docs/benchmarks.md "Small layers"). bf16 always prepacks where oneDNN has bf16 kernels: its
# plain call was 1.3-2x slower at every size measured. A per-module choice: every batch through
# a layer takes one path.
PLAIN_FP32_WEIGHT = 2**16
AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
# bf16 instructions (AVX512-BF16 dot products or AMX tiles): without them bf16 GEMMs run slower
# than float32 (docs/engine-cpu.md), and loading a bf16 model says so
NATIVE_BF16 = AMX or bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
# engine activation name -> (oneDNN post-op, its algorithm argument)
POST_OPS = {"relu": ("relu", ""), "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh")}
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact (erf), as nn.TransformerEncoderLayer and BERT's "gelu"
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # HF "gelu_new" / "gelu_pytorch_tanh"
    "silu": F.silu,  # SwiGLU's gate (NomicBERT)
}
# The same kernels writing into their input (same bits): for outputs nothing else holds. In
# place, int8's GELU ran ~13% faster end to end on MiniLM (no new 446 x 1536 buffer to fill).
INPLACE_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": torch.relu_,
    "gelu": torch.ops.aten.gelu_,
    "gelu_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "silu": lambda x: F.silu(x, inplace=True),
}

_packed: weakref.WeakKeyDictionary[nn.Linear, tuple[tuple, Tensor]] = (
    weakref.WeakKeyDictionary()
)  # module -> ((data_ptr, version, dtype), oneDNN weight); not in state_dict or deepcopy


def _onednn_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and ops is not None
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
    )


ONEDNN = _onednn_available()
# oneDNN's bf16 kernels need AVX-512 (bw, vl, dq) or AVX-NE-CONVERT: on an AVX2-only CPU its
# weight reorder raises, so bf16 weights there are not packed and run as float32 GEMMs of the
# widened values (_bf16_as_fp32: about float32's speed; torch's bf16 F.linear is 6-7x slower).
ONEDNN_BF16 = ONEDNN and bool(
    getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()
)


def fused_cpu_enabled() -> bool:
    """The prepacked oneDNN path is on (default) unless MHA_ENGINE_FUSED_CPU=0 turns it off."""
    return ONEDNN and os.environ.get("MHA_ENGINE_FUSED_CPU", "1") != "0"


def cpu_capability() -> str:
    """The vector ISA PyTorch's CPU kernels run with here (AVX512, AVX2, ...), plus the native
    bf16 / int8 / AMX instructions oneDNN can use: what diagnostics and benchmarks report."""
    cap = torch.backends.cpu.get_cpu_capability()
    probes = (
        ("avx512-bf16", "_is_avx512_bf16_supported"),
        ("vnni", "_is_vnni_supported"),
        ("amx", "_is_amx_tile_supported"),
        ("amx-fp16", "_is_amx_fp16_supported"),
    )
    extras = [name for name, fn in probes if getattr(torch.cpu, fn, lambda: False)()]
    return f"{cap} ({', '.join(extras)})" if extras else cap


def worth_packing(weight: Tensor) -> bool:
    """A CPU weight oneDNN runs faster than the plain call: bf16 (where oneDNN has bf16
    kernels), or float32 past PLAIN_FP32_WEIGHT elements."""
    dtype = weight.dtype
    return weight.is_cpu and (
        (dtype == torch.bfloat16 and ONEDNN_BF16)
        or (dtype == torch.float32 and weight.numel() > PLAIN_FP32_WEIGHT)
    )


def _packable(w: Tensor, x: Tensor) -> bool:
    """oneDNN takes this call: a CPU input of the weight's dtype, a weight worth packing, no
    autograd, no compile tracing, the path not turned off."""
    return (
        x.dtype == w.dtype
        and x.is_cpu
        and worth_packing(w)
        and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
        and not torch.compiler.is_compiling()
        and fused_cpu_enabled()
    )


def packed_weight(module: nn.Linear) -> Tensor:
    """The module's weight in oneDNN's layout, reordered once (again if the weight changes)."""
    w = module.weight
    try:
        version = w._version
    except RuntimeError:  # an inference tensor (made under inference_mode) tracks no version
        version = -1
    key = (w.data_ptr(), version, w.dtype)
    hit = _packed.get(module)
    if hit is not None and hit[0] == key:
        return hit[1]
    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
    _packed[module] = (key, packed)
    return packed


def prepack(model: nn.Module) -> nn.Module:
    """Reorder every CPU float Linear's weight for oneDNN now (load-time warm-up); returns it."""
    if fused_cpu_enabled():
        for module in model.modules():
            w = getattr(module, "weight", None)
            if isinstance(module, nn.Linear) and worth_packing(w):
                packed_weight(module)
    return model


def pad_rows(x: Tensor, rows: int = MIN_ROWS) -> Tensor:
    """x (N, ...) with zero rows appended up to `rows` (x itself when it has enough): per-token
    ops give the real rows the bits they get in any larger batch; callers slice [:N] back.
    CPU only: CUDA's jagged path needs exact rows (GPU GEMM invariance is unverified)."""
    if x.shape[0] >= rows or x.is_cuda:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])  # (rows, ...)


def _as_rows(x: Tensor, pad: bool) -> tuple[Tensor, int]:
    """x as (N', K) rows (x itself when it is 2-D), zero rows appended up to MIN_ROWS when pad
    and 0 < N < MIN_ROWS on CPU.

    Not while torch.compile / torch.export trace: a branch on N would specialise the graph.
    """
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (N, K)
    n = x2.shape[0]
    if pad and not torch.compiler.is_compiling() and 0 < n < MIN_ROWS and x2.is_cpu:
        x2 = torch.cat([x2, x2.new_zeros(MIN_ROWS - n, x2.shape[1])])  # (MIN_ROWS, K)
    return x2, n


def _back(y: Tensor, n: int, x: Tensor) -> Tensor:
    """The first n rows of y (N', M) in x's leading shape: (..., M)."""
    if y.shape[0] != n:
        y = y[:n]
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def _hooked(module: nn.Module) -> bool:
    """Forward hooks would run in module(x): on the module or global ones."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1]
    )


_GLOBAL_HOOKS = (
    getattr(nn.modules.module, "_global_forward_hooks", {}),
    getattr(nn.modules.module, "_global_forward_pre_hooks", {}),
)


def padded_gemm(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn (a row-wise GEMM) on x (..., K) with tiny batches padded (and bf16 rows in blocks on
    AMX, as `linear`); output (..., M)."""
    x2, n = _as_rows(x, pad=True)
    y = _rows(lambda xb, _: fn(xb), x2, None)  # (N', M)
    return _back(y, n, x)


def linear(
    module: nn.Module, x: Tensor, activation: str | None = None, residual: Tensor | None = None
) -> Tensor:
    """activation(module(x)) + residual, fused on CPU where it can be; any leading shape.

    Float nn.Linear inputs below MIN_ROWS rows are padded (exact batch invariance); other
    modules (Int8Linear: exact per row by construction) are called on the rows as they are.
    """
    pad = isinstance(module, nn.Linear)
    x2, n = _as_rows(x, pad)
    r2 = None if residual is None else _as_rows(residual, pad)[0]  # (N', M)
    if pad:
        w = module.weight
        if (activation is None or r2 is None) and _packable(w, x2):
            w = packed_weight(module)
            y = _rows(lambda xb, rb: _onednn_linear(module, w, xb, rb, activation), x2, r2)
            return _back(y, n, x)
        if type(module) is nn.Linear and not _hooked(module):
            # module(x) is exactly this F.linear: skip nn.Module's call
            gemm = plain_gemm(w, module.bias, x2)
        else:
            gemm = module
    else:
        gemm = module

    def plain(xb: Tensor, rb: Tensor | None) -> Tensor:
        if isinstance(module, Int8Linear):  # its output is its own: work on it in place
            if activation is None:
                return module(xb, rb)  # the add runs in the int8 epilogue (same bits)
            yb = INPLACE_ACTIVATIONS[activation](module(xb))  # (N', M)
            return yb if rb is None else yb.add_(rb)
        yb = gemm(xb)  # (N', M)
        if activation is not None:
            yb = ACTIVATIONS[activation](yb)
        return yb if rb is None else yb + rb

    y = _rows(plain, x2, r2) if pad else plain(x2, r2)
    return _back(y, n, x)


def plain_gemm(w: Tensor, b: Tensor | None, x: Tensor) -> Callable[[Tensor], Tensor]:
    """F.linear with weight w and bias b on rows like x; for bf16 on a CPU oneDNN has no bf16
    kernels for, as float32 GEMMs of the widened values (_bf16_as_fp32)."""
    if w.dtype == x.dtype == torch.bfloat16 and x.is_cpu and not ONEDNN_BF16:
        return partial(_bf16_as_fp32, w=w, b=b)
    return partial(F.linear, weight=w, bias=b)


def _bf16_as_fp32(xb: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """A bf16 GEMM where the CPU has no bf16 instructions: the bf16 values widened (exactly) to
    float32, float32's GEMM (float32 sums, as a bf16 kernel's), the result rounded to bf16.
    6-7x torch's bf16 F.linear on an AVX2 EPYC, 0.85-1.1x float32; the weights stay bf16 in
    memory (one float32 copy per call, freed after it)."""
    bias = None if b is None else b.float()
    return F.linear(xb.float(), w.float(), bias).to(torch.bfloat16)


def _onednn_linear(
    module: nn.Module, w: Tensor, x2: Tensor, r2: Tensor | None, activation: str | None
) -> Tensor:
    """oneDNN's linear on rows x2 (N, K) with the prepacked weight, fused post-op; (N, M)."""
    if r2 is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x2, r2, w, module.bias, "add")
    op, algorithm = POST_OPS[activation] if activation else ("none", "")
    return torch.ops.mkldnn._linear_pointwise(x2, w, module.bias, op, [], algorithm)


def _rows(fn: Callable[[Tensor, Tensor | None], Tensor], x2: Tensor, r2: Tensor | None) -> Tensor:
    """fn(rows, residual rows) on x2 (N, K): in one call, or for CPU bf16 on AMX in blocks of
    exactly AMX_BF16_BLOCK rows (the last padded with zero rows), so every call has the same
    row count and so the same kernel; (N, M)."""
    n = x2.shape[0]
    if not (AMX and x2.dtype == torch.bfloat16 and x2.is_cpu) or torch.compiler.is_compiling():
        return fn(x2, r2)
    out = []
    block = AMX_BF16_BLOCK
    for start in range(0, n, block):
        xb = pad_rows(x2[start : start + block], block)
        rb = None if r2 is None else pad_rows(r2[start : start + block], block)
        out.append(fn(xb, rb)[: min(block, n - start)])
    return out[0] if len(out) == 1 else torch.cat(out)  # (N, M)


def gated_linear(
    gate_up: nn.Module,
    down: nn.Module,
    x: Tensor,
    act: Callable[[Tensor], Tensor],
    residual: Tensor | None = None,
) -> Tensor:
    """A gated feed-forward, down(act(gate) * up) [+ residual], with [gate; up] = gate_up(x)
    (rows stacked in that order): Qwen3, the Llama family, Gemma 3, ModernBERT, NomicBERT/GTE
    and JinaBERT."""
    gate, up = linear(gate_up, x).chunk(2, dim=-1)  # (..., F) each
    return linear(down, act(gate) * up, residual=residual)
