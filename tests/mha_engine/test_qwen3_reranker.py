"""Qwen3 rerankers against sentence-transformers' CrossEncoder (the real library saves them and
scores the reference): the causal LM scored by LogitScore ("yes" minus "no" at the last token,
Qwen/Qwen3-Reranker-*) and the Qwen3ForSequenceClassification form, over inputs its chat
template formats; transformers' rule for the scored token (the last that is not padding), a
tied LM head, a LogitScore without a "no" token, batch invariance in fp32/bf16/int8, and what
is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError
from mha_engine.quantize import activation_levels
from mha_engine.qwen3 import Qwen3ClassifierModel

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm
from tests.support import FP32_TOL

PAIRS = [
    ("the cat sat", "a cat sat on the mat"),
    ("what is deep learning ?", "hello world " * 40),  # past max_length 240: cut, tail restored
    ("a", "the"),
    ("paris", "paris is the capital city of france"),
]
IDENTITY = torch.nn.Identity()
TRANSFORMER = "sentence_transformers.models.Transformer"
LOGIT_SCORE = "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"
SEQ_CLS = ["Qwen3ForSequenceClassification"]


def _add_logit_score(path: Path, config: dict) -> None:
    """modules.json of a Transformer and a LogitScore module with `config`."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": TRANSFORMER},
        {"idx": 1, "name": "1", "path": "1_LogitScore", "type": LOGIT_SCORE},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_LogitScore").mkdir(exist_ok=True)
    (path / "1_LogitScore" / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module", params=["ForCausalLM", "ForSequenceClassification"])
def reranker(request, tmp_path_factory) -> tuple:
    return tm.qwen3_reranker(tmp_path_factory.mktemp("rr") / "saved", request.param)


def _inputs(cross_encoder, pairs, **kw) -> list[torch.Tensor]:
    """The token ids sentence-transformers scores (its template render, truncation, tail
    restore), unpadded."""
    features = cross_encoder.preprocess(pairs, **kw)
    rows = zip(features["input_ids"], features["attention_mask"], strict=True)
    return [ids[mask.bool()] for ids, mask in rows]


def test_scores_equal_sentence_transformers(reranker) -> None:
    cross_encoder, path = reranker
    model = mha_engine.load_model(path)
    assert isinstance(model, Qwen3ClassifierModel) and model.info.kind == "reranker"
    seqs = _inputs(cross_encoder, PAIRS)
    assert len(seqs[1]) == 240  # truncated
    want = cross_encoder.predict(PAIRS, activation_fn=IDENTITY, convert_to_tensor=True)
    torch.testing.assert_close(model.classify_varlen(seqs)[:, 0], want, **FP32_TOL)
    prompt = "rank passages about cats"  # the system message: the instruction
    seqs = _inputs(cross_encoder, PAIRS, prompt=prompt)
    want = cross_encoder.predict(
        PAIRS, prompt=prompt, activation_fn=IDENTITY, convert_to_tensor=True
    )
    torch.testing.assert_close(model.classify_varlen(seqs)[:, 0], want, **FP32_TOL)


def test_the_scored_token_is_the_last_that_is_not_padding(tmp_path: Path) -> None:
    """transformers' sequence classifiers score the last token whose id is not pad_token_id:
    a sequence that ends in pad-id tokens is scored before them (and the engine agrees)."""
    reference = tm.build("qwen3", "ForSequenceClassification", num_labels=2)
    model = mha_engine.load_model(tm.save(reference, tmp_path))
    assert model.spec.pad_token_id == tm.PAD
    ids, mask = tm.random_padded([9, 5, 14, 1])
    ids[0, 7:9] = tm.PAD  # real tokens with the pad id at the end of the first row
    seqs = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(model.classify_varlen(seqs), want, **FP32_TOL)


@pytest.mark.parametrize("tied", [False, True])
def test_logit_score_reads_lm_head_rows(tmp_path: Path, tied: bool) -> None:
    """The "yes" row minus the "no" row of lm_head (the token table when tied), and the "yes"
    logit alone without a false token, against transformers' causal LM logits."""
    reference = tm.build("qwen3", "ForCausalLM", tie_word_embeddings=tied)
    path = tm.save(reference, tmp_path)
    assert ("lm_head.weight" in reference.state_dict()) and (
        tied == torch.equal(reference.lm_head.weight, reference.model.embed_tokens.weight)
    )
    ids, mask = tm.random_padded([6, 11, 3])
    seqs = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=mask).logits
    last = logits[torch.arange(3), mask.sum(1) - 1]  # (B, V) at each row's last real token
    for true, false in ((40, 41), (40, None)):
        _add_logit_score(path, {"true_token_id": true, "false_token_id": false})
        want = last[:, true] - (last[:, false] if false is not None else 0)
        got = mha_engine.load_model(path).classify_varlen(seqs)[:, 0]
        torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_batch_invariance(reranker, dtype: str) -> None:
    cross_encoder, path = reranker
    model = mha_engine.load_model(path, dtype=dtype)
    seqs = _inputs(cross_encoder, PAIRS)
    together = model.classify_varlen(seqs)
    for one, got in zip(seqs, together, strict=True):
        assert torch.equal(model.classify_varlen([one])[0], got)
    partners = _inputs(cross_encoder, [(q, q) for q, _ in PAIRS])
    assert torch.equal(model.classify_varlen(partners + seqs)[len(partners) :], together)


@pytest.mark.parametrize(("dtype", "tol"), [("bfloat16", 1e-2), ("int8", 1e-2)])
def test_bf16_and_int8_stay_close(reranker, dtype: str, tol: float) -> None:
    """Measured on these tiny models: the causal form (scores up to 0.98) off by 4.7e-3 in
    bf16 and 4.1e-3 in int8, the seq-cls form (scores up to 0.027) by 1.4e-3 and 6.5e-3; int8
    with 7-bit activations (AVX2 without VNNI): 4.7e-3 and 1.65e-2."""
    if dtype == "int8" and activation_levels() < 127:
        tol = 2.5e-2
    cross_encoder, path = reranker
    seqs = _inputs(cross_encoder, PAIRS)
    want = mha_engine.load_model(path).classify_varlen(seqs)
    got = mha_engine.load_model(path, dtype=dtype).classify_varlen(seqs)
    torch.testing.assert_close(got, want, atol=tol, rtol=0)


def _edit(path: Path, name: str, change) -> None:
    value = json.loads((path / name).read_text())
    change(value)
    (path / name).write_text(json.dumps(value))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda p: _edit(p, "1_LogitScore/config.json", lambda c: c.update(true_token_id=10**6)),
         "outside the vocabulary"),
        (lambda p: _edit(p, "1_LogitScore/config.json", lambda c: c.update(true_token_id="yes")),
         "true_token_id must be a token id"),
        (lambda p: _edit(p, "1_LogitScore/config.json", lambda c: c.update(scale=2)),
         r"does not run: \['scale'\]"),
        (lambda p: _edit(p, "config.json", lambda c: c.update(architectures=SEQ_CLS)),
         "LogitScore scores a causal LM"),
        (lambda p: _edit(p, "modules.json", lambda m: m.insert(1, {
            "idx": 1, "name": "1", "path": "", "type": "sentence_transformers.models.Normalize"})),
         "it takes no Pooling, Dense, Normalize"),
    ],
)  # fmt: skip
def test_what_is_refused(tmp_path: Path, edit, match: str) -> None:
    _, path = tm.qwen3_reranker(tmp_path / "saved")
    edit(path)
    with pytest.raises(CheckpointError, match=match):
        mha_engine.load_model(path)


def test_an_untied_head_must_be_in_the_checkpoint(tmp_path: Path) -> None:
    """Without tie_word_embeddings the LM head is its own weight, as transformers reads it: a
    checkpoint without lm_head.weight is refused, not scored with the token table."""
    from safetensors.torch import load_file, save_file

    path = tm.save(tm.build("qwen3", "ForCausalLM", tie_word_embeddings=False), tmp_path)
    _add_logit_score(path, {"true_token_id": 40, "false_token_id": 41})
    weights = load_file(str(path / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        mha_engine.load_model(path)


def test_logit_score_on_an_encoder_family_is_refused(tmp_path: Path) -> None:
    path = tm.save(tm.build("bert"), tmp_path)
    _add_logit_score(path, {"true_token_id": 5})
    with pytest.raises(CheckpointError, match="model_type 'bert' is not one"):
        mha_engine.load_model(path)


def test_save_model_refuses_a_reranker(reranker, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="task head would be lost"):
        mha_engine.save_model(mha_engine.load_model(reranker[1]), tmp_path)
