"""diagnostics() and head_importance() report facts that can be checked independently."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import engine_from, make_mha
from test_engine_encoder_parity import make_encoder

import mha_engine


@pytest.mark.parametrize(
    "kwargs,heads,blocker",
    [
        ({}, 4, None),
        ({}, 3, "num_heads is odd"),
        ({"bias": False}, 4, "bias=False"),
        ({"add_bias_kv": True}, 4, "add_bias_kv"),
        ({"add_zero_attn": True}, 4, "add_zero_attn"),
        ({"kdim": 6, "vdim": 6}, 4, "kdim/vdim"),
    ],
)
def test_fast_path_blockers_agree_with_pytorch(monkeypatch, kwargs, heads, blocker):
    """A config reported as fast-path-capable really calls torch._native_multi_head_attention."""
    mha = make_mha(12, heads, **kwargs)
    report = engine_from(mha).diagnostics(batch_size=2, seq_len=16)
    calls = []
    native = torch._native_multi_head_attention

    def spy(*args, **kw):
        calls.append(1)
        return native(*args, **kw)

    monkeypatch.setattr(torch, "_native_multi_head_attention", spy)
    x = torch.randn(2, 16, 12)
    kv = torch.randn(2, 16, mha.kdim) if mha.kdim != 12 else x  # kdim models cannot self-attend
    with torch.no_grad():
        mha(x, kv, kv, need_weights=False)
    assert report["pytorch_fast_path"] is bool(calls)
    if blocker is None:
        assert report["pytorch_fast_path_blockers"] == "none"
    else:
        assert blocker in report["pytorch_fast_path_blockers"]


def test_diagnostics_reports_cpu_backend():
    report = mha_engine.build_demo_model(device="cpu").diagnostics(batch_size=4, seq_len=64)
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["sdpa_backend"] in {"cpu-flash", "math", "unknown"}
    if hasattr(torch, "_fused_sdp_choice"):  # torch exposes the choice: we must not say unknown
        assert report["sdpa_backend"] != "unknown"
    assert all(isinstance(v, (str, int, bool)) for v in report.values())
    encoder = engine_from(make_encoder(bias=False, nhead=1))
    blockers = encoder.diagnostics()["pytorch_fast_path_blockers"]
    assert "bias=False" in blockers and "odd" in blockers


def test_head_importance_shares_and_correlation():
    mha = make_mha(12, 3)
    report = engine_from(mha).head_importance()
    assert len(report) == 1 and report[0]["layer"] == 0
    share = torch.tensor(report[0]["head_share"])
    assert share.shape == (3,) and abs(share.sum().item() - 1) < 1e-6
    corr = torch.tensor(report[0]["correlation"])
    torch.testing.assert_close(corr.diagonal(), torch.ones(3))
    torch.testing.assert_close(corr, corr.T)
    with torch.no_grad():
        mha.out_proj.weight[:, 4:8] *= 3  # head 1's head_dim columns of out_proj
        mha.out_proj.weight[:, 8:12] = mha.out_proj.weight[:, 0:4] * 0.5  # head 2 ∥ head 0
    after = engine_from(mha).head_importance()[0]
    new_share = torch.tensor(after["head_share"])
    assert new_share[1] > share[1] and new_share.argmax() == 1
    assert after["correlation"][0][2] == pytest.approx(1.0, abs=1e-6)
    assert after["head_norm"][2] == pytest.approx(after["head_norm"][0] * 0.5, rel=1e-5)


def test_head_importance_per_encoder_layer():
    report = engine_from(make_encoder(num_layers=2)).head_importance()
    assert [r["layer"] for r in report] == [0, 1]
    assert all(len(r["correlation"]) == 4 for r in report)
