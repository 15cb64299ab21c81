"""JinaBERT (jina-embeddings-v2, jina-reranker-v1) against the reference tests/jina_models.py
builds from transformers' own BertModel (transformers has no JinaBERT class), loaded from files
in the Hub's form: token states padded and packed, attention weights, rerankers, batch
invariance in fp32/bf16/int8, the ALiBi slopes, save_model, and what is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError, cuda_graphs
from mha_engine.position_bias import alibi_slopes

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import jina_models as jm  # noqa: E402
from tests import text_models as tm  # noqa: E402
from tests.support import FP32_TOL  # noqa: E402

LENGTHS = [7, 3, 12, 7, 1, 30]


def _check_states(model, reference, lengths=LENGTHS) -> None:
    ids, mask = tm.random_padded(lengths)
    want, real = jm.run(reference, ids, mask).last_hidden_state, mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)
    packed = model.encode_varlen([row[m] for row, m in zip(ids, real, strict=True)])
    for got, w, m in zip(packed, want, real, strict=True):
        torch.testing.assert_close(got, w[m], **FP32_TOL)


@pytest.mark.parametrize("heads", sorted(jm.SLOPES))
def test_alibi_slopes_are_the_papers(heads) -> None:
    assert alibi_slopes(heads) == pytest.approx(jm.SLOPES[heads], rel=1e-15)


@pytest.mark.parametrize(("heads", "feed_forward"), [(4, "geglu"), (6, "geglu"), (4, "reglu")])
def test_token_states_equal_the_reference_padded_and_packed(tmp_path, heads, feed_forward) -> None:
    reference = jm.reference(heads=heads, feed_forward=feed_forward)
    model = mha_engine.load_model(jm.hub_form(reference, tmp_path / "hub", feed_forward))
    c = model.config
    assert (c.model_type, c.alibi, c.gated_ffn) == ("jina_bert", True, True)
    assert c.activation == ("gelu" if feed_forward == "geglu" else "relu")
    assert model.embeddings.position_embeddings is None
    _check_states(model, reference)
    # the same weights without ALiBi are not close: the check exercises the bias
    ids, mask = tm.random_padded(LENGTHS)
    with torch.no_grad():
        plain = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert (model.encode(ids, mask)[real] - plain[real]).abs().max() > 1e-2


def test_attention_weights_equal_the_reference(tmp_path) -> None:
    reference = jm.reference(heads=6)
    model = mha_engine.load_model(jm.hub_form(reference, tmp_path / "hub"))
    ids, mask = tm.random_padded([9, 4])
    out = jm.run(reference, ids, mask, output_attentions=True)
    with torch.no_grad():
        embeds = model.embeddings(ids).to(model.dtype)
    _, weights = model.attention_weights(embeds, ~mask.bool())  # (L, B, H, T, T)
    real = mask.bool()  # the padded queries' rows are not compared
    torch.testing.assert_close(
        weights.transpose(2, 3)[:, real],
        torch.stack(out.attentions).transpose(2, 3)[:, real],
        **FP32_TOL,
    )


@pytest.mark.parametrize("labels", [1, 3])
def test_rerankers_and_classifiers_equal_the_reference(tmp_path, labels) -> None:
    """JinaBertForSequenceClassification (jina-reranker-v1: one label): BERT's pooler and
    classifier over the first token."""
    names = {i: f"l{i}" for i in range(labels)}
    reference = jm.reference(
        "ForSequenceClassification", num_labels=labels, id2label=names,
        label2id={v: k for k, v in names.items()},
    )  # fmt: skip
    path = jm.hub_form(
        reference, tmp_path / "hub", architectures=["JinaBertForSequenceClassification"]
    )
    model = mha_engine.load_model(path)
    assert model.info.num_labels == labels
    ids, mask = tm.random_padded([9, 5, 14, 1])
    seqs = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    want = jm.run(reference, ids, mask).logits
    torch.testing.assert_close(model.classify_varlen(seqs), want, **FP32_TOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_sequences_numbers_never_depend_on_its_batch(tmp_path, dtype) -> None:
    path = jm.hub_form(jm.reference(heads=6), tmp_path / "hub")
    model = mha_engine.load_model(path, dtype=dtype)
    ids, mask = tm.random_padded(LENGTHS)
    seqs = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    together = model.encode_varlen(seqs)
    for one, got in zip(seqs, together, strict=True):
        assert torch.equal(model.encode_varlen([one])[0], got)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_bf16_and_int8_stay_close(tmp_path, dtype) -> None:
    reference = jm.reference(heads=6)
    path = jm.hub_form(reference, tmp_path / "hub")
    ids, mask = tm.random_padded(LENGTHS)
    m = mask[..., None].float()
    want = (jm.run(reference, ids, mask).last_hidden_state * m).sum(1) / m.sum(1)
    seqs = [row[k.bool()] for row, k in zip(ids, mask, strict=True)]
    got = mha_engine.load_model(path, dtype=dtype).embed_varlen(seqs)
    # measured here on mean-pooled values up to 2.2: bf16 1.8e-2, int8 4.0e-3; least cosine
    # similarity 0.99998 (bf16), 0.999998 (int8)
    torch.testing.assert_close(got, want, atol={"bfloat16": 4e-2, "int8": 1e-2}[dtype], rtol=0)


def test_save_model_writes_jinas_form_back(tmp_path) -> None:
    reference = jm.reference(heads=6, feed_forward="reglu")
    model = mha_engine.load_model(jm.hub_form(reference, tmp_path / "hub", "reglu"))
    mha_engine.save_model(model, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["model_type"], saved["position_embedding_type"]) == ("bert", "alibi")
    assert saved["feed_forward_type"] == "reglu" and "AutoModel" in saved["auto_map"]
    again = mha_engine.load_model(tmp_path / "out")
    assert again.config == model.config
    _check_states(again, reference)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"auto_map": {"AutoConfig": "jinaai/jina-bert-v2-qk-post-norm--configuration_bert."
                                     "JinaBertConfig"}}, "qk-post-norm"),
        ({"feed_forward_type": "original"}, "feed_forward_type 'original'"),
        ({"feed_forward_type": None}, "feed_forward_type None"),
        ({"model_type": "roberta"}, "position_embedding_type 'alibi'"),
        ({"position_embedding_type": "relative_key"}, "'relative_key'"),
    ],
)  # fmt: skip
def test_what_the_engine_does_not_run_is_refused(tmp_path, changes, match) -> None:
    path = jm.hub_form(jm.reference(), tmp_path / "hub", **changes)
    with pytest.raises(CheckpointError, match=match):
        mha_engine.load_model(path)


def test_alibi_and_the_glu_go_with_jina_bert_only(tmp_path) -> None:
    """hf_bert reads JinaBERT's weight names by model_type: a config may not mix them."""
    config = mha_engine.load_model(jm.hub_form(jm.reference(), tmp_path / "hub")).config
    for changes in ({"model_type": "bert"}, {"alibi": False}, {"gated_ffn": False}):
        with pytest.raises(CheckpointError, match="go together"):
            dataclasses.replace(config, **changes)


def test_a_splade_head_and_cuda_graphs_are_refused(tmp_path, monkeypatch) -> None:
    path = jm.hub_form(jm.reference(), tmp_path / "hub")
    kinds = (("", "MLMTransformer"), ("1_SpladePooling", "SpladePooling"))
    modules = [{"idx": i, "name": str(i), "path": p, "type": tm.SPARSE_MODULES + kind}
               for i, (p, kind) in enumerate(kinds)]  # fmt: skip
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_SpladePooling").mkdir()
    (path / "1_SpladePooling" / "config.json").write_text(json.dumps({"pooling_strategy": "max"}))
    with pytest.raises(CheckpointError, match="jina_bert SPLADE model"):
        mha_engine.load_model(path)
    (path / "modules.json").unlink()
    model = mha_engine.load_model(path)
    assert model.diagnostics()["engine_path"].endswith("with ALiBi")
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=r"no position bias .*ALiBi"):
        cuda_graphs.capture(model, True, False, 64, 8, 4, None)
