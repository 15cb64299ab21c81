"""ModernBERT against transformers' ModernBertModel: rotary positions, full and sliding-window
layers (sequences longer and shorter than the window), the padded, packed, hidden-state and
attention-weight paths, both config.json forms, batch invariance in fp32/bf16/int8, the
sequence-classification head in both poolings, save_model round trips, and what is refused
(biases, RoPE scaling, causal masks, CUDA graphs, a SPLADE head)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError, ModernBertModel, cuda_graphs, packed_attention

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm  # noqa: E402
from tests.support import FP32_TOL  # noqa: E402

TEXTS = tm.LONG_AND_SHORT


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory) -> tuple:
    reference = tm.build("modernbert")
    return reference, tm.save(reference, tmp_path_factory.mktemp("modernbert"))


def test_token_states_equal_transformers_padded_and_packed(modernbert) -> None:
    reference, path = modernbert
    model = mha_engine.load_model(path)
    assert isinstance(model, ModernBertModel) and model.model_type == "modernbert"
    layers = ("full_attention", "sliding_attention", "full_attention")
    assert model.config.layer_types == layers and model.config.sliding_window == 4
    ids, mask = tm.random_padded([7, 3, 12, 7, 1, 30])
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)
    packed = model.encode_varlen([row[m] for row, m in zip(ids, real, strict=True)])
    for got, w, m in zip(packed, want, real, strict=True):
        torch.testing.assert_close(got, w[m], **FP32_TOL)


def test_the_original_config_form_loads_the_same_model(modernbert, tmp_path: Path) -> None:
    """answerdotai/ModernBERT-base's config.json: global_attn_every_n_layers and two thetas (not
    the defaults here, so a loader that ignored them would fail)."""
    _, path = modernbert
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"]["full_attention"]["rope_theta"] = 5000.0
    config["rope_parameters"]["sliding_attention"]["rope_theta"] = 500.0
    new, old = tmp_path / "new", tmp_path / "old"
    for directory in (new, old):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    (new / "config.json").write_text(json.dumps(config))
    rope = config.pop("rope_parameters")
    del config["layer_types"]
    config["global_rope_theta"] = rope["full_attention"]["rope_theta"]
    config["local_rope_theta"] = rope["sliding_attention"]["rope_theta"]
    (old / "config.json").write_text(json.dumps(config))
    model = mha_engine.load_model(old)
    assert model.config == mha_engine.load_model(new).config
    assert (model.config.rope_theta, model.config.local_rope_theta) == (5000.0, 500.0)
    reference = transformers.AutoModel.from_pretrained(new, attn_implementation="eager").eval()
    ids, mask = tm.random_padded([12, 7])
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)


def test_hidden_state_api_and_attention_weights(modernbert) -> None:
    """The tensor API runs the layers and final norm on embedded states: transformers'
    inputs_embeds path normalises them first, so ours takes the normalised ones."""
    reference, path = modernbert
    model = mha_engine.load_model(path)
    embeds = torch.randn(2, 9, tm.D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = reference(inputs_embeds=embeds, output_attentions=True)
        hidden = reference.embeddings.norm(embeds)
    torch.testing.assert_close(model(hidden), out.last_hidden_state, **FP32_TOL)
    [packed] = model.forward_varlen([hidden[0]])
    torch.testing.assert_close(packed, out.last_hidden_state[0], **FP32_TOL)
    _, weights = model.attention_weights(hidden)  # (L, B, H, T, T)
    torch.testing.assert_close(weights, torch.stack(out.attentions), **FP32_TOL)
    assert (weights[1][..., 0, 5:] == 0).all()  # the sliding layer: keys 5+ away are hidden


@pytest.mark.parametrize("block", [128, 3])
def test_long_sequences_attend_by_blocks_of_queries(modernbert, monkeypatch, block: int) -> None:
    """A sliding layer's long packed sequences attend block by block to the keys in reach:
    one block (128) or many (3 queries each, so blocks meet the sequence's ends mid-window)."""
    reference, path = modernbert
    monkeypatch.setattr(packed_attention, "BLOCK", block)
    model = mha_engine.load_model(path)
    ids, mask = tm.random_padded([30, 17, 5, 1, 30, 5])
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    seqs = [row[m] for row, m in zip(ids, mask.bool(), strict=True)]
    together = model.encode_varlen(seqs)
    for got, w, m, one in zip(together, want, mask.bool(), seqs, strict=True):
        torch.testing.assert_close(got, w[m], **FP32_TOL)
        assert torch.equal(model.encode_varlen([one])[0], got)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_sequences_numbers_never_depend_on_its_batch(modernbert, dtype: str) -> None:
    """Bit for bit, alone or among sequences shorter and longer than the window (a short one
    takes the CPU varlen kernel in the sliding layer either way, a long one the band mask)."""
    _, path = modernbert
    model = mha_engine.load_model(path, dtype=dtype)
    seqs = [ids for ids, _ in tm.tokenize(path, TEXTS)]
    seqs += [seqs[0].flip(0), seqs[1].flip(0)]  # partners of one length, past and within the window
    alone = [model.encode_varlen([s])[0] for s in seqs]
    together = model.encode_varlen(seqs)
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_bf16_and_int8_stay_close(modernbert, dtype: str) -> None:
    reference, path = modernbert
    encoded = tm.tokenize(path, TEXTS)
    ids, mask, _ = tm.padded(encoded)
    with torch.no_grad():
        hidden = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask[..., None].float()
    want = (hidden * m).sum(1) / m.sum(1)
    got = mha_engine.load_model(path, dtype=dtype).embed_varlen([i for i, _ in encoded])
    # measured here: largest difference 7.9e-3 (bf16), 1.6e-3 (int8) on values of order 1
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"attention_bias": True}, "attention_bias is set"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
            "'linear'",
        ),
        ({"layer_types": ["full_attention", "chunked"]}, "layer_types must name 3 layers"),
        ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling is not supported"),
        (
            {"architectures": ["ModernBertForSequenceClassification"], "classifier_pooling": "max"},
            "classifier_pooling 'max'",
        ),
    ],
)
def test_what_the_engine_does_not_run_is_refused(modernbert, tmp_path, changes, match) -> None:
    _, path = modernbert
    config = {**json.loads((path / "config.json").read_text()), **changes}
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        mha_engine.load_model(tmp_path)


@pytest.mark.parametrize(
    "head", [{}, {"classifier_pooling": "mean", "classifier_bias": True,
                  "classifier_activation": "gelu_pytorch_tanh"}],
)  # fmt: skip
def test_classifier_logits_equal_transformers(tmp_path: Path, head: dict) -> None:
    """ModernBertForSequenceClassification: first-token or mean pooling, then head.dense,
    activation, head.norm, classifier (gte-reranker-modernbert-base's form is the first)."""
    reference, path = tm.classifier("modernbert", tmp_path, **head)
    model = mha_engine.load_model(path)
    assert model.spec.pooling == reference.config.classifier_pooling
    encoded = tm.tokenize(path, TEXTS)
    ids, mask, _ = tm.padded(encoded)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
    got = model.classify_varlen([i for i, _ in encoded])
    torch.testing.assert_close(got, want, **FP32_TOL)
    assert torch.equal(got[2:3], model.classify_varlen([encoded[2][0]]))


def test_save_model_round_trips_through_transformers(modernbert, tmp_path: Path) -> None:
    reference, path = modernbert
    model = mha_engine.load_model(path)
    mha_engine.save_model(model, tmp_path)
    assert mha_engine.load_model(tmp_path).config == model.config
    saved = json.loads((tmp_path / "config.json").read_text())  # transformers 4 reads these
    assert saved["global_attn_every_n_layers"] == 2
    assert (saved["global_rope_theta"], saved["local_rope_theta"]) == (160000.0, 10000.0)
    again = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids, mask = tm.random_padded([9, 4, 30])
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
        got = again(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(got, want)


def test_causal_masks_and_cuda_graphs_are_refused(modernbert, tmp_path, monkeypatch) -> None:
    _, path = modernbert
    model = mha_engine.load_model(path)
    with pytest.raises(ValueError, match="attends both ways"):
        model(torch.randn(1, 3, tm.D), is_causal=True)
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match="band mask"):
        cuda_graphs.capture(model, True, False, 64, 8, 4, None)


def test_a_modernbert_splade_directory_is_refused(tmp_path: Path) -> None:
    _, path = tm.splade(tmp_path / "sp", "modernbert")
    with pytest.raises(CheckpointError, match="modernbert SPLADE model"):
        mha_engine.load_model(path)


def test_batch_invariance_at_a_realistic_size(tmp_path: Path) -> None:
    """Wide enough (256) and long enough (about 1,800 tokens) that torch splits the elementwise
    ops (rotary angles, GELU) among threads at places that depend on the batch's size."""
    reference = tm.build("modernbert", hidden_size=256, intermediate_size=384, local_attention=64,
                         max_position_embeddings=512)  # fmt: skip
    model = mha_engine.load_model(tm.save(reference, tmp_path))
    g = torch.Generator().manual_seed(5)
    lengths = [300, 33, 33, 120, 1, 500, 64, 400, 400, 100]  # 33: within the window (32)
    seqs = [torch.randint(2, len(tm.VOCAB), (n,), generator=g) for n in lengths]
    together = model.encode_varlen(seqs)
    for one, got in zip(seqs, together, strict=True):
        assert torch.equal(model.encode_varlen([one])[0], got)


def test_engine_path_says_how_each_family_attends(modernbert, tmp_path: Path) -> None:
    """The metadata's engine_path: MPNet never takes the varlen kernel; ModernBERT's sliding
    layers attend by blocks."""
    _, path = modernbert
    assert "sliding-window layers" in mha_engine.load_model(path).diagnostics()["engine_path"]
    mpnet = mha_engine.load_model(tm.save(tm.build("mpnet"), tmp_path))
    assert mpnet.diagnostics()["engine_path"].endswith("with MPNet's relative position bias")
