"""The Llama family (Llama, Mistral, Qwen2, EuroBERT: Qwen3's layers without per-head norms, each
with its own biases) against transformers' own models: padded and packed token states, the
biases each family has, Mistral's sliding window (the max length capped at it), bidirectional
attention by is_causal, batch invariance in fp32/bf16/int8, save_model round trips through
transformers, sequence classifiers and LogitScore rerankers, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError, Qwen3Model
from mha_engine.qwen3 import Qwen3ClassifierModel

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm  # noqa: E402
from tests.support import FP32_TOL  # noqa: E402

LENGTHS = [7, 3, 12, 7, 1, 30]
VARIANTS = [
    ("llama", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"attention_bias": True, "head_dim": None}),  # head_dim: hidden / heads
    ("mistral", {}),
    ("mistral", {"is_causal": False}),  # transformers 5's bidirectional switch
    ("qwen2", {}),  # biases on Q/K/V, none on the output
    ("qwen2", {"is_causal": False}),
    ("eurobert", {}),  # Llama's layers as a bidirectional encoder
    ("eurobert", {"attention_bias": True, "mlp_bias": True}),
]


def _states(reference, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(input_ids=ids, attention_mask=mask).last_hidden_state


def _check_states(model, reference, lengths=LENGTHS) -> None:
    ids, mask = tm.random_padded(lengths)
    want, real = _states(reference, ids, mask), mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)
    packed = model.encode_varlen([row[m] for row, m in zip(ids, real, strict=True)])
    for got, w, m in zip(packed, want, real, strict=True):
        torch.testing.assert_close(got, w[m], **FP32_TOL)


@pytest.mark.parametrize(("family", "overrides"), VARIANTS)
def test_token_states_equal_transformers(tmp_path: Path, family: str, overrides: dict) -> None:
    reference = tm.build(family, **overrides)
    model = mha_engine.load_model(tm.save(reference, tmp_path))
    assert isinstance(model, Qwen3Model) and model.model_type == family
    c = model.config
    head_dim = 16 if overrides.get("head_dim", 16) else tm.D // tm.HEADS
    assert (c.head_norms, c.head_dim, c.num_kv_heads) == (False, head_dim, 2)
    assert c.mlp_bias == bool(overrides.get("mlp_bias"))
    assert c.attention_bias == (family == "qwen2" or bool(overrides.get("attention_bias")))
    assert c.out_bias == bool(overrides.get("attention_bias"))
    assert c.causal == (family != "eurobert" and overrides.get("is_causal", True))
    _check_states(model, reference)


def test_mistral_sliding_window_caps_the_max_length(tmp_path: Path) -> None:
    """Keys at most sliding_window back: inputs no longer than the window are unaffected, so the
    engine takes inputs up to it (longer ones are truncated there) and equals transformers."""
    reference = tm.build("mistral", sliding_window=16)
    model = mha_engine.load_model(tm.save(reference, tmp_path))
    assert model.max_seq_len == 16
    _check_states(model, reference, [16, 9, 1, 16])


def test_mistrals_default_window_caps_long_position_tables() -> None:
    """MistralConfig's sliding_window is 4096 when config.json names none."""
    from mha_engine import hf_llama

    config = tm.hf_config("mistral", max_position_embeddings=32768).to_dict()
    config.pop("sliding_window")
    assert hf_llama.engine_config(config).max_position_embeddings == 4096
    config["sliding_window"] = None  # no window at all
    assert hf_llama.engine_config(config).max_position_embeddings == 32768


def test_eurobert_reads_its_own_defaults() -> None:
    """EuroBertConfig's rms_norm_eps is 1e-5 when config.json names none (Llama's is 1e-6), and
    its attention is bidirectional whatever is_causal says."""
    from mha_engine import hf_llama

    config = tm.hf_config("eurobert").to_dict()
    config.pop("rms_norm_eps")
    got = hf_llama.engine_config({**config, "is_causal": True})
    assert (got.layer_norm_eps, got.causal) == (1e-5, False)


def test_an_unsupported_model_type_names_every_family_that_loads(tmp_path) -> None:
    path = tm.save(tm.build("llama"), tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match=r"'bert'.*'qwen3'.*'eurobert'.*'nomic_bert'"):
        mha_engine.load_model(path)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "eurobert"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_sequences_numbers_never_depend_on_its_batch(tmp_path, family, dtype) -> None:
    model = mha_engine.load_model(tm.save(tm.build(family), tmp_path), dtype=dtype)
    ids, mask = tm.random_padded([9, 9, 4, 17, 1])
    seqs = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    together = model.encode_varlen(seqs)
    for one, got in zip(seqs, together, strict=True):
        assert torch.equal(model.encode_varlen([one])[0], got)


@pytest.mark.parametrize(("family", "overrides"), VARIANTS)
def test_save_model_round_trips_through_transformers(tmp_path, family, overrides) -> None:
    reference = tm.build(family, **overrides)
    model = mha_engine.load_model(tm.save(reference, tmp_path / "src"))
    mha_engine.save_model(model, tmp_path / "out")
    assert mha_engine.load_model(tmp_path / "out").config == model.config
    again = transformers.AutoModel.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert type(again) is type(reference)
    ids, mask = tm.random_padded([9, 4, 30])
    assert torch.equal(_states(again, ids, mask), _states(reference, ids, mask))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_sequence_classifiers_equal_transformers(tmp_path, family) -> None:
    """`...ForSequenceClassification`: the score at each sequence's last token that is not the
    pad token, as transformers reads it."""
    reference = tm.build(family, "ForSequenceClassification", num_labels=3)
    model = mha_engine.load_model(tm.save(reference, tmp_path))
    assert isinstance(model, Qwen3ClassifierModel) and model.info.num_labels == 3
    ids, mask = tm.random_padded([9, 5, 14, 1])
    seqs = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(model.classify_varlen(seqs), want, **FP32_TOL)


def test_a_logit_score_reranker_on_qwen2(tmp_path) -> None:
    """A Qwen2 causal LM scored by sentence-transformers' LogitScore (mxbai-rerank-v2's base
    family): "yes" minus "no" at the last token, against transformers' logits."""
    reference = tm.build("qwen2", "ForCausalLM")
    path = tm.save(reference, tmp_path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_LogitScore", "type": "sentence_transformers.LogitScore"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_LogitScore").mkdir()
    (path / "1_LogitScore" / "config.json").write_text(
        '{"true_token_id": 40, "false_token_id": 41}'
    )
    ids, mask = tm.random_padded([6, 11, 3])
    seqs = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=mask).logits
    last = logits[torch.arange(3), mask.sum(1) - 1]
    got = mha_engine.load_model(path).classify_varlen(seqs)[:, 0]
    torch.testing.assert_close(got, last[:, 40] - last[:, 41], **FP32_TOL)


@pytest.mark.parametrize(
    ("family", "changes", "match"),
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, "sliding-window layers"),
        ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window"),
        ("llama", {"mlp_bias": "yes"}, "mlp_bias must be true or false"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            "low_freq_factor must be a positive number, got None",
        ),
        ("mistral", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("llama", {"is_causal": 0}, "is_causal must be true or false"),
        (
            "eurobert",
            {"architectures": ["EuroBertForSequenceClassification"], "num_labels": 2},
            "EuroBertForSequenceClassification's head",
        ),
    ],
)
def test_what_the_engine_does_not_run_is_refused(tmp_path, family, changes, match) -> None:
    path = tm.save(tm.build(family), tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(CheckpointError, match=match):
        mha_engine.load_model(path)


def test_a_config_naming_its_own_code_is_warned_about(tmp_path, caplog) -> None:
    """gte-Qwen2's config names its own modeling code (auto_map), which transformers runs only
    with trust_remote_code: the engine runs the built-in family, and says so."""
    path = tm.save(tm.build("qwen2"), tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_qwen.Qwen2Model"}
    (path / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="mha_engine.checkpoint"):
        mha_engine.load_model(path)
    assert "auto_map" in caplog.text and "is_causal" in caplog.text
