"""Tiny packed batches (1-16 rows) give every sequence the bits it gets in a large batch.

GEMM kernels pick other code paths for very few rows (MKL's fp32 sgemm for 1-3 rows, and 5-7
and 9-11 with 2 threads on AMD EPYC, 1-15 on an AMX Xeon; oneDNN's for 1 row at K=1536);
mha_engine.fused pads each linear's input to MIN_ROWS rows (and models pad a whole packed
batch at entry). Shapes are MiniLM's (E=384, 6 heads, FFN 1536, GELU), in fp32, bf16 and
int8, with the fused oneDNN path on (default) and off (MHA_ENGINE_FUSED_CPU=0), at 1 thread,
2 and torch's default (the server's: one per core).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mha_engine
from mha_engine import fused
from tests.mha_engine.engine_helpers import FP32, engine_from, make_mha

E, HEADS, FFN = 384, 6, 1536
THREADS = sorted({1, 2, torch.get_num_threads()})


def _encoder(precision: str):
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(E, HEADS, FFN, 0.0, "gelu", batch_first=True)
    model = engine_from(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval())
    if precision == "int8":
        return mha_engine.quantize_int8(model)
    return model.to(dtype=getattr(torch, precision))


@pytest.fixture(params=[True, False], ids=["fused", "plain"])
def fused_path(request, monkeypatch):
    monkeypatch.setenv("MHA_ENGINE_FUSED_CPU", "1" if request.param else "0")
    return request.param


@pytest.fixture(params=THREADS, ids=lambda t: f"{t}threads")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int8"])
def test_tiny_packed_batches_match_a_large_batch(precision, fused_path, threads):
    model = _encoder(precision)
    dtype = torch.float32 if precision == "int8" else getattr(torch, precision)
    torch.manual_seed(5)
    tiny = [torch.randn(n, E, dtype=dtype) for n in range(1, 17)]
    filler = [torch.randn(n, E, dtype=dtype) for n in (40, 33, 57)]
    large = model.forward_varlen(filler + tiny)[len(filler) :]  # 130 + 136 rows
    for seq, want in zip(tiny, large, strict=True):  # packed batches of 1..16 rows
        assert torch.equal(model.forward_varlen([seq])[0], want), f"{len(seq)} rows"
    for group in ([0, 1], [0, 1, 2], [2, 4], [0, 0, 0, 0, 1]):  # several tiny sequences
        outs = model.forward_varlen([tiny[i] for i in group])
        for i, got in zip(group, outs, strict=True):
            assert torch.equal(got, large[i]), f"batch {group}, sequence of {i + 1} rows"


def test_tiny_batches_of_the_attention_block(fused_path, threads):
    """The MHA block alone: 1..16 packed rows against the same rows in a large batch."""
    model = engine_from(make_mha(E, HEADS))
    torch.manual_seed(6)
    seqs = [torch.randn(n, E) for n in range(1, 17)]
    large = model.forward_varlen([torch.randn(50, E), *seqs])[1:]
    for seq, want in zip(seqs, large, strict=True):
        assert torch.equal(model.forward_varlen([seq])[0], want), f"{len(seq)} rows"


def test_the_fused_path_matches_pytorch_and_the_plain_path(monkeypatch):
    """Prepacked oneDNN linears with fused GELU / residual stay within fp32 parity of PyTorch's
    own layer, and pack once per weight (again after the weight changes)."""
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(E, HEADS, FFN, 0.0, "gelu", batch_first=True).eval()
    model = engine_from(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False))
    x = torch.randn(2, 30, E)
    with torch.no_grad():
        want = layer(x)
    got = model(x)
    torch.testing.assert_close(got, want, **FP32)
    monkeypatch.setenv("MHA_ENGINE_FUSED_CPU", "0")
    torch.testing.assert_close(model(x), got, **FP32)
    linear1 = model.encoder.layers[0].linear1
    if fused.ONEDNN:
        first = fused.packed_weight(linear1)
        assert fused.packed_weight(linear1) is first
        with torch.no_grad():
            linear1.weight.mul_(1.0)  # in place: a new version, packed again
        assert fused.packed_weight(linear1) is not first


def test_cpu_capability_is_named():
    cap = fused.cpu_capability()
    assert cap.startswith(torch.backends.cpu.get_cpu_capability())


def test_weights_made_under_inference_mode_are_packed():
    """Inference tensors track no version counter: packing must not ask them for one."""
    with torch.inference_mode():
        model = _encoder("float32")
        x = torch.randn(20, E)
        got = model.forward_varlen([x])[0]
    assert torch.isfinite(got).all()
    if fused.ONEDNN:
        linear1 = model.encoder.layers[0].linear1
        assert fused.packed_weight(linear1) is fused.packed_weight(linear1)


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int8"])
def test_sequences_alone_match_a_large_batch(precision, threads):
    """Large batches too: on an AMX CPU oneDNN's bf16 kernel rounds differently past 32 and
    again past ~388 rows at K >= 768 (2 of 64 MiniLM sentences differed), so bf16 GEMMs there
    run in blocks of exactly fused.AMX_BF16_BLOCK rows (this test fails without them there).
    Sequences at several offsets of a 902-row batch against the same sequences alone, on the
    default (fused) path."""
    model = _encoder(precision)
    dtype = torch.float32 if precision == "int8" else getattr(torch, precision)
    torch.manual_seed(7)
    seqs = [torch.randn(n, E, dtype=dtype) for n in (23, 5, 57, 130, 9, 211, 33, 300, 64, 70)]
    batch = model.forward_varlen(seqs)  # 902 rows
    for i, (seq, want) in enumerate(zip(seqs, batch, strict=True)):
        assert torch.equal(model.forward_varlen([seq])[0], want), f"sequence {i}"


def test_small_float32_weights_take_the_plain_call_and_large_ones_prepack():
    """The path is chosen by the weight alone: a small float32 weight runs as F.linear (oneDNN's
    per-call cost exceeds its GEMM there), a large one and any bf16 one prepack (where oneDNN
    has bf16 kernels for the CPU)."""
    small, large = nn.Linear(64, 192), nn.Linear(E, FFN)
    assert not fused.worth_packing(small.weight)
    assert fused.worth_packing(large.weight)
    assert fused.worth_packing(small.to(torch.bfloat16).weight) == fused.ONEDNN_BF16
    assert not fused.worth_packing(nn.Linear(128, 512).weight)  # 2**16 elements: plain
    assert fused.worth_packing(nn.Linear(128, 513).weight)
    small_model = engine_from(make_mha(64, 4))
    assert small_model.diagnostics()["engine_path"].startswith("plain F.linear GEMMs")
    assert engine_from(make_mha(E, HEADS)).diagnostics()["engine_path"].startswith("prepacked")


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_tiny_batches_of_a_small_model_match_a_large_batch(precision, threads):
    """A small encoder (E=64: its float32 linears take the plain call) on the default path:
    1..16 packed rows, alone, give the bits they get inside a large batch."""
    torch.manual_seed(8)
    layer = nn.TransformerEncoderLayer(64, 4, 128, 0.0, "gelu", batch_first=True)
    model = engine_from(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval())
    dtype = getattr(torch, precision)
    model = model.to(dtype=dtype)
    seqs = [torch.randn(n, 64, dtype=dtype) for n in range(1, 17)]
    large = model.forward_varlen([torch.randn(300, 64, dtype=dtype), *seqs])[1:]
    for seq, want in zip(seqs, large, strict=True):
        assert torch.equal(model.forward_varlen([seq])[0], want), f"{len(seq)} rows"


def test_bf16_without_onednn_bf16_kernels_runs_plain_and_batch_invariant(monkeypatch, threads):
    """On a CPU oneDNN has no bf16 kernels for (AVX2 without AVX-NE-CONVERT), reordering a
    bf16 weight raises (loading a bf16 model once failed there): bf16 linears run as float32
    GEMMs of the widened values, rounded to bf16 (6x torch's bf16 F.linear there), keep batch
    invariance and stay within bf16 rounding of float32."""
    monkeypatch.setattr(fused, "ONEDNN_BF16", False)
    torch.manual_seed(9)
    layer = nn.TransformerEncoderLayer(E, HEADS, FFN, 0.0, "gelu", batch_first=True)
    encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    fp32 = engine_from(encoder)
    model = fused.prepack(engine_from(encoder, torch.bfloat16))  # as load_model does
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert not any(m in fused._packed for m in linears)  # nothing reordered
    assert "bf16 GEMMs computed in float32" in model.diagnostics()["engine_path"]
    seqs = [torch.randn(n, E) for n in (1, 5, 16, 40)]
    large = model.forward_varlen([torch.randn(300, E).bfloat16(), *(s.bfloat16() for s in seqs)])
    for seq, want in zip(seqs, large[1:], strict=True):
        assert torch.equal(model.forward_varlen([seq.bfloat16()])[0], want), f"{len(seq)} rows"
    reference = fp32.forward_varlen(seqs)
    for got, want in zip(large[1:], reference, strict=True):
        # measured on an AVX2 EPYC: max |difference| 0.029 on LayerNorm'd outputs (bf16's step
        # is 0.016-0.031 between 2 and 4)
        torch.testing.assert_close(got.float(), want, atol=0.06, rtol=0)


def test_forward_hooks_on_a_linear_still_run():
    """linear() calls F.linear itself for a plain nn.Linear (skipping nn.Module's call), but not
    where forward hooks would run: a hook on the module, or a global one, still sees the call."""
    model = engine_from(make_mha(16, 2))
    x = torch.randn(5, 16)
    seen: list[tuple[int, ...]] = []
    handle = model.attn.out_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    want = model.forward_packed(x, [0, 2, 5])
    handle.remove()
    assert seen == [torch.Size([16, 16])]  # the padded rows (MIN_ROWS), once per forward
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(m))
    try:
        got = model.forward_packed(x, [0, 2, 5])
    finally:
        handle.remove()
    assert model.attn.in_proj in seen and model.attn.out_proj in seen
    assert torch.equal(got, want)


def test_a_small_forward_dispatches_no_op_that_changes_nothing():
    """The host cost of a small forward is its dispatches (on CUDA each is a launch or at least
    a dispatch): casts, uploads and slices that would return their input are skipped. 12 ATen
    ops for MHA(16, 2) on CPU, torch 2.13 (22 before; `python -m benchmarks.host_cost`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    model = engine_from(make_mha(16, 2))
    x = torch.randn(16, 16)
    with torch.inference_mode(), Ops() as ops:
        model.forward_packed(x, list(range(17)))
    assert not [n for n in ops.names if n.startswith("aten.to.")], ops.names
    assert len(ops.names) <= 12, ops.names


def test_amx_row_blocks_are_for_cpu_tensors_only(monkeypatch):
    """The AMX bf16 blocks fix oneDNN's kernel choice on the host CPU; a GPU tensor (a meta
    tensor stands in: not on the CPU) takes one call whatever the host has."""
    monkeypatch.setattr(fused, "AMX", True)  # what an AMX host (e.g. an H100's Xeon) reports
    calls: list[int] = []

    def fn(rows, residual):
        calls.append(rows.shape[0])
        return rows

    on_gpu = torch.empty(300, 8, dtype=torch.bfloat16, device="meta")
    assert fused._rows(fn, on_gpu, None).shape == (300, 8) and calls == [300]
    calls.clear()
    on_cpu = torch.zeros(300, 8, dtype=torch.bfloat16)
    assert fused._rows(fn, on_cpu, None).shape == (300, 8)
    assert calls == [fused.AMX_BF16_BLOCK] * 3  # 128-row blocks, the last padded
