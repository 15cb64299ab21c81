"""Sequence-classification checkpoints (BERT, RoBERTa, XLM-R, CamemBERT, DistilBERT, MPNet,
ModernBERT) load with their heads and give transformers' logits; 1_Pooling chooses mean, CLS or
last-token pooling."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import FP32
from safetensors.torch import load_file, save_file

from mha_engine import CheckpointError, TextClassifierModel, TextEncoderModel, load_model

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm

TEXTS = ["the cat sat on the mat", "deep learning", "what is the capital of france", "good"]
PAIRS = [("what is deep learning", "deep learning is machine learning"), ("paris", "rain")]
FAMILIES = ["bert", "roberta", "xlm-roberta", "camembert", "distilbert", "mpnet", "modernbert",
            "nomic_bert", "gte"]  # fmt: skip


def _logits(ref, encoded, with_types: bool):
    ids, mask, types = tm.padded(encoded)
    kwargs = {"token_type_ids": types} if with_types else {}
    with torch.no_grad():
        return ref(input_ids=ids, attention_mask=mask, **kwargs).logits


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("num_labels", [3, 1])
def test_logits_equal_transformers(tmp_path, model_type, num_labels):
    labels = tm.LABELS3 if num_labels == 3 else {0: "score"}
    ref, path = tm.classifier(model_type, tmp_path, labels)
    model = load_model(path, device="cpu")
    assert isinstance(model, TextClassifierModel)
    assert model.info.id2label == labels and model.info.num_labels == num_labels
    assert model.info.kind == ("reranker" if num_labels == 1 else "classifier")
    for texts, pairs in ((TEXTS, False), (PAIRS, True)):
        encoded = tm.tokenize(path, texts, pairs)
        want = _logits(ref, encoded, with_types=model_type in ("bert", "nomic_bert"))
        got = model.classify_varlen([i for i, _ in encoded], [t for _, t in encoded])
        assert got.dtype == torch.float32 and got.shape == (len(texts), num_labels)
        torch.testing.assert_close(got, want, **FP32)
    # Batch invariance (fp32 GEMMs of other row counts round differently, within FP32):
    # one pair alone gives the numbers it gave among others.
    ids, types = encoded[1]
    torch.testing.assert_close(model.classify_varlen([ids], [types]), got[1:], **FP32)


def test_bert_pairs_use_token_types(tmp_path):
    """A pair's second text is token type 1: dropping the types changes BERT's logits."""
    _, path = tm.classifier("bert", tmp_path)
    model = load_model(path, device="cpu")
    encoded = tm.tokenize(path, PAIRS, pairs=True)
    assert any(t.any() for _, t in encoded)
    with_types = model.classify_varlen([i for i, _ in encoded], [t for _, t in encoded])
    without = model.classify_varlen([i for i, _ in encoded])
    assert not torch.allclose(with_types, without)


def test_problem_type_and_labels_from_config(tmp_path):
    _, path = tm.classifier("bert", tmp_path, problem_type="multi_label_classification")
    info = load_model(path, device="cpu").info
    assert info.problem_type == "multi_label_classification"
    assert info.label2id == {"negative": 0, "neutral": 1, "positive": 2}


def test_missing_head_weight_is_named(tmp_path):
    _, path = tm.classifier("roberta", tmp_path)
    state = load_file(str(path / "model.safetensors"))
    state.pop("classifier.out_proj.bias")
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys \['classifier\.out_proj\.bias'\]"):
        load_model(path)


def test_head_with_wrong_label_count_is_refused(tmp_path):
    _, path = tm.classifier("distilbert", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b"}  # the weights have 3 rows
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"classifier\.weight: expected shape \(2, 32\), got \(3, 32\)"
    ):
        load_model(path)


def test_base_model_is_not_a_classifier(tmp_path):
    _, path = tm.sentence_transformer(tmp_path)
    model = load_model(path, device="cpu")
    assert isinstance(model, TextEncoderModel) and not isinstance(model, TextClassifierModel)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last_token"])
def test_pooling_from_sentence_transformers_files(tmp_path, pooling):
    ref, path = tm.sentence_transformer(tmp_path, pooling=pooling, normalize=True)
    model = load_model(path, device="cpu")
    assert model.pooling == pooling
    encoded = tm.tokenize(path, TEXTS)
    ids, mask, _ = tm.padded(encoded)
    with torch.no_grad():
        hidden = ref(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, D)
    lens = mask.sum(1)
    if pooling == "mean":
        m = mask.unsqueeze(-1).float()
        pooled = (hidden * m).sum(1) / m.sum(1)
    elif pooling == "cls":
        pooled = hidden[:, 0]
    else:
        pooled = hidden[torch.arange(len(TEXTS)), lens - 1]
    want = torch.nn.functional.normalize(pooled, dim=-1)
    torch.testing.assert_close(model.embed_varlen([i for i, _ in encoded]), want, **FP32)
    torch.testing.assert_close(model.embed(ids, mask), want, **FP32)


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_low_precision_classifier_close_and_batch_invariant(tmp_path, dtype):
    """The head is quantized / cast with the encoder. Measured on these tiny models (|logits| <
    1): max |error| against fp32 0.0036 (int8, bert) and 0.0013 (bf16); each input's logits
    are bit-identical alone and in the batch."""
    from mha_engine.quantize import int8_unsupported_reason

    if dtype == "int8" and int8_unsupported_reason("cpu") is not None:
        pytest.skip(str(int8_unsupported_reason("cpu")))
    _, path = tm.classifier("bert", tmp_path)
    encoded = tm.tokenize(path, TEXTS + [" ".join(p) for p in PAIRS])
    ids, types = [i for i, _ in encoded], [t for _, t in encoded]
    want = load_model(path, device="cpu").classify_varlen(ids, types)
    model = load_model(path, device="cpu", dtype=dtype)
    got = model.classify_varlen(ids, types)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() <= 0.01
    for i in range(len(ids)):
        assert torch.equal(model.classify_varlen([ids[i]], [types[i]])[0], got[i])
