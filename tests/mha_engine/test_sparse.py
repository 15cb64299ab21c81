"""SPLADE sparse encoders against transformers' own `...ForMaskedLM` modules: the MLM head's
logits through max over tokens of log(1 + relu), for BERT, RoBERTa, DistilBERT and MPNet; batch
invariance; what a directory that cannot be served this way is told."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError, SparseEncoderModel
from mha_engine import sparse as sparse_module
from tests import text_models as tm
from tests.support import FP32_TOL

TEXTS = ["the cat sat on the mat", "what is deep learning?", "hello", "a dog . a cat . a mat"]


@pytest.fixture(scope="module", params=["bert", "roberta", "camembert", "distilbert", "mpnet"])
def splade(request, tmp_path_factory) -> tuple:
    return tm.splade(tmp_path_factory.mktemp("splade") / request.param, request.param)


def test_weights_equal_transformers_masked_lm_with_splade_pooling(splade) -> None:
    reference, path = splade
    model = mha_engine.load_model(path)
    assert isinstance(model, SparseEncoderModel) and model.text_kind == "sparse"
    encoded = tm.tokenize(path, TEXTS)
    got = model.sparse_embed_varlen([ids for ids, _ in encoded])
    want = tm.splade_reference(reference, encoded)
    torch.testing.assert_close(got, want, **FP32_TOL)
    assert got.shape == (len(TEXTS), reference.config.vocab_size)
    assert (got >= 0).all()


@pytest.mark.parametrize("vocab_size", [None, 8192])  # 8192 x 32: the prepacked oneDNN decoder
def test_a_sequences_weights_never_depend_on_its_batch(
    splade, monkeypatch, tmp_path: Path, vocab_size: int | None
) -> None:
    _, path = splade
    if vocab_size is not None:
        model_type = mha_engine.load_model(path).model_type
        _, path = tm.splade(tmp_path / "big", model_type, vocab_size=vocab_size)
    model = mha_engine.load_model(path)
    ids = [ids for ids, _ in tm.tokenize(path, TEXTS)]
    alone = torch.cat([model.sparse_embed_varlen([one]) for one in ids])
    together = model.sparse_embed_varlen(ids)
    monkeypatch.setattr(sparse_module, "TOKEN_CHUNK", 5)  # chunks cut through sequences
    chunked = model.sparse_embed_varlen(ids)
    assert torch.equal(alone, together) and torch.equal(together, chunked)


def test_what_cannot_run_as_splade_is_refused_naming_why(tmp_path: Path) -> None:
    _, path = tm.splade(tmp_path / "sp")
    config = path / "1_SpladePooling" / "config.json"
    config.write_text(json.dumps({"pooling_strategy": "sum", "activation_function": "relu"}))
    with pytest.raises(CheckpointError, match="pooling_strategy 'sum'"):
        mha_engine.load_model(path)

    _, classifier = tm.classifier("bert", tmp_path / "cls")
    (classifier / "modules.json").write_text((path / "modules.json").read_text())
    (classifier / "1_SpladePooling").mkdir()
    with pytest.raises(CheckpointError, match=r"name no \.\.\.ForMaskedLM"):
        mha_engine.load_model(classifier)

    base = tm.save(tm.build("bert"), tmp_path / "base")  # no MLM head in the weights
    (base / "modules.json").write_text((path / "modules.json").read_text())
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(CheckpointError, match="masked-LM head"):
        mha_engine.load_model(base)


@pytest.mark.parametrize(
    ("model_type", "act"),
    [
        ("bert", "relu"),
        ("roberta", "relu"),
        ("distilbert", "relu"),
        ("roberta", "gelu_new"),
        ("mpnet", "relu"),
    ],
)
def test_each_familys_head_activation_is_transformers(tmp_path: Path, model_type, act) -> None:
    """BERT's and DistilBERT's heads follow the encoder's activation; RoBERTa's and MPNet's are
    always GELU."""
    field = "activation" if model_type == "distilbert" else "hidden_act"
    reference, path = tm.splade(tmp_path / "sp", model_type, **{field: act})
    encoded = tm.tokenize(path, TEXTS)
    got = mha_engine.load_model(path).sparse_embed_varlen([ids for ids, _ in encoded])
    torch.testing.assert_close(got, tm.splade_reference(reference, encoded), **FP32_TOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_bf16_and_int8_stay_close_and_batch_invariant(tmp_path: Path, dtype: str) -> None:
    reference, path = tm.splade(tmp_path / "sp")
    model = mha_engine.load_model(path, dtype=dtype)
    encoded = tm.tokenize(path, TEXTS)
    ids = [ids for ids, _ in encoded]
    got = model.sparse_embed_varlen(ids)
    # measured here: largest difference 4.9e-3 (bf16), 7.9e-3 (int8) on weights of order 1
    torch.testing.assert_close(got, tm.splade_reference(reference, encoded), atol=2e-2, rtol=0)
    assert torch.equal(got, torch.cat([model.sparse_embed_varlen([one]) for one in ids]))


def test_a_model_with_a_task_head_is_not_saved_as_a_plain_encoder(splade, tmp_path) -> None:
    """save_model would write the encoder alone (a directory that loads as a dense model):
    refused, naming why, for SPLADE and classifier heads alike."""
    _, path = splade
    _, classifier = tm.classifier("bert", tmp_path / "cls")
    for directory in (path, classifier):
        model = mha_engine.load_model(directory)
        with pytest.raises(ValueError, match="its task head would be lost"):
            mha_engine.save_model(model, tmp_path / "out")
