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
from mha_engine.packed_attention import use_varlen
from mha_engine.varlen import cumulative, make_plan
from tests.mha_engine.engine_helpers import engine_from, make_mha

LENGTHS = [5, 1, 9, 9, 3]
FP32 = {"atol": 1e-5, "rtol": 1.3e-6}


def reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    """What flash/efficient varlen compute, one sequence at a time: q (N, H, hd), k/v
    (M, Hkv, hd) in, (N, H, hd) out."""
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    assert cu_q.dtype == cu_k.dtype == torch.int32
    assert max_q == max(b - a for a, b in pairwise(bounds_q))
    assert max_k == max(b - a for a, b in pairwise(bounds_k))
    out = torch.empty_like(q)
    gqa = k.shape[1] != q.shape[1]
    for (a, b), (c, d) in zip(pairwise(bounds_q), pairwise(bounds_k), strict=True):
        qs = q[a:b].transpose(0, 1)  # (H, T, hd)
        ks, vs = (t[c:d].transpose(0, 1) for t in (k, v))  # (Hkv, S, hd)
        y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)
        out[a:b] = y.transpose(0, 1)
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


def test_cross_attention_and_gqa_through_the_kernel_equal_grouped_attention():
    """Keys of other lengths (cu_seqlens_k) and fewer K/V heads: the kernel's plumbing against
    the engine's grouped path."""
    torch.manual_seed(0)
    kv_lens = [7, 2, 4, 9, 1]
    for gqa in (False, True):
        module = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
        model = engine_from(module)
        if gqa:  # the same block with 2 K/V heads
            from mha_engine.checkpoint import model_from_state_dict
            from mha_engine.save import module_config, module_state

            config = {**module_config(module), "num_kv_heads": 2}
            state = {k: v.clone() for k, v in module_state(module).items()}
            state["in_proj_weight"] = state["in_proj_weight"][: 16 + 2 * 8]
            state["in_proj_bias"] = state["in_proj_bias"][: 16 + 2 * 8]
            model = model_from_state_dict(config, state, "cpu", "float32")
        attn = model.attn
        x, mem = torch.randn(sum(LENGTHS), 16), torch.randn(sum(kv_lens), 16)
        plan = make_plan(LENGTHS, kv_lens)
        assert (
            plan.varlen_ok and not plan.plain and plan.cu_seqlens_k.tolist() == cumulative(kv_lens)
        )
        q, k, v = attn.project(x, mem, mem)
        merged = cuda_varlen.varlen_attention(
            q, k, v, plan.cu_seqlens, max(LENGTHS), attn.num_heads, attn.head_dim,
            kernel=reference_kernel, cu_seqlens_k=plan.cu_seqlens_k, max_len_k=max(kv_lens),
        )  # fmt: skip
        want = model.forward_packed(x, cumulative(LENGTHS), mem, mem, cumulative(kv_lens))
        # int64 offsets (a library caller's) go to the kernel as int32, the keys' too
        as_int64 = cuda_varlen.varlen_attention(
            q, k, v, plan.cu_seqlens.long(), max(LENGTHS), attn.num_heads, attn.head_dim,
            kernel=reference_kernel, cu_seqlens_k=plan.cu_seqlens_k.long(),
            max_len_k=max(kv_lens),
        )  # fmt: skip
        torch.testing.assert_close(as_int64, merged, atol=0, rtol=0)
        torch.testing.assert_close(attn.out_proj(merged), want, **FP32)


def test_route_is_chosen_for_plans_one_call_can_do():
    """On a CUDA tensor the varlen kernel takes unmasked plans with one causal flag (causal on
    square sequences only); CPU tensors, masks, mixed flags and fp32 GQA take the groups. A
    stand-in with is_cuda and dtype plays the CUDA tensor."""
    attn = engine_from(make_mha(16, 2)).attn

    class OnCuda:
        is_cuda = True
        dtype = torch.float32

    plain = make_plan(LENGTHS)
    assert use_varlen(attn, OnCuda(), plain)
    assert not use_varlen(attn, torch.randn(2, 16), plain)
    causal = make_plan(LENGTHS, is_causal=True)
    assert use_varlen(attn, OnCuda(), causal) and causal.causal and not causal.plain
    mixed = make_plan(LENGTHS, is_causal=[True, False, True, True, True])
    assert not use_varlen(attn, OnCuda(), mixed)
    assert use_varlen(attn, OnCuda(), make_plan(LENGTHS, [2, 2, 2, 2, 2]))  # cross-attention
    assert not use_varlen(attn, OnCuda(), make_plan(LENGTHS, [2, 2, 2, 2, 2], is_causal=True))
    mask = torch.zeros(sum(LENGTHS), dtype=torch.bool)
    assert use_varlen(attn, OnCuda(), make_plan(LENGTHS, key_padding_mask=mask))  # hides nothing
    mask[2] = True
    assert not use_varlen(attn, OnCuda(), make_plan(LENGTHS, key_padding_mask=mask))


def test_gqa_with_an_empty_query_sequence_takes_the_groups():
    """flash's GQA path for one-row queries reshapes them to one row per sequence, which an
    empty sequence breaks: such a plan takes the grouped path; without it, the kernel."""
    from mha_engine.checkpoint import model_from_state_dict
    from mha_engine.save import module_config, module_state

    module = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()  # head_dim 8
    config = {**module_config(module), "num_kv_heads": 2}
    state = {k: v.clone() for k, v in module_state(module).items()}
    state["in_proj_weight"] = state["in_proj_weight"][: 32 + 2 * 16]
    state["in_proj_bias"] = state["in_proj_bias"][: 32 + 2 * 16]
    attn = model_from_state_dict(config, state, "cpu", "float32").attn
    assert attn.is_gqa and attn.head_dim == 8

    class OnCuda:
        is_cuda = True
        dtype = torch.float16

    assert use_varlen(attn, OnCuda(), make_plan([1, 1, 1]))
    assert not use_varlen(attn, OnCuda(), make_plan([0, 1, 1]))
    assert use_varlen(engine_from(make_mha(32, 4)).attn, OnCuda(), make_plan([0, 1, 1]))


def test_kernel_by_dtype():
    assert cuda_varlen.kernel_for(torch.float16) is cuda_varlen.flash_kernel
    assert cuda_varlen.kernel_for(torch.bfloat16) is cuda_varlen.flash_kernel
    assert cuda_varlen.kernel_for(torch.float32) is cuda_varlen.efficient_kernel
