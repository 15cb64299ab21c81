"""The CUDA varlen route (mha_engine.cuda_varlen), run here on CPU: a reference kernel with the
CUDA kernels' signature stands in for them, so the plumbing (views of the fused projection,
heads layout, cu_seqlens, the longest length, the merge) is checked without a GPU. The real
kernels are checked by tests/gpu; unverified until a GPU run."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from mha_engine import cuda_varlen
from mha_engine.varlen import cumulative, make_plan, use_varlen
from tests.mha_engine.engine_helpers import engine_from, make_mha

LENGTHS = [5, 1, 9, 9, 3]
FP32 = {"atol": 1e-5, "rtol": 1.3e-6}


def reference_kernel(q, k, v, cu, max_len, causal):
    """What flash/efficient varlen compute, one sequence at a time: (N, H, hd) in and out."""
    bounds = cu.tolist()
    assert cu.dtype == torch.int32 and max_len == max(b - a for a, b in pairwise(bounds))
    out = torch.empty_like(q)
    for a, b in pairwise(bounds):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # (H, T, hd)
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1)
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_attention_equals_grouped_attention(causal):
    model = engine_from(make_mha(16, 2))
    attn = model.attn
    x = torch.randn(sum(LENGTHS), 16)
    plan = make_plan(LENGTHS, is_causal=causal)
    assert plan.cu_seqlens.dtype == torch.int32
    assert plan.cu_seqlens.tolist() == cumulative(LENGTHS)
    q, k, v = attn.split_qkv(attn.in_proj(x))  # views of one (N, 3E) projection
    merged = cuda_varlen.varlen_attention(
        q, k, v, plan.cu_seqlens, max(LENGTHS), attn.num_heads, attn.head_dim, causal,
        kernel=reference_kernel,
    )  # fmt: skip
    want = model.forward_packed(x, cumulative(LENGTHS), is_causal=causal)  # grouped SDPA here
    torch.testing.assert_close(attn.out_proj(merged), want, **FP32)


def test_route_is_chosen_for_plain_cuda_plans_only():
    """Plain self-attention on a CUDA tensor takes the varlen kernel; CPU tensors, causal or
    masked plans take the grouped path. A stand-in with is_cuda set plays the CUDA tensor."""
    attn = engine_from(make_mha(16, 2)).attn

    class OnCuda:
        is_cuda = True

    plain = make_plan(LENGTHS)
    assert use_varlen(attn, OnCuda(), plain)
    assert not use_varlen(attn, torch.randn(2, 16), plain)
    assert not use_varlen(attn, OnCuda(), make_plan(LENGTHS, is_causal=True))


def test_kernel_by_dtype():
    assert cuda_varlen.kernel_for(torch.float16) is cuda_varlen.flash_kernel
    assert cuda_varlen.kernel_for(torch.bfloat16) is cuda_varlen.flash_kernel
    assert cuda_varlen.kernel_for(torch.float32) is cuda_varlen.efficient_kernel
