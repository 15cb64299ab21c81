"""Gemma 3 as EmbeddingGemma runs it (bidirectional) against transformers' Gemma3TextModel:
grouped-query heads not as wide as the model, Gemma's (1 + weight) RMSNorms around attention and
feed-forward, full and sliding layers with their own RoPE bases (sequences longer and shorter than
the window), the padded, packed, hidden-state and attention-weight paths, both config.json forms,
sentence-transformers' mean pooling + two Dense + Normalize, batch invariance in fp32/bf16/int8,
save_model round trips, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError, Gemma3Model, cuda_graphs, packed_attention
from mha_engine.quantize import activation_levels

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm  # noqa: E402
from tests.support import FP32_TOL  # noqa: E402

TEXTS = tm.LONG_AND_SHORT


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> tuple:
    reference = tm.build("gemma3_text")
    return reference, tm.save(reference, tmp_path_factory.mktemp("gemma3"))


def _states(reference, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(input_ids=ids, attention_mask=mask).last_hidden_state


def _copy(path: Path, directory: Path, config: dict) -> Path:
    directory.mkdir()
    (directory / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_token_states_equal_transformers_padded_and_packed(gemma) -> None:
    reference, path = gemma
    model = mha_engine.load_model(path)
    assert isinstance(model, Gemma3Model) and model.model_type == "gemma3_text"
    c = model.config
    assert (c.sliding_window, c.rope_theta, c.local_rope_theta) == (4, 5000.0, 500.0)
    assert (model.num_kv_heads, model.head_dim) == (2, 16)
    ids, mask = tm.random_padded([7, 3, 12, 7, 1, 30])
    want, real = _states(reference, ids, mask), mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)
    packed = model.encode_varlen([row[m] for row, m in zip(ids, real, strict=True)])
    for got, w, m in zip(packed, want, real, strict=True):
        torch.testing.assert_close(got, w[m], **FP32_TOL)


def test_the_earlier_config_form_loads_the_same_model(gemma, tmp_path: Path) -> None:
    """sliding_window_pattern, rope_theta and rope_local_base_freq (configs written before
    transformers 5), not the defaults, so a loader that ignored them would fail."""
    _, path = gemma
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    del config["layer_types"]
    config["sliding_window_pattern"] = 2  # sliding, full, sliding
    config["rope_theta"] = rope["full_attention"]["rope_theta"]
    config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    old = mha_engine.load_model(_copy(path, tmp_path / "old", config))
    assert old.config == mha_engine.load_model(path).config


def test_hidden_state_api_and_attention_weights(gemma) -> None:
    """The tensor API runs the layers and final norm on embedded (scaled) states."""
    reference, path = gemma
    model = mha_engine.load_model(path)
    embeds = torch.randn(2, 11, tm.D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = reference(inputs_embeds=embeds, output_attentions=True)
    torch.testing.assert_close(model(embeds), out.last_hidden_state, **FP32_TOL)
    [packed] = model.forward_varlen([embeds[0]])
    torch.testing.assert_close(packed, out.last_hidden_state[0], **FP32_TOL)
    _, weights = model.attention_weights(embeds)  # (L, B, H, T, T)
    torch.testing.assert_close(weights, torch.stack(out.attentions), **FP32_TOL)
    assert (weights[0][..., 0, 5:] == 0).all() and (weights[1][..., 0, 5:] > 0).all()


@pytest.mark.parametrize("block", [128, 3])
def test_long_sequences_attend_by_blocks_of_queries(gemma, monkeypatch, block: int) -> None:
    reference, path = gemma
    monkeypatch.setattr(packed_attention, "BLOCK", block)
    model = mha_engine.load_model(path)
    ids, mask = tm.random_padded([30, 17, 5, 1, 30, 5])
    want = _states(reference, ids, mask)
    seqs = [row[m] for row, m in zip(ids, mask.bool(), strict=True)]
    together = model.encode_varlen(seqs)
    for got, w, m, one in zip(together, want, mask.bool(), seqs, strict=True):
        torch.testing.assert_close(got, w[m], **FP32_TOL)
        assert torch.equal(model.encode_varlen([one])[0], got)


def test_embeddinggemma_layout_mean_two_dense_normalize(tmp_path: Path) -> None:
    """google/embeddinggemma-300m's sentence-transformers modules: mean pooling, Dense up and
    Dense down without bias or activation, Normalize."""
    reference, path = tm.sentence_transformer(tmp_path, "mean", True, model_type="gemma3_text")
    identity = "linear.Identity"
    up, down = tm.add_dense(path, [(tm.D, 64, False, identity), (64, tm.D, False, identity)])
    model = mha_engine.load_model(path)
    ids, mask, _ = tm.padded(tm.tokenize(path, TEXTS))
    m = mask[..., None].float()
    with torch.no_grad():
        mean = (_states(reference, ids, mask) * m).sum(1) / m.sum(1)
        want = torch.nn.functional.normalize(down(up(mean)))
    seqs = [i for i, _ in tm.tokenize(path, TEXTS)]
    torch.testing.assert_close(model.embed_varlen(seqs), want, **FP32_TOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_sequences_numbers_never_depend_on_its_batch(gemma, dtype: str) -> None:
    _, path = gemma
    model = mha_engine.load_model(path, dtype=dtype)
    seqs = [ids for ids, _ in tm.tokenize(path, TEXTS)]
    seqs += [seqs[0].flip(0), seqs[1].flip(0)]  # partners of one length, past and within the window
    alone = [model.encode_varlen([s])[0] for s in seqs]
    together = model.encode_varlen(seqs)
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_bf16_and_int8_stay_close(gemma, dtype: str) -> None:
    reference, path = gemma
    encoded = tm.tokenize(path, TEXTS)
    ids, mask, _ = tm.padded(encoded)
    m = mask[..., None].float()
    want = (_states(reference, ids, mask) * m).sum(1) / m.sum(1)
    got = mha_engine.load_model(path, dtype=dtype).embed_varlen([i for i, _ in encoded])
    # measured on values up to 2.1: largest difference 2.2e-2 (bf16), 5.4e-2 (int8 with 8-bit
    # activations, a VNNI CPU), 0.117 (7-bit, AVX2 without VNNI); least cosine similarity
    # 0.99995 (bf16), 0.99955 (8-bit), 0.99884 (7-bit)
    seven_bit = dtype == "int8" and activation_levels() < 127
    torch.testing.assert_close(got, want, atol=0.15 if seven_bit else 8e-2, rtol=0)
    cosine = torch.nn.functional.cosine_similarity(got, want).min()
    assert cosine > (0.998 if seven_bit else 0.999)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"use_bidirectional_attention": False}, "causal Gemma 3 is a generative model"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is set"),
        ({"query_pre_attn_scalar": 32}, "query_pre_attn_scalar 32 is not head_dim 16"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "rope_type 'dynamic'"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "sliding_attention.rope_type 'linear' is not supported here",
        ),
        ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
        ({"layer_types": ["full_attention", "chunked"]}, "layer_types must name 3 layers"),
        ({"architectures": ["Gemma3ForSequenceClassification"]}, "gemma3_text sequence"),
    ],
)
def test_what_the_engine_does_not_run_is_refused(gemma, tmp_path, changes, match) -> None:
    _, path = gemma
    config = {**json.loads((path / "config.json").read_text()), **changes}
    with pytest.raises(CheckpointError, match=match):
        mha_engine.load_model(_copy(path, tmp_path / "bad", config))


def test_save_model_round_trips_through_transformers(gemma, tmp_path: Path) -> None:
    reference, path = gemma
    model = mha_engine.load_model(path)
    mha_engine.save_model(model, tmp_path)
    assert mha_engine.load_model(tmp_path).config == model.config
    again = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="eager")
    assert again.config.sliding_window == reference.config.sliding_window
    ids, mask = tm.random_padded([9, 4, 30])
    assert torch.equal(_states(again, ids, mask), _states(reference, ids, mask))


def test_causal_masks_and_cuda_graphs_are_refused(gemma, monkeypatch) -> None:
    _, path = gemma
    model = mha_engine.load_model(path)
    with pytest.raises(ValueError, match="attends both ways"):
        model(torch.randn(1, 3, tm.D), is_causal=True)
    assert "sliding-window layers" in model.diagnostics()["engine_path"]
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match="CUDA graphs"):
        cuda_graphs.capture(model, True, False, 64, 8, 4, None)
