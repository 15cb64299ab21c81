"""Packed self-attention on CUDA in one varlen kernel call, with no nested tensors and no host
sync: q, k, v stay (N, heads, head_dim) views of the fused projection, cu_seqlens go to the
device as int32 with the batch, and the longest length comes from the host plan.

The kernels are PyTorch's own: flash-attention for float16/bfloat16 and the memory-efficient one
for float32 (flash has no fp32). Unverified on a GPU: the machines this was written on have none,
so the CPU tests run `varlen_attention` with a reference kernel of the same signature standing in
for the CUDA one (tests/mha_engine/test_cuda_varlen.py); tests/gpu checks the real kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# (q (N, H, hd), k (N, Hkv, hd), v (N, Hkv, hd), cu_seqlens (B+1,) int32, max_len, is_causal)
#   -> out (N, H, hd)
VarlenKernel = Callable[[Tensor, Tensor, Tensor, Tensor, int, bool], Tensor]


def flash_kernel(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, causal: bool) -> Tensor:
    """flash-attention's varlen forward (fp16/bf16): every sequence against its own keys."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, causal, False
    )
    return out[0]  # (N, H, hd)


def efficient_kernel(
    q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, causal: bool
) -> Tensor:
    """The memory-efficient varlen forward (fp32 too); it wants a batch dimension of 1."""
    mask_type = 1 if causal else 0  # 1: causal from the top-left, as SDPA's is_causal
    out = torch.ops.aten._efficient_attention_forward(
        q[None], k[None], v[None], None, cu, cu, max_len, max_len, 0.0, mask_type, False
    )
    return out[0][0]  # (N, H, hd)


def kernel_for(dtype: torch.dtype) -> VarlenKernel:
    """flash where it applies (half precisions), else memory-efficient."""
    return flash_kernel if dtype in (torch.float16, torch.bfloat16) else efficient_kernel


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
) -> Tensor:
    """Merged heads (N, H*hd) of packed self-attention: q (N, H*hd), k and v (N, Hkv*hd) split at
    cu_seqlens (B+1,) on the device; `max_len` the longest sequence (known on the host)."""
    N = q.shape[0]
    heads_kv = k.shape[1] // head_dim
    kernel = kernel or kernel_for(q.dtype)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    out = kernel(
        q.view(N, num_heads, head_dim),  # (N, H, hd): a view of the fused projection
        k.view(N, heads_kv, head_dim),
        v.view(N, heads_kv, head_dim),
        cu,
        max_len,
        is_causal,
    )
    return out.reshape(N, num_heads * head_dim)  # (N, E)
