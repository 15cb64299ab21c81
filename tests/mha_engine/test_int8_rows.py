"""int8_rows: the compiled per-row kernels give the eager ops' bits, and the fallback works.

Exact equality (torch.equal), not a tolerance: the C code runs the same float32 operations in
the same order (its fmaf calls are the fused multiply-adds of torch's addcmul kernel).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from engine_helpers import engine_from
from torch import nn

import mha_engine
from mha_engine import cbuild, fused, int8_rows
from mha_engine.quantize import Int8Linear, int8_unsupported_reason

STATUS = int8_rows.kernel_status()
compiled = pytest.mark.skipif(not STATUS.startswith("compiled"), reason=f"int8 rows: {STATUS}")
needs_int8 = pytest.mark.skipif(
    int8_unsupported_reason("cpu") is not None, reason=str(int8_unsupported_reason("cpu"))
)


def _rows(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of every kind the quantizer meets: offset, all-positive, zero, constant, wide."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * 3 + 1
    if n > 4:
        x[0] = torch.rand(k, generator=g)
        x[1] = 0.0
        x[2] = -2.5
        x[3] *= 1e30  # large magnitudes (still finite after max - min)
        x[4] *= 1e-30  # tiny values
    return x


@compiled
@pytest.mark.parametrize("levels", [127, 63])
@pytest.mark.parametrize("k", [1, 7, 16, 17, 384, 1536])
def test_quantize_rows_equals_the_eager_ops(k, levels):
    x = _rows(37, k)
    got = int8_rows.quantize_rows(x, levels)
    want = int8_rows._quantize_rows_eager(x, levels)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@compiled
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_spread_over_threads_keep_the_eager_bits(threads):
    """Batches past int8_rows.PARALLEL_MIN elements split their rows over OpenMP threads:
    every row still gets the eager ops' bits, whichever thread computed it."""
    n, k, m = 301, 384, 1536
    assert n * k >= int8_rows.PARALLEL_MIN
    x = _rows(n, k, seed=4)
    g = torch.Generator().manual_seed(5)
    y, bias, sums = torch.randn(n, m, generator=g), torch.randn(m, generator=g), torch.randn(m)
    residual = torch.randn(n, m, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = int8_rows.quantize_rows(x, 127)
        _, scale, mid = got
        out = int8_rows.rescale_rows(y.clone(), scale, mid, bias, sums, residual)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(got, int8_rows._quantize_rows_eager(x, 127), strict=True):
        assert torch.equal(a, b)
    want = int8_rows._rescale_rows_eager(y.clone(), scale, mid, bias, sums, residual)
    assert torch.equal(out, want)


@compiled
def test_quantize_rows_reads_strided_rows():
    """Rows with a stride larger than K (a column slice) are read in place, same result."""
    wide = _rows(20, 40)
    x = wide[:, 5:29]  # (20, 24), row stride 40
    got = int8_rows.quantize_rows(x, 127)
    want = int8_rows._quantize_rows_eager(x.contiguous(), 127)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@compiled
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("with_residual", [None, "contiguous", "strided"])
def test_rescale_rows_equals_the_eager_ops(with_bias, with_residual):
    g = torch.Generator().manual_seed(1)
    n, m = 29, 67
    y = torch.randn(n, m, generator=g) * 50
    scale, mid = torch.rand(n, generator=g) * 0.1, torch.randn(n, generator=g)
    bias = torch.randn(m, generator=g) if with_bias else None
    sums = torch.randn(m, generator=g) * 5
    residual = None
    if with_residual == "contiguous":
        residual = torch.randn(n, m, generator=g)
    elif with_residual == "strided":
        residual = torch.randn(n, m + 9, generator=g)[:, 3 : 3 + m]
    got = int8_rows.rescale_rows(y.clone(), scale, mid, bias, sums, residual)
    want = int8_rows._rescale_rows_eager(y.clone(), scale, mid, bias, sums, residual)
    assert torch.equal(got, want)


@compiled
def test_rescale_rows_takes_the_eager_way_for_shapes_the_c_code_does_not_read():
    """A broadcast residual or bias (or mismatched scales) never reaches the C code, which
    reads exact extents: the eager ops broadcast it, or raise as torch does."""
    y, scale, mid = torch.randn(6, 8), torch.rand(6), torch.randn(6)
    sums, row = torch.randn(8), torch.randn(8)
    got = int8_rows.rescale_rows(y.clone(), scale, mid, None, sums, row)  # residual (M,)
    want = int8_rows._rescale_rows_eager(y.clone(), scale, mid, None, sums, row)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError):
        int8_rows.rescale_rows(y.clone(), scale[:4], mid[:4], None, sums)


@compiled
@needs_int8
def test_a_non_finite_row_gives_a_non_finite_output_row_and_spares_the_others(monkeypatch):
    """NaN or Inf in a row, or a range past float32's: that row's output is not finite (the
    service then refuses it), compiled and eager alike; every other row keeps its bits."""
    torch.manual_seed(0)
    lin = Int8Linear(torch.randn(48, 32), torch.randn(48))
    x = _rows(12, 32)
    x[5, 3], x[7, 0], x[9, 31] = float("nan"), float("inf"), -float("inf")
    x[3, ::2], x[3, 1::2] = 3e38, -3e38  # finite, but max - min overflows
    got = lin(x)
    monkeypatch.setenv("MHA_ENGINE_INT8_KERNEL", "eager")
    eager = lin(x)
    for row in (3, 5, 7, 9):
        assert not torch.isfinite(got[row]).any()
        assert not torch.isfinite(eager[row]).any()
    ok = [i for i in range(12) if i not in (3, 5, 7, 9)]
    assert torch.equal(got[ok], eager[ok])
    monkeypatch.delenv("MHA_ENGINE_INT8_KERNEL")
    alone = torch.stack([lin(x[i : i + 1])[0] for i in ok])
    assert torch.equal(got[ok], alone)


@compiled
@needs_int8
def test_an_int8_model_gives_the_same_bits_compiled_and_eager(monkeypatch):
    """A whole int8 encoder, packed varlen batch with residuals fused into the epilogue."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, activation="gelu", batch_first=True)
    model = engine_from(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval())
    mha_engine.quantize_int8(model)
    seqs = [torch.randn(t, 64) for t in (1, 5, 17, 3, 40)]
    with torch.inference_mode():
        compiled = model.forward_varlen(seqs)
        monkeypatch.setenv("MHA_ENGINE_INT8_KERNEL", "eager")
        assert int8_rows.kernel_status() == "eager: MHA_ENGINE_INT8_KERNEL=eager"
        eager = model.forward_varlen(seqs)
    for c, e in zip(compiled, eager, strict=True):
        assert torch.equal(c, e)


@needs_int8
def test_the_int8_residual_is_added_in_the_epilogue_with_the_same_bits():
    torch.manual_seed(0)
    lin = Int8Linear(torch.randn(24, 40), torch.randn(24))
    x, r = torch.randn(9, 40), torch.randn(9, 24)
    assert torch.equal(lin(x, r), lin(x) + r)


@pytest.mark.parametrize(
    ("cc", "why"),
    [("/nonexistent/cc", "could not run the C compiler"), ("false", "failed to build")],
)
def test_without_a_working_compiler_the_eager_ops_run_and_say_why(monkeypatch, cc, why):
    monkeypatch.setenv("CC", cc)
    library, status = int8_rows.KERNEL.compile()
    assert library is None
    assert status.startswith("eager: ") and why in status


def test_without_a_writable_temporary_directory_the_eager_ops_run(monkeypatch, tmp_path):
    monkeypatch.setattr(cbuild.tempfile, "tempdir", str(tmp_path / "missing"))
    monkeypatch.setenv(cbuild.CACHE_ENV, "off")  # nor a library compiled before
    library, status = int8_rows.KERNEL.compile()
    assert library is None
    assert status.startswith("eager: no directory to build in")


@compiled
@needs_int8
def test_diagnostics_name_the_row_kernels():
    torch.manual_seed(0)
    model = mha_engine.quantize_int8(engine_from(nn.MultiheadAttention(32, 4, batch_first=True)))
    assert "row passes compiled" in model.diagnostics()["engine_path"]


SAME_BITS_SCRIPT = """
import os
import torch
from mha_engine import fused, int8_rows
from mha_engine.quantize import Int8Linear
assert int8_rows.kernel_status().startswith("compiled"), int8_rows.kernel_status()
g = torch.Generator().manual_seed(2)
for n, k, m, bias in ((29, 40, 67, True), (5, 384, 1152, False)):
    b = torch.randn(m, generator=g) if bias else None
    lin = Int8Linear(torch.randn(m, k, generator=g), b)
    x, r = torch.randn(n, k, generator=g) * 3, torch.randn(n, m, generator=g)
    os.environ["MHA_ENGINE_INT8_KERNEL"] = "auto"
    compiled = lin(x, r)
    os.environ["MHA_ENGINE_INT8_KERNEL"] = "eager"
    print(torch.backends.cpu.get_cpu_capability(), torch.equal(compiled, lin(x, r)))
"""


@compiled
@needs_int8
@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_the_compiled_kernels_follow_torchs_other_cpu_kernels(capability):
    """torch's DEFAULT kernels round y * scale before adding (its AVX2 / AVX-512 ones fuse
    it): with ATEN_CPU_CAPABILITY forcing them, and the C built without AVX-512, the
    compiled epilogue still gives the eager bits."""
    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "CC": "cc -mno-avx512f"}
    done = subprocess.run(
        [sys.executable, "-c", SAME_BITS_SCRIPT], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [capability.upper(), "True"] * 2, done.stdout


@needs_int8
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_int8_activations_run_in_place_with_the_same_bits(activation, with_residual):
    """fused.linear on an Int8Linear applies the activation to the linear's own output in
    place, then adds the residual: the bits of the out-of-place ops."""
    torch.manual_seed(0)
    lin = Int8Linear(torch.randn(96, 40), torch.randn(96))
    x = torch.randn(23, 40) * 2
    r = torch.randn(23, 96) if with_residual else None
    want = fused.ACTIVATIONS[activation](lin(x))
    want = want if r is None else want + r
    assert torch.equal(fused.linear(lin, x, activation, r), want)
