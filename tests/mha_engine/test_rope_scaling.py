"""RoPE scaling (Llama 3.1's `llama3`, `linear`, `yarn`) against transformers: the inverse
frequencies and YaRN's attention factor bit for bit with transformers' own functions, token
states of every rotary decoder family padded and packed past the pre-training length, both
config.json forms, batch invariance, save_model round trips, and the kinds refused (those that
change with the input's length)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError, hf_rope
from mha_engine.rope import inverse_frequencies

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from tests import text_models as tm  # noqa: E402
from tests.support import FP32_TOL  # noqa: E402

LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
QWEN3_YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
              "original_max_position_embeddings": 32768}  # fmt: skip


@pytest.mark.parametrize(
    ("head_dim", "positions", "rope"),
    [
        (64, 4096, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        (128, 131072, LLAMA31),
        (64, 131072, {**LLAMA31, "factor": 32.0}),  # Llama 3.2's
        (128, 131072, QWEN3_YARN),
        (
            64,
            163840,
            {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 4096,
            },
        ),
        (64, 8192, {**QWEN3_YARN, "original_max_position_embeddings": 2048, "truncate": False}),
        (32, 8192, {**QWEN3_YARN, "factor": None, "original_max_position_embeddings": 2048}),
        (32, 8192, {**QWEN3_YARN, "attention_factor": 1.5, "beta_fast": 16.0}),
    ],
)
def test_frequencies_are_transformers_bit_for_bit(head_dim, positions, rope) -> None:
    config = transformers.LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=positions, rope_parameters=dict(rope),
    )  # fmt: skip
    want, want_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
    theta, scaling = hf_rope.single(
        {"max_position_embeddings": positions, "rope_parameters": dict(rope)}, 10000.0
    )
    assert theta == rope["rope_theta"] and scaling.rope_type == rope["rope_type"]
    assert torch.equal(inverse_frequencies(head_dim, theta, scaling), want)
    assert scaling.attention_factor == want_factor


def test_gemma3s_per_kind_yarn_is_transformers_bit_for_bit() -> None:
    """A per-kind entry (Gemma 3's full layers): transformers takes the pre-training length
    from the entry (not a top-level field) and always truncates YaRN's ramp."""
    rope = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "truncate": False,
            "original_max_position_embeddings": 64}  # fmt: skip
    fields = dict(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=1024,
        original_max_position_embeddings=128,  # a top-level field the nested entry ignores
        layer_types=["full_attention", "sliding_attention"], num_hidden_layers=2,
        rope_parameters={"full_attention": dict(rope),
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
    )  # fmt: skip
    config = transformers.Gemma3TextConfig(**fields)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, layer_type="full_attention")
    raw = {**fields, "rope_parameters": {"full_attention": dict(rope)}}
    theta, scaling = hf_rope.per_kind(raw, "full_attention", "rope_theta", 1e6, True)
    assert (theta, scaling.truncate, scaling.original_max_position_embeddings) == (5000.0, True, 64)
    assert torch.equal(inverse_frequencies(16, theta, scaling), want)
    assert scaling.attention_factor == want_factor


SCALED = [  # family, its rope settings (pre-training length 32: the test's inputs run past it)
    (
        "llama",
        {
            "rope_parameters": {
                **LLAMA31,
                "rope_theta": 1000.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    (
        "qwen3",
        {
            "rope_parameters": {
                **QWEN3_YARN,
                "rope_theta": 1000.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
            }
        },
    ),
    ("mistral", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 3.0}}),
    (
        "gemma3_text",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            }
        },
    ),
]
LENGTHS = [7, 100, 33, 1, 64]


def _check_states(model, reference) -> None:
    ids, mask = tm.random_padded(LENGTHS)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)
    packed = model.encode_varlen([row[m] for row, m in zip(ids, real, strict=True)])
    for got, w, m in zip(packed, want, real, strict=True):
        torch.testing.assert_close(got, w[m], **FP32_TOL)


@pytest.mark.parametrize(("family", "rope"), SCALED)
def test_token_states_equal_transformers_past_the_pretraining_length(
    tmp_path: Path, family: str, rope: dict
) -> None:
    reference = tm.build(family, max_position_embeddings=256, **rope)
    model = mha_engine.load_model(tm.save(reference, tmp_path))
    assert model.config.rope_scaling is not None
    _check_states(model, reference)
    # the scaling matters here: the same weights and bases with plain RoPE differ past fp32
    # tolerance
    plain = json.loads((tmp_path / "config.json").read_text())
    params = plain["rope_parameters"]
    for entry in params.values() if "full_attention" in params else [params]:
        for key in set(entry) - {"rope_theta"}:
            del entry[key]
        entry["rope_type"] = "default"
    (tmp_path / "config.json").write_text(json.dumps(plain))
    with pytest.raises(AssertionError):
        _check_states(mha_engine.load_model(tmp_path), reference)


@pytest.mark.parametrize(
    ("family", "legacy"),
    [
        ("llama", {"rope_theta": 1000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}),
        ("qwen3", {"rope_theta": 1000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 32}}),
        ("gemma3_text", {"rope_theta": 5000.0, "rope_local_base_freq": 500.0,
                         "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    ],
)  # fmt: skip
def test_transformers_4s_rope_scaling_field_loads_as_transformers_reads_it(
    tmp_path: Path, family: str, legacy: dict
) -> None:
    """config.json with rope_theta and rope_scaling (no rope_parameters), as transformers 4 wrote
    them: the scaling applies to every layer (Gemma 3: its full layers only)."""
    path = tm.save(tm.build(family, max_position_embeddings=256), tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters")
    (path / "config.json").write_text(json.dumps({**config, **legacy}))
    reference = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    model = mha_engine.load_model(path)
    assert model.config.rope_scaling.factor == legacy["rope_scaling"]["factor"]
    _check_states(model, reference)


@pytest.mark.parametrize(("family", "rope"), SCALED[:2] + SCALED[-1:])
def test_save_model_round_trips_through_transformers(tmp_path, family, rope) -> None:
    reference = tm.build(family, max_position_embeddings=256, **rope)
    model = mha_engine.load_model(tm.save(reference, tmp_path / "src"))
    mha_engine.save_model(model, tmp_path / "out")
    assert mha_engine.load_model(tmp_path / "out").config == model.config
    again = transformers.AutoModel.from_pretrained(tmp_path / "out", attn_implementation="eager")
    ids, mask = tm.random_padded(LENGTHS)
    with torch.no_grad():
        got = again(input_ids=ids, attention_mask=mask).last_hidden_state
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sequences_numbers_never_depend_on_its_batch(tmp_path, dtype) -> None:
    family, rope = SCALED[1]  # YaRN: scaled frequencies and a scaled cos/sin
    path = tm.save(tm.build(family, max_position_embeddings=256, **rope), tmp_path)
    model = mha_engine.load_model(path, dtype=dtype)
    ids, mask = tm.random_padded(LENGTHS)
    seqs = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    together = model.encode_varlen(seqs)
    for one, got in zip(seqs, together, strict=True):
        assert torch.equal(model.encode_varlen([one])[0], got)


@pytest.mark.parametrize(
    ("family", "changes", "match"),
    [
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "input's length"),
        ("qwen3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}, "longrope"),
        ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 0}}, "factor must be a"),
        ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                       "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ("mistral", {"rope_parameters": {"rope_type": "proportional"}}, "'proportional'"),
        ("qwen3", {"rope_scaling": {"type": "ntk", "factor": 2.0}}, "'ntk' is not"),  # GTE's only
        ("qwen2", {"rope_parameters": {**LLAMA31, "high_freq_factor": 1.0}}, "must exceed"),
        ("qwen3", {"rope_parameters": {**QWEN3_YARN, "mscale": "x", "mscale_all_dim": 1}},
         "mscale and mscale_all_dim must be numbers"),
        ("llama", {"rope_scaling": ["linear", 2.0]}, "rope_scaling must be an object"),
        ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0},
                   "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("qwen3", {"rope_parameters": {**QWEN3_YARN, "factor": None},
                   "max_position_embeddings": "long"}, "factor is null"),
        ("qwen3", {"rope_parameters": {**QWEN3_YARN, "rope_theta": 1}}, "rope_theta must not"),
        ("gemma3_text", {"rope_parameters": [1]}, "rope_parameters must be an object"),
    ],
)  # fmt: skip
def test_what_the_engine_does_not_run_is_refused(tmp_path, family, changes, match) -> None:
    path = tm.save(tm.build(family), tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(CheckpointError, match=match):
        mha_engine.load_model(path)
