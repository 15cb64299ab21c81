"""torch.export and torch.compile of engine models (kept few and small: compiling is slow)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import torch._dynamo
from engine_helpers import FP32, engine_from, make_mha
from test_engine_encoder_parity import make_encoder
from torch.export import Dim

from mha_engine.varlen import cumulative


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_export_encoder_with_dynamic_batch_and_length():
    model = engine_from(make_encoder(num_layers=2, final_norm=True, norm_first=True))
    x = torch.randn(2, 6, 16)
    shapes = ({0: Dim("batch"), 1: Dim("seq", min=2)},)
    program = torch.export.export(model, (x,), dynamic_shapes=shapes)
    other = torch.randn(3, 9, 16)  # a shape the export did not see
    torch.testing.assert_close(program.module()(other), model(other), **FP32)


def test_export_mha_with_key_padding_mask():
    model = engine_from(make_mha(12, 3, add_bias_kv=True))
    q, kv = torch.randn(2, 5, 12), torch.randn(2, 7, 12)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    program = torch.export.export(model, (q, kv, kv), {"key_padding_mask": kpm})
    got = program.module()(q, kv, kv, key_padding_mask=kpm)[0]
    torch.testing.assert_close(got, model(q, kv, kv, key_padding_mask=kpm)[0], **FP32)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on CPU needs a C++ compiler")
def test_compiled_dense_forward_matches_eager():
    """Inductor fuses the norms and activations; measured max difference 6e-7 (fp32)."""
    model = engine_from(make_encoder(num_layers=2, final_norm=True))
    x = torch.randn(2, 6, 16)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    compiled = torch.compile(model)
    got = compiled(x, src_key_padding_mask=kpm)
    torch.testing.assert_close(got, model(x, src_key_padding_mask=kpm), **FP32)


def test_compiled_packed_forward_does_not_recompile_for_new_lengths():
    """Policy: compile the encoder with a dynamic token count; the per-group SDPA loop is
    excluded from compilation, so a new set of lengths reuses the compiled graphs."""
    model = engine_from(make_encoder(num_layers=2, final_norm=True))
    eager = engine_from(make_encoder(num_layers=2, final_norm=True))
    model.core.compile(backend="aot_eager", dynamic=True)  # dynamo guards do not depend on it

    def run(lens: list[int]) -> None:
        x = torch.randn(sum(lens), 16)
        got = model.forward_packed(x, cumulative(lens))
        torch.testing.assert_close(got, eager.forward_packed(x, cumulative(lens)), **FP32)

    run([3, 5, 9])  # compiles
    with torch._dynamo.config.patch(error_on_recompile=True):
        run([4, 4, 11, 2, 7])  # other lengths, other groups, other token count
        run([30, 17])


NO_DYNAMO_SCRIPT = """
import sys
import torch
import mha_engine
import service.app  # noqa: F401 (the server's whole import graph)
model = mha_engine.build_demo_model(device="cpu")
with torch.inference_mode():
    model.forward_varlen([torch.randn(5, 512), torch.randn(9, 512), torch.randn(300, 512)])
assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
"""


def test_starting_and_running_does_not_import_dynamo():
    """The compile guards (mha_engine.eager.eager_only) leave torch._dynamo, ~1.7 s of import,
    out of every process that does not compile: the kernel and the grouped SDPA path both ran."""
    done = subprocess.run(
        [sys.executable, "-c", NO_DYNAMO_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
