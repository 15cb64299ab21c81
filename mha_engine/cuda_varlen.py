"""Packed attention on CUDA in one varlen kernel call, with no nested tensors and no host sync:
q, k, v stay (tokens, heads, head_dim) views of the projections, cu_seqlens (and cu_seqlens_k
for cross-attention) go to the device as int32 with the batch, and the longest lengths come from
the host plan. Causal (every sequence, equal query and key lengths) and GQA (flash only) too.

The kernels are PyTorch's own: flash-attention for float16/bfloat16 and the memory-efficient one
for float32 (flash has no fp32). The CPU tests run `varlen_attention` with a reference kernel of
the same signature (tests/mha_engine/test_cuda_varlen.py); tests/gpu checks the real kernels on a
GPU (passed on an H100).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# (q (N, H, hd), k (M, Hkv, hd), v (M, Hkv, hd), cu_q (B+1,) int32, cu_k (B+1,) int32,
#  max_q, max_k, is_causal) -> out (N, H, hd)
VarlenKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, bool], Tensor]


def flash_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
) -> Tensor:
    """flash-attention's varlen forward (fp16/bf16): every sequence against its own keys; K/V
    may have fewer heads than Q (GQA)."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False
    )
    return out[0]  # (N, H, hd)


def efficient_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
) -> Tensor:
    """The memory-efficient varlen forward (fp32 too); it wants a batch dimension of 1 and as
    many K/V heads as Q heads."""
    mask_type = 1 if causal else 0  # 1: causal from the top-left, as SDPA's is_causal
    out = torch.ops.aten._efficient_attention_forward(
        q[None], k[None], v[None], None, cu_q, cu_k, max_q, max_k, 0.0, mask_type, False
    )
    return out[0][0]  # (N, H, hd)


def kernel_for(dtype: torch.dtype) -> VarlenKernel:
    """flash where it applies (half precisions), else memory-efficient."""
    return flash_kernel if dtype in (torch.float16, torch.bfloat16) else efficient_kernel


def _int32(cu: Tensor) -> Tensor:
    return cu if cu.dtype == torch.int32 else cu.to(torch.int32)


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_len: int,
    num_heads: int,
    head_dim: int,
    is_causal: bool = False,
    kernel: VarlenKernel | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_len_k: int | None = None,
) -> Tensor:
    """Merged heads (N, H*hd) of packed attention: q (N, H*hd) split at cu_seqlens (B+1,), k and
    v (M, Hkv*hd) split at cu_seqlens_k (default: cu_seqlens, self-attention), both on the
    device; the longest lengths come from the host."""
    N, M = q.shape[0], k.shape[0]
    heads_kv = k.shape[1] // head_dim
    kernel = kernel or kernel_for(q.dtype)
    cu = _int32(cu_seqlens)  # the kernels refuse any other index type
    cu_k = cu if cu_seqlens_k is None else _int32(cu_seqlens_k)
    out = kernel(
        q.view(N, num_heads, head_dim),  # (N, H, hd): a view of the projection
        k.view(M, heads_kv, head_dim),  # (M, Hkv, hd)
        v.view(M, heads_kv, head_dim),
        cu,
        cu_k,
        max_len,
        max_len if max_len_k is None else max_len_k,
        is_causal,
    )
    return out.reshape(N, num_heads * head_dim)  # (N, E)
