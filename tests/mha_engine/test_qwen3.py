"""Qwen3 (Qwen3-Embedding) against transformers' Qwen3Model: causal grouped-query attention of
heads not as wide as the model, per-head RMSNorms, RoPE, SwiGLU; the padded, packed,
hidden-state and attention-weight paths, last-token pooling as sentence-transformers runs it
(left padding), causal-LM checkpoints, attention biases, batch invariance in fp32/bf16/int8,
save_model round trips, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError, Qwen3Model, cuda_graphs

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm  # noqa: E402
from tests.support import FP32_TOL  # noqa: E402

TEXTS = tm.LONG_AND_SHORT


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple:
    reference = tm.build("qwen3")
    return reference, tm.save(reference, tmp_path_factory.mktemp("qwen3"))


def _states(reference, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.mark.parametrize("bias", [False, True])
def test_token_states_equal_transformers_padded_and_packed(tmp_path: Path, bias: bool) -> None:
    reference = tm.build("qwen3", attention_bias=bias)
    model = mha_engine.load_model(tm.save(reference, tmp_path))
    assert isinstance(model, Qwen3Model) and model.model_type == "qwen3"
    c = model.config
    assert (c.nhead, c.num_kv_heads, c.head_dim, c.d_model, c.rope_theta) == (4, 2, 16, 32, 1e3)
    assert (model.num_kv_heads, model.head_dim, c.attention_bias) == (2, 16, bias)
    ids, mask = tm.random_padded([7, 3, 12, 7, 1, 30])
    want, real = _states(reference, ids, mask), mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)
    packed = model.encode_varlen([row[m] for row, m in zip(ids, real, strict=True)])
    for got, w, m in zip(packed, want, real, strict=True):
        torch.testing.assert_close(got, w[m], **FP32_TOL)


def test_last_token_vectors_equal_sentence_transformers_left_padded(tmp_path: Path) -> None:
    """Qwen3-Embedding's files: last-token pooling, Normalize; sentence-transformers pads on the
    left and transformers counts positions over the padded width, which RoPE turns into the
    same relative angles: equal to ours within fp32 rounding."""
    reference, path = tm.sentence_transformer(tmp_path, "last_token", True, model_type="qwen3")
    model = mha_engine.load_model(path)
    assert (model.pooling, model.normalize) == ("last_token", True)
    seqs = [ids for ids, _ in tm.tokenize(path, TEXTS)]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), tm.PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, T - len(s) :], mask[i, T - len(s) :] = s, 1
    last = _states(reference, ids, mask)[:, -1]  # left padding: the last column is real
    want = torch.nn.functional.normalize(last, dim=-1)
    torch.testing.assert_close(model.embed_varlen(seqs), want, **FP32_TOL)
    torch.testing.assert_close(model.embed(ids, mask), want, **FP32_TOL)  # left-padded too
    right_ids, right_mask, _ = tm.padded(tm.tokenize(path, TEXTS))
    torch.testing.assert_close(model.embed(right_ids, right_mask), want, **FP32_TOL)


def test_a_causal_lm_checkpoint_loads_its_base_model(qwen3, tmp_path: Path) -> None:
    """Qwen3-Embedding ships as Qwen3ForCausalLM-shaped files too: `model.` keys and an
    lm_head the engine leaves alone."""
    reference, _ = qwen3
    lm = tm.build("qwen3", "ForCausalLM")
    lm.model.load_state_dict(reference.state_dict())
    model = mha_engine.load_model(tm.save(lm, tmp_path))
    ids, mask = tm.random_padded([9, 4])
    real = mask.bool()
    want = _states(reference, ids, mask)
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)


def test_hidden_state_api_and_attention_weights(qwen3) -> None:
    """The tensor API runs the layers and final norm on embedded states, causally; the weights
    are transformers' eager ones (zero above the diagonal)."""
    reference, path = qwen3
    model = mha_engine.load_model(path)
    embeds = torch.randn(2, 9, tm.D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = reference(inputs_embeds=embeds, output_attentions=True)
    torch.testing.assert_close(model(embeds), out.last_hidden_state, **FP32_TOL)
    [packed] = model.forward_varlen([embeds[0]])
    torch.testing.assert_close(packed, out.last_hidden_state[0], **FP32_TOL)
    _, weights = model.attention_weights(embeds)  # (L, B, H, T, T)
    torch.testing.assert_close(weights, torch.stack(out.attentions), **FP32_TOL)
    assert (weights.triu(diagonal=1) == 0).all()
    shares = model.head_importance()  # out_proj is (32, 64): heads read from its columns
    assert len(shares) == tm.LAYERS and len(shares[0]["head_share"]) == tm.HEADS


def test_packed_sequences_past_the_cpu_kernel_take_causal_sdpa(qwen3, monkeypatch) -> None:
    """Lengths past the CPU varlen kernel's limit (here 4) run grouped causal SDPA calls: the
    same numbers as transformers'."""
    from mha_engine import cpu_varlen

    reference, path = qwen3
    monkeypatch.setitem(cpu_varlen.MAX_LEN, "AVX512", {torch.float32: 4})
    monkeypatch.setitem(cpu_varlen.MAX_LEN, "other", {torch.float32: 4})
    model = mha_engine.load_model(path)
    ids, mask = tm.random_padded([30, 3, 17, 17, 1])
    want, real = _states(reference, ids, mask), mask.bool()
    packed = model.encode_varlen([row[m] for row, m in zip(ids, real, strict=True)])
    for got, w, m in zip(packed, want, real, strict=True):
        torch.testing.assert_close(got, w[m], **FP32_TOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_sequences_numbers_never_depend_on_its_batch(qwen3, dtype: str) -> None:
    _, path = qwen3
    model = mha_engine.load_model(path, dtype=dtype)
    seqs = [ids for ids, _ in tm.tokenize(path, TEXTS)]
    seqs += [seqs[0].flip(0), seqs[2].flip(0)]  # partners of the same length
    alone = [model.encode_varlen([s])[0] for s in seqs]
    together = model.encode_varlen(seqs)
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_bf16_and_int8_stay_close(qwen3, dtype: str) -> None:
    reference, path = qwen3
    seqs = [ids for ids, _ in tm.tokenize(path, TEXTS)]
    ids, mask, _ = tm.padded(tm.tokenize(path, TEXTS))
    hidden = _states(reference, ids, mask)
    want = hidden[torch.arange(len(seqs)), mask.sum(1) - 1]  # the last real tokens
    got = mha_engine.load_model(path, dtype=dtype).embed_varlen(seqs, pooling="last_token")
    # measured here, on values up to 2.9 (RMS 1.0): largest difference 2.9e-2 (bf16), 5.3e-2
    # (int8); least cosine similarity 0.99994 (bf16), 0.99984 (int8)
    torch.testing.assert_close(got, want, atol=8e-2, rtol=0)
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.999


def test_batch_invariance_at_a_realistic_size(tmp_path: Path) -> None:
    """Wide enough (256, 8 heads of 64 on 2 K/V heads) and long enough (about 1,900 tokens,
    past the CPU kernel's limit) that torch splits its ops among threads by the batch's size."""
    reference = tm.build("qwen3", hidden_size=256, intermediate_size=384, num_attention_heads=8,
                         head_dim=64, max_position_embeddings=512)  # fmt: skip
    model = mha_engine.load_model(tm.save(reference, tmp_path))
    g = torch.Generator().manual_seed(5)
    lengths = [300, 33, 33, 120, 1, 500, 64, 400, 400, 100]
    seqs = [torch.randint(4, len(tm.VOCAB), (n,), generator=g) for n in lengths]
    together = model.encode_varlen(seqs)
    for one, got in zip(seqs, together, strict=True):
        assert torch.equal(model.encode_varlen([one])[0], got)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "the input's length"),
        ({"use_sliding_window": True, "sliding_window": 8}, "sliding-window layers"),
        ({"num_key_value_heads": 3}, "multiple of config.num_key_value_heads 3"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"is_causal": "no"}, "is_causal must be true or false"),
        ({"architectures": ["Qwen3ForSequenceClassification"]}, "needs score.weight"),
    ],
)
def test_what_the_engine_does_not_run_is_refused(qwen3, tmp_path, changes, match) -> None:
    _, path = qwen3
    config = {**json.loads((path / "config.json").read_text()), **changes}
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        mha_engine.load_model(tmp_path)


def test_transformers_4_config_form_loads(qwen3, tmp_path: Path) -> None:
    """rope_theta at the top level (transformers 4's Qwen3Config) instead of rope_parameters."""
    _, path = qwen3
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert mha_engine.load_model(tmp_path).config == mha_engine.load_model(path).config
    del config["rope_theta"]  # neither form: transformers' default base, 10,000
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert mha_engine.load_model(tmp_path).config.rope_theta == 10000.0


@pytest.mark.parametrize("bias", [False, True])
def test_save_model_round_trips_through_transformers(tmp_path: Path, bias: bool) -> None:
    reference = tm.build("qwen3", attention_bias=bias)
    model = mha_engine.load_model(tm.save(reference, tmp_path / "src"))
    mha_engine.save_model(model, tmp_path / "out")
    assert mha_engine.load_model(tmp_path / "out").config == model.config
    again = transformers.AutoModel.from_pretrained(tmp_path / "out", attn_implementation="eager")
    ids, mask = tm.random_padded([9, 4, 30])
    assert torch.equal(_states(again, ids, mask), _states(reference, ids, mask))


def test_a_bidirectional_qwen3_equals_transformers(tmp_path: Path) -> None:
    """config.json's is_causal false (transformers 5 then runs the decoder's attention
    bidirectionally, as bidirectional Qwen3 embedders ask): padded, packed, and past the CPU
    kernel's limit; eager attention weights; batch invariance in every precision; a save_model
    round trip that transformers reads back the same way."""
    from mha_engine import cpu_varlen

    reference = tm.build("qwen3", is_causal=False)
    model = mha_engine.load_model(tm.save(reference, tmp_path / "src"))
    assert model.config.causal is False
    assert "bidirectional grouped-query" in model.diagnostics()["engine_path"]
    ids, mask = tm.random_padded([7, 3, 12, 7, 1, 30])
    want, real = _states(reference, ids, mask), mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)
    seqs = [row[m] for row, m in zip(ids, real, strict=True)]
    for got, w, m in zip(model.encode_varlen(seqs), want, real, strict=True):
        torch.testing.assert_close(got, w[m], **FP32_TOL)
    with pytest.MonkeyPatch.context() as patch:  # grouped SDPA calls beyond 4 tokens
        patch.setitem(cpu_varlen.MAX_LEN, "AVX512", {torch.float32: 4})
        patch.setitem(cpu_varlen.MAX_LEN, "other", {torch.float32: 4})
        for got, w, m in zip(model.encode_varlen(seqs), want, real, strict=True):
            torch.testing.assert_close(got, w[m], **FP32_TOL)
    embeds = torch.randn(2, 9, tm.D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = reference(inputs_embeds=embeds, output_attentions=True)
    _, weights = model.attention_weights(embeds)
    torch.testing.assert_close(weights, torch.stack(out.attentions), **FP32_TOL)
    assert (weights.triu(diagonal=1) > 0).any()
    for dtype in ("float32", "bfloat16", "int8"):
        one = mha_engine.load_model(tmp_path / "src", dtype=dtype)
        together = one.encode_varlen(seqs)
        for alone, got in zip(seqs, together, strict=True):
            assert torch.equal(one.encode_varlen([alone])[0], got)
    mha_engine.save_model(model, tmp_path / "out")
    assert mha_engine.load_model(tmp_path / "out").config == model.config
    again = transformers.AutoModel.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert torch.equal(_states(again, ids, mask), _states(reference, ids, mask))


def test_non_causal_calls_and_cuda_graphs_are_refused(qwen3, monkeypatch) -> None:
    _, path = qwen3
    model = mha_engine.load_model(path)
    with pytest.raises(ValueError, match="attends causally"):
        model(torch.randn(1, 3, tm.D), mask=torch.zeros(3, 3))
    assert "causal grouped-query attention" in model.diagnostics()["engine_path"]
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match="CUDA graphs"):
        cuda_graphs.capture(model, True, False, 64, 8, 4, None)
