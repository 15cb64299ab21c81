"""Packed variable-length attention on the CPU in one call per layer (cpu_varlen.c), exact.

The portable path runs one SDPA call per group of equal-length sequences, with a gather of
each group's rows before it and a scatter after: on a batch of short sentences that is 16
small calls per layer, each too small to use the threads (BENCHMARKS.md). cpu_varlen.c reads
Q, K and V straight from the packed projections with cu_seqlens, one task per (sequence,
head), spread over torch's OpenMP threads, and writes the merged heads in place. Each task
runs the same float32 code whatever its batch-mates and thread, so batch invariance stays
bit-exact; the numbers match PyTorch's SDPA to float32 rounding (about 1e-7), not bit for bit.

Prebuilt or built at first use (cbuild.py). Without either, or with
MHA_ENGINE_CPU_ATTENTION=sdpa, the grouped SDPA calls run instead. `kernel_status()` says which,
and why.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from . import cbuild
from .eager import eager_only

SOURCE = Path(__file__).with_name("cpu_varlen.c")
# fused multiply-adds wherever the compiler finds them; copy loops stay loops (no memcpy calls).
# Generic tuning on x86: -march=native on AMD Zen also tunes for it, and GCC's Zen tuning
# splits FMA chains into multiply and add (other rounding), so a Zen host's own build gave
# other bits than the x86-64-v3 library (up to 2e-6); the kernel ran no faster with it.
FLAGS = ("-ffp-contract=fast", "-fno-tree-loop-distribute-patterns") + (
    ("-mtune=generic",) if cbuild.is_x86_64() else ()
)
# Per CPU capability and dtype, sequences with more queries or keys than this keep the grouped
# SDPA calls, whose GEMM-based kernels (AMX for bf16) are faster on long ones. Measured with
# `python -m benchmarks.varlen_attention` (docs/benchmarks.md): with AVX-512 the kernel wins up
# to 128 tokens in fp32 and 48 in bf16 (AMX's bf16 SDPA); on an AVX2 CPU (AMD Zen 3) up to 32
# in fp32 and 64 in bf16 (torch's bf16 SDPA has no bf16 instructions there). Like every part of
# the choice (`modes`), it depends on the sequence alone, never on batch-mates.
MAX_LEN = {
    "AVX512": {torch.float32: 128, torch.bfloat16: 48},
    "AVX2": {torch.float32: 32, torch.bfloat16: 64},
    "other": {torch.float32: 32, torch.bfloat16: 32},
}


def max_len(dtype: torch.dtype) -> int:
    """The longest sequence (queries or keys) the kernel takes in this dtype on this CPU
    (0: none)."""
    return MAX_LEN.get(cbuild.level(), MAX_LEN["other"]).get(dtype, 0)


class _Library(cbuild.Bindings):
    """The C entry point, bound with ctypes (the call releases the GIL)."""

    openmp_probe = "mha_varlen_openmp"
    parallel_min = 1 << 18  # multiply-adds

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
        self.attention = lib.mha_varlen_attention
        self.attention.argtypes = [p, i64, p, i64, p, i64, p, i64, p, p, i64, i64, i64, i64]
        self.attention.argtypes += [f32, p, i32, i32, i64]
        self.attention.restype = ctypes.c_int


KERNEL = cbuild.Kernel(
    "CPU varlen attention",
    SOURCE,
    FLAGS,
    _Library,
    switch="MHA_ENGINE_CPU_ATTENTION",
    off="sdpa",
    fallback="grouped SDPA calls instead",
)


def kernel_status() -> str:
    """'compiled (cc -march=native -fopenmp)', or 'eager: <why>' (diagnostics, benchmarks)."""
    return KERNEL.status()


def modes(
    q_lens: list[int], kv_lens: list[int], causal: list[bool], masked: list[bool], limit: int
) -> list[int]:
    """Per sequence: 1 (attend to all keys) or 2 (causal) where the kernel takes it, else 0:
    more than `limit` queries or keys, a key mask that hides something, causal with fewer or
    more keys than queries, or queries without keys. Each depends on that sequence alone."""
    return [
        0 if t > limit or s > limit or m or (c and t != s) or (s == 0 and t > 0) else 1 + c
        for t, s, c, m in zip(q_lens, kv_lens, causal, masked, strict=True)
    ]


def usable(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """The kernel can read these projections: CPU, float32 or bfloat16, unit column stride
    (and it was built)."""
    return (
        q.device.type == "cpu"
        and max_len(q.dtype) > 0
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and KERNEL.library() is not None
    )


def _int32(cu: Tensor) -> Tensor:
    """cu as a contiguous int32 tensor (itself when it already is one: the plan's are)."""
    return cu if cu.dtype == torch.int32 and cu.is_contiguous() else cu.to(torch.int32).contiguous()


@eager_only
def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    cu_seqlens_k: Tensor | None,
    seq_modes: Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> Tensor:
    """softmax(Q K^T / sqrt(head_dim)) V per sequence, merged heads (N, H * head_dim), for the
    sequences whose mode (`modes`: (B,) uint8) is 1 or 2 (causal, top-left aligned like SDPA's);
    the rows of mode-0 sequences are left unset for the caller to fill.

    q (N, H * hd), k and v (M, Hkv * hd): packed rows (views into one fused projection are
    fine); cu_seqlens (B+1,) int32 of the queries, cu_seqlens_k of the keys (None: the same)."""
    lib = KERNEL.library()
    if lib is None:
        raise RuntimeError(f"CPU varlen attention is not available: {kernel_status()}")
    cu_q = _int32(cu_seqlens)
    cu_k = cu_q if cu_seqlens_k is None else _int32(cu_seqlens_k)
    out = q.new_empty(q.shape[0], num_heads * head_dim)  # (N, E) merged heads
    taken = seq_modes.tolist()
    pairs = [(t, s) for t, s, m in zip(q_lens, kv_lens, taken, strict=True) if m]
    macs = num_heads * head_dim * sum(t * s for t, s in pairs)
    threads = lib.threads(macs)
    failed = lib.attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        out.data_ptr(), out.stride(0), cu_q.data_ptr(), cu_k.data_ptr(), len(q_lens),
        num_heads, num_kv_heads, head_dim, head_dim**-0.5, seq_modes.data_ptr(),
        int(q.dtype == torch.bfloat16), threads, max((s for _, s in pairs), default=0),
    )  # fmt: skip
    if failed:
        raise MemoryError("CPU varlen attention: no memory for its scratch buffers")
    return out
