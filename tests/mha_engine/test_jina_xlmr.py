"""jina-reranker-v2-base-multilingual's form: Jina's XLM-RoBERTa code (a config.json without
model_type, its auto_map naming XLMRobertaFlashConfig; weights named for flash-attention modules,
`emb_ln`, `encoder.layers.{i}.mixer.Wqkv`, `norm1`, `mlp.fc1`...) against transformers' own
XLMRobertaForSequenceClassification / XLMRobertaModel holding the same weights: logits, token
states padded and packed, save_model in transformers' form, and the rotary, LoRA-adapted form
(jina-embeddings-v3) refused."""

from __future__ import annotations

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import jina_models as jm  # noqa: E402
from tests import text_models as tm  # noqa: E402
from tests.support import FP32_TOL  # noqa: E402

LENGTHS = [7, 3, 12, 7, 1, 30]


def _reranker():
    labels = {"id2label": {0: "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    return tm.build("xlm-roberta", "ForSequenceClassification", num_labels=1, **labels)


def test_the_reranker_equals_transformers(tmp_path) -> None:
    reference = _reranker()
    path = jm.xlmr_flash_form(
        reference, tmp_path / "flash", architectures=["XLMRobertaForSequenceClassification"]
    )
    model = mha_engine.load_model(path)
    assert model.config.model_type == "xlm-roberta" and model.info.num_labels == 1
    ids, mask = tm.random_padded([9, 5, 14, 1])
    seqs = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(model.classify_varlen(seqs), want, **FP32_TOL)


def test_the_base_models_states_equal_transformers_padded_and_packed(tmp_path) -> None:
    reference = tm.build("xlm-roberta")
    model = mha_engine.load_model(jm.xlmr_flash_form(reference, tmp_path / "flash"))
    ids, mask = tm.random_padded(LENGTHS)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)
    packed = model.encode_varlen([row[m] for row, m in zip(ids, real, strict=True)])
    for got, w, m in zip(packed, want, real, strict=True):
        torch.testing.assert_close(got, w[m], **FP32_TOL)


def test_save_model_writes_transformers_form(tmp_path) -> None:
    reference = tm.build("xlm-roberta")
    model = mha_engine.load_model(jm.xlmr_flash_form(reference, tmp_path / "flash"))
    mha_engine.save_model(model, tmp_path / "out")
    again = transformers.AutoModel.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert again.config.model_type == "xlm-roberta"
    ids, mask = tm.random_padded(LENGTHS)
    with torch.no_grad():
        got = again(input_ids=ids, attention_mask=mask).last_hidden_state
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"position_embedding_type": "rotary"}, "jina-embeddings-v3"),
        ({"lora_adaptations": ["retrieval.query"]}, "lora_adaptations is set"),
        ({"load_trained_adapters": True}, "load_trained_adapters is set"),
    ],
)
def test_jinas_rotary_lora_form_is_refused(tmp_path, changes, match) -> None:
    path = jm.xlmr_flash_form(tm.build("xlm-roberta"), tmp_path / "flash", **changes)
    with pytest.raises(CheckpointError, match=match):
        mha_engine.load_model(path)


def test_a_config_without_model_type_or_jinas_code_is_still_refused(tmp_path) -> None:
    path = jm.xlmr_flash_form(tm.build("xlm-roberta"), tmp_path / "flash", auto_map={})
    with pytest.raises(CheckpointError, match="names no model_type"):
        mha_engine.load_model(path)
