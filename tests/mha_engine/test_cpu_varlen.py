"""cpu_varlen.c: packed attention in one call per layer, against PyTorch's SDPA per sequence,
bit-exact batch invariance (threads, batch-mates, order), per-sequence routing, fallbacks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import engine_from
from torch import nn

from mha_engine import cbuild, cpu_varlen, packed_attention
from mha_engine.varlen import cumulative, make_plan

EXACT = {"atol": 1e-5, "rtol": 1.3e-6}
# bf16 inputs and outputs, float32 inside: measured max |error| against float32 SDPA on the
# same (bf16-rounded) inputs was 0.0078 (one bf16 step at |y| < 2), PyTorch's bf16 SDPA's own
# error was the same size; outputs here stay below 4.
BF16 = {"atol": 1.6e-2, "rtol": 1e-2}

compiled = pytest.mark.skipif(
    not cpu_varlen.kernel_status().startswith("compiled"),
    reason=f"no compiled kernel here: {cpu_varlen.kernel_status()}",
)
pytestmark = compiled


def reference(q, k, v, q_lens, kv_lens, H, Hkv, D, causal):
    """SDPA per sequence, float32: what each sequence's rows must be."""
    outs, a, b = [], 0, 0
    for t, s, c in zip(q_lens, kv_lens, causal, strict=True):
        qq = q[a : a + t].float().view(1, t, H, D).transpose(1, 2)
        kk = k[b : b + s].float().view(1, s, Hkv, D).transpose(1, 2)
        vv = v[b : b + s].float().view(1, s, Hkv, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=c, enable_gqa=Hkv != H)
        outs.append(y.transpose(1, 2).reshape(t, H * D))
        a, b = a + t, b + s
    return torch.cat(outs)


def run(q, k, v, q_lens, kv_lens, H, Hkv, D, causal):
    """The kernel on every sequence (each mode 1 or 2)."""
    masked = [False] * len(q_lens)
    modes = torch.tensor(cpu_varlen.modes(q_lens, kv_lens, causal, masked, 64))
    assert modes.all(), "the test's sequences must all be the kernel's"
    cu, cu_k = (torch.tensor(cumulative(n), dtype=torch.int32) for n in (q_lens, kv_lens))
    return cpu_varlen.varlen_attention(
        q, k, v, cu, cu_k, modes.to(torch.uint8), q_lens, kv_lens, H, Hkv, D
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("H", "Hkv", "D"), [(12, 12, 32), (4, 4, 64), (4, 2, 24), (3, 3, 5)])
@pytest.mark.parametrize("kind", ["self", "causal", "cross"])
def test_matches_sdpa_per_sequence(dtype, H, Hkv, D, kind):
    torch.manual_seed(H * D)
    q_lens = [1, 5, 17, 33, 64, 3, 16]
    kv_lens = [2, 5, 9, 40, 64, 1, 20] if kind == "cross" else q_lens
    causal = [kind == "causal"] * len(q_lens)
    E, KV = H * D, Hkv * D
    qkv = (torch.randn(sum(q_lens), E + 2 * KV) * 2).to(dtype)  # one fused projection
    q, k, v = qkv[:, :E], qkv[:, E : E + KV], qkv[:, E + KV :]
    if kind == "cross":
        kv = (torch.randn(sum(kv_lens), 2 * KV) * 2).to(dtype)
        k, v = kv[:, :KV], kv[:, KV:]
    got = run(q, k, v, q_lens, kv_lens, H, Hkv, D, causal)
    want = reference(q, k, v, q_lens, kv_lens, H, Hkv, D, causal)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **(EXACT if dtype == torch.float32 else BF16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_sequence_has_the_same_bits_alone_in_any_batch_and_on_any_thread_count(dtype):
    rng = random.Random(3)
    torch.manual_seed(3)
    H, D = 6, 32
    lens = [rng.randint(1, 64) for _ in range(24)]
    causal = [rng.random() < 0.5 for _ in lens]
    x = (torch.randn(sum(lens), 3 * H * D)).to(dtype)
    parts = list(x.split(lens))
    threads = torch.get_num_threads()

    def attend(seqs, flags, n_threads):
        torch.set_num_threads(n_threads)
        try:
            packed = torch.cat(seqs)
            q, k, v = packed.split(H * D, dim=1)
            n = [len(s) for s in seqs]
            return run(q, k, v, n, n, H, H, D, flags).split(n)
        finally:
            torch.set_num_threads(threads)

    batch = attend(parts, causal, 2)
    assert all(torch.equal(a, b) for a, b in zip(batch, attend(parts, causal, 1), strict=True))
    for i in (0, 7, 23):
        alone = attend([parts[i]], [causal[i]], 2)[0]
        assert torch.equal(alone, batch[i]), f"sequence {i} differs alone"
    backwards = attend(parts[::-1], causal[::-1], 2)[::-1]
    assert all(torch.equal(a, b) for a, b in zip(batch, backwards, strict=True))


def test_modes_decide_per_sequence():
    M = 20
    got = cpu_varlen.modes(
        [3, M, M + 1, 4, 5, 5, 4, 0],
        [3, M, 3, 4, 6, 5, 0, 0],
        [False, True, False, False, True, False, False, False],
        [False, False, False, True, False, False, False, False],
        M,
    )
    # long; masked; causal over a different key count; queries without keys -> grouped SDPA
    assert got == [1, 2, 0, 0, 0, 1, 0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_masked_and_short_sequences_together_match_each_alone(dtype):
    """A model batch mixing kernel sequences with grouped ones (too long, masked): every
    sequence the same bits as alone, and PyTorch's numbers."""
    torch.manual_seed(5)
    torch_mha = nn.MultiheadAttention(48, 4, batch_first=True)
    model = engine_from(torch_mha, dtype)
    limit = cpu_varlen.max_len(dtype)
    lens = [7, limit + 9, 12, 7, 1, limit]
    seqs = [torch.randn(n, 48).to(dtype) for n in lens]
    masks = [None] * len(lens)
    masks[3] = torch.tensor([False] * 5 + [True] * 2)  # hides keys: grouped SDPA
    batch = model.forward_varlen(seqs, key_padding_mask=masks)
    for i, (x, m) in enumerate(zip(seqs, masks, strict=True)):
        alone = model.forward_varlen([x], key_padding_mask=[m])[0]
        assert torch.equal(alone, batch[i]), f"sequence {i} differs alone"
        kpm = None if m is None else m[None]
        want, _ = torch_mha(*[x[None].float()] * 3, key_padding_mask=kpm, need_weights=False)
        tol = EXACT if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
        torch.testing.assert_close(batch[i].float(), want[0], **tol)


def test_a_nan_stays_in_its_own_row_and_sequence():
    """A NaN query gives its own row NaN (PyTorch's CPU SDPA gives a finite row there); an
    infinite key the rows whose scores it makes +inf, as SDPA does; the rest keep SDPA's
    numbers, and other sequences never see either."""
    torch.manual_seed(1)
    H, D, lens = 2, 8, [4, 6, 3]
    x = torch.randn(sum(lens), 3 * H * D)
    x[5, 3] = float("nan")  # a query of sequence 1, head 0
    x[10, H * D] = float("inf")  # a key of sequence 2, head 0
    q, k, v = x.split(H * D, dim=1)
    got = run(q, k, v, lens, lens, H, H, D, [False] * 3)
    want = reference(q, k, v, lens, lens, H, H, D, [False] * 3)
    nan_rows = got.isnan().any(dim=1).nonzero().squeeze(1).tolist()
    assert nan_rows == [5, *want.isnan().any(dim=1).nonzero().squeeze(1).tolist()] == [5, 11]
    assert got[5, :D].isnan().all() and got[5, D:].isfinite().all()  # head 1 of that row: fine
    finite = ~got.isnan()
    torch.testing.assert_close(got[finite], want[finite], **EXACT)


def test_the_grouped_sdpa_switch_and_the_fallback(monkeypatch):
    """MHA_ENGINE_CPU_ATTENTION=sdpa runs the grouped SDPA calls (diagnostics say so); both
    paths give PyTorch's numbers."""
    torch.manual_seed(2)
    model = engine_from(nn.MultiheadAttention(32, 4, batch_first=True))
    lens = [3, 9, 9, 20]
    x = torch.randn(sum(lens), 32)
    calls = []
    real = packed_attention.grouped_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(packed_attention, "grouped_attention", counting)
    kernel = model.forward_packed(x, cumulative(lens))
    assert not calls
    assert "varlen attention kernel compiled" in model.diagnostics()["engine_path"]
    monkeypatch.setenv("MHA_ENGINE_CPU_ATTENTION", "sdpa")
    grouped = model.forward_packed(x, cumulative(lens))
    assert calls
    assert cpu_varlen.kernel_status() == "eager: MHA_ENGINE_CPU_ATTENTION=sdpa"
    assert "scaled_dot_product_attention (varlen" in model.diagnostics()["engine_path"]
    torch.testing.assert_close(kernel, grouped, **EXACT)


def test_without_a_compiler_the_build_says_why(monkeypatch):
    monkeypatch.setenv("CC", "false")
    library, status = cbuild.build(cpu_varlen.SOURCE, ("-ffp-contract=fast",), (("-fopenmp",), ()))
    assert library is None
    assert status.startswith("eager: false failed to build cpu_varlen.c")


def test_a_plan_builds_groups_only_for_the_sequences_the_kernel_leaves():
    plan = make_plan([5, 5, 30, 3])
    modes, others = plan.cpu_split(20)
    assert modes.tolist() == [1, 1, 0, 1]
    assert [(g.tgt_len, g.size) for g in others] == [(30, 1)]
    assert plan.cpu_split(2)[0] is None and len(plan.cpu_split(2)[1]) == 3
    assert plan.cpu_split(64)[1] == []
    assert plan.num_sdpa_calls == 3  # the grouped path's plan is unchanged


def test_the_length_limits_follow_the_cpu_capability(monkeypatch):
    """AVX-512 builds take longer sequences than AVX2 / SSE builds (benchmarks.varlen_attention
    measured where SDPA overtakes each); float16 never goes to the kernel."""
    monkeypatch.setattr(cbuild, "level", lambda: "AVX512")
    assert [cpu_varlen.max_len(t) for t in (torch.float32, torch.bfloat16)] == [128, 48]
    monkeypatch.setattr(cbuild, "level", lambda: "AVX2")
    assert [cpu_varlen.max_len(t) for t in (torch.float32, torch.bfloat16)] == [32, 64]
    monkeypatch.setattr(cbuild, "level", lambda: "DEFAULT")
    assert [cpu_varlen.max_len(t) for t in (torch.float32, torch.bfloat16)] == [32, 32]
    assert cpu_varlen.max_len(torch.float16) == 0
