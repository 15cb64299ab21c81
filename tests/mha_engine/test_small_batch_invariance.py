"""Short sequences alone are bit-equal to themselves inside larger packed batches.

CPU GEMMs over fewer than 12 rows (except 4 and 8) round differently from the same rows in a
larger GEMM (measured: MKL sgemm and oneDNN bf16, torch 2.13); varlen.pad_rows pads small
packed batches so a request's numbers never depend on its batch-mates.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import engine_from, make_mha
from test_engine_encoder_parity import make_encoder

from mha_engine.varlen import MIN_GEMM_ROWS, pad_rows

LENGTHS = [5, 9, 1, 3, 7, 2, 11]  # all under MIN_GEMM_ROWS, none 4 or 8


def test_unpadded_small_gemm_differs_so_the_padding_is_needed():
    """The premise: without padding a 5-row GEMM differs from its rows in a 40-row GEMM."""
    lin = torch.nn.Linear(16, 48).requires_grad_(False)
    x = torch.randn(40, 16)
    with torch.inference_mode():
        big = lin(x)
        small = [m for m in range(1, MIN_GEMM_ROWS) if not torch.equal(lin(x[:m]), big[:m])]
        padded = [
            m for m in range(1, 30) if not torch.equal(lin(pad_rows(x[:m].clone()))[:m], big[:m])
        ]
    assert small, "GEMMs are row-invariant here: pad_rows could be dropped"
    assert padded == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["encoder", "mha_self", "mha_cross"])
def test_short_sequences_bit_equal_alone_and_packed(kind, dtype):
    if kind == "encoder":
        model = engine_from(make_encoder(num_layers=2, final_norm=True), dtype)
    else:
        model = engine_from(make_mha(16, 4), dtype)
    seqs = [torch.randn(n, 16) for n in LENGTHS]
    keys = [torch.randn(n + 2, 16) for n in LENGTHS] if kind == "mha_cross" else None

    def run(idx):
        k = None if keys is None else [keys[i] for i in idx]
        return model.forward_varlen([seqs[i] for i in idx], k, k)

    batch = run(range(len(seqs)))
    for i in range(len(seqs)):
        assert torch.equal(run([i])[0], batch[i]), f"sequence {i} ({LENGTHS[i]} tokens)"


@pytest.mark.parametrize("masked", [False, True])
def test_few_queries_on_many_keys_bit_equal_alone_and_packed(masked, monkeypatch):
    """1-3 query tokens on 8+ keys (a short target on a long memory): CPU SDPA gives other bits
    for such a call in a batch than alone, so these groups attend one sequence per call
    (packed_attention.SMALL_QUERIES). 300 keys pass the CPU kernel's limit; a mask bars it."""
    model = engine_from(make_mha(64, 8))
    g = torch.Generator().manual_seed(1)
    q_lens, kv_lens = [1, 1, 1, 2, 3, 3, 9, 9, 15, 15], [300, 300, 12, 12, 12, 12, *[40] * 4]
    queries = [torch.randn(t, 64, generator=g) for t in q_lens]
    keys = [torch.randn(s, 64, generator=g) for s in kv_lens]
    masks = None
    if masked:  # each sequence hides its last key
        masks = [torch.arange(s) == s - 1 for s in kv_lens]

    def run(idx):
        k = [keys[i] for i in idx]
        m = None if masks is None else [masks[i] for i in idx]
        return model.forward_varlen([queries[i] for i in idx], k, k, m)

    from mha_engine import packed_attention

    with monkeypatch.context() as patch:  # the premise: one SDPA call per group differs
        patch.setattr(packed_attention, "SMALL_QUERIES", 0)
        grouped = run(range(len(q_lens)))
        if all(torch.equal(run([i])[0], grouped[i]) for i in range(len(q_lens))):
            pytest.skip("SDPA is batch invariant for these shapes on this CPU: nothing to show")
    batch = run(range(len(q_lens)))
    for i in range(len(q_lens)):
        assert torch.equal(run([i])[0], batch[i]), f"sequence {i}: {q_lens[i]} on {kv_lens[i]}"
