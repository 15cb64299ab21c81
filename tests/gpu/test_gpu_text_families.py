"""MPNet, ModernBERT, Qwen3, Gemma 3, NomicBERT, GTE and JinaBERT on a real GPU (skipped without
one): token states against transformers' own modules on the CPU (JinaBERT: the BertModel-built
reference of tests/jina_models.py), and a sentence's states alone against the same sentence
among others. MPNet, ModernBERT, Gemma 3 and JinaBERT take the grouped SDPA path on CUDA for
their biased layers (relative positions, sliding window, ALiBi), Qwen3 in fp32 (flash's GQA is
half precision only), counted in cuda_grouped_calls; NomicBERT and GTE the varlen kernels. Not
yet run on a GPU when written."""

from __future__ import annotations

import pytest
import torch

import mha_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import jina_models as jm  # noqa: E402
from tests import text_models as tm  # noqa: E402

TEXTS = tm.LONG_AND_SHORT
TOLERANCES = {torch.float32: (2e-5, 1.3e-6), torch.bfloat16: (3e-2, 0)}
FP32_DRIFT = 4e-6  # cuBLAS fp32 GEMMs pick kernels by row count (tests/gpu/test_gpu_engine.py)


FAMILIES = ["mpnet", "modernbert", "qwen3", "qwen2", "eurobert", "gemma3_text", "nomic_bert", "gte"]
GQA = (
    "qwen3",
    "qwen2",
    "eurobert",
)  # flash in half precision, grouped SDPA calls in fp32 (docs/gpu.md)
MHA = ("nomic_bert", "gte")  # the varlen kernels in every precision (efficient in fp32)


def _check_alone(model, seqs: list, together: list, dtype: torch.dtype) -> None:
    """Each sequence's states alone equal its states among the others (bit for bit in half
    precision; fp32 within cuBLAS's row-count drift)."""
    for one, got in zip(seqs, together, strict=True):
        alone = model.encode_varlen([one])[0]
        if dtype == torch.float32:
            torch.testing.assert_close(alone, got, atol=FP32_DRIFT, rtol=0)
        else:
            assert torch.equal(alone, got)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_token_states_equal_transformers_and_never_depend_on_the_batch(tmp_path, family, dtype):
    reference = tm.build(family)
    path = tm.save(reference, tmp_path)
    model = mha_engine.load_model(path, device="cuda", dtype=dtype)
    encoded = tm.tokenize(path, TEXTS)
    seqs = [ids for ids, _ in encoded]
    ids, mask, _ = tm.padded(encoded)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    together = model.encode_varlen(seqs)
    atol, rtol = TOLERANCES[dtype]
    if family not in ("mpnet", "modernbert") and dtype == torch.bfloat16:
        atol = 8e-2  # CPU bf16: 2.9e-2 / 2.2e-2 on values up to 2.9 (test_qwen3, test_gemma3)
    for got, w, m in zip(together, want, mask.bool(), strict=True):
        torch.testing.assert_close(got.float().cpu(), w[m], atol=atol, rtol=rtol)
    grouped = family not in GQA + MHA or (family in GQA and dtype == torch.float32)
    assert (model.cuda_grouped_calls > 0) == grouped
    _check_alone(model, seqs, together, dtype)


@pytest.mark.parametrize("head", ["ForCausalLM", "ForSequenceClassification"])
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_qwen3_reranker_scores_equal_the_cpu_and_never_depend_on_the_batch(tmp_path, head, dtype):
    """A Qwen3 reranker (LogitScore or seq-cls) on CUDA against the engine's fp32 CPU scores,
    which equal sentence-transformers' (tests/mha_engine/test_qwen3_reranker.py)."""
    pytest.importorskip("sentence_transformers")
    cross_encoder, path = tm.qwen3_reranker(tmp_path / "rr", head)
    pairs = [("the cat sat", "a cat sat on the mat"), ("what is deep learning ?", "hello " * 80)]
    features = cross_encoder.preprocess(pairs)
    rows = zip(features["input_ids"], features["attention_mask"], strict=True)
    seqs = [ids[mask.bool()] for ids, mask in rows]
    want = mha_engine.load_model(path).classify_varlen(seqs)
    model = mha_engine.load_model(path, device="cuda", dtype=dtype)
    together = model.classify_varlen(seqs)
    atol = 1e-2 if dtype == torch.bfloat16 else 2e-5  # CPU bf16: 4.7e-3 (test_qwen3_reranker)
    torch.testing.assert_close(together.cpu(), want, atol=atol, rtol=1.3e-6)
    for one, got in zip(seqs, together, strict=True):
        alone = model.classify_varlen([one])[0]
        if dtype == torch.float32:
            torch.testing.assert_close(alone, got, atol=FP32_DRIFT, rtol=0)
        else:
            assert torch.equal(alone, got)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_jina_bert_equals_the_reference_and_never_depends_on_the_batch(tmp_path, dtype):
    reference = jm.reference(heads=6)
    path = jm.hub_form(reference, tmp_path / "hub")
    model = mha_engine.load_model(path, device="cuda", dtype=dtype)
    encoded = tm.tokenize(path, TEXTS)
    seqs = [ids for ids, _ in encoded]
    ids, mask, _ = tm.padded(encoded)
    want = jm.run(reference, ids, mask).last_hidden_state
    together = model.encode_varlen(seqs)
    atol, rtol = TOLERANCES[dtype]
    if dtype == torch.bfloat16:
        atol = 8e-2  # CPU bf16: 3.6e-2 on token states up to 2.9 (measured for these texts)
    for got, w, m in zip(together, want, mask.bool(), strict=True):
        torch.testing.assert_close(got.float().cpu(), w[m], atol=atol, rtol=rtol)
    assert model.cuda_grouped_calls > 0  # ALiBi: no varlen kernel takes the bias
    _check_alone(model, seqs, together, dtype)
