"""NomicBERT (nomic-embed-text) and GTE (gte-multilingual) against transformers' own NomicBertModel
and GteModel: token states padded and packed, attention weights, the Hub's own forms (weights
named for their remote code, which transformers renames at load; nomic's GPT-2 config fields;
GTE's `new` model type), sequence classifiers and rerankers, batch invariance in fp32/bf16/int8,
save_model round trips, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import mha_engine
from mha_engine import CheckpointError, RotaryBertModel, cuda_graphs, rope
from mha_engine.rotary_bert import RotaryBertClassifierModel

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm  # noqa: E402
from tests.support import FP32_TOL  # noqa: E402

FAMILIES = ["nomic_bert", "gte"]
LENGTHS = [7, 3, 12, 7, 1, 30]


@pytest.fixture(scope="module", params=FAMILIES)
def built(request, tmp_path_factory) -> tuple:
    reference = tm.build(request.param)
    return reference, tm.save(reference, tmp_path_factory.mktemp(request.param))


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


def test_token_states_equal_transformers_padded_and_packed(built) -> None:
    reference, path = built
    model = mha_engine.load_model(path)
    family = reference.config.model_type
    assert isinstance(model, RotaryBertModel) and model.model_type == family
    c = model.config
    assert (c.attention_bias, c.down_bias) == ((True, True) if family == "gte" else (False, False))
    assert (c.activation, c.rope_theta) == ("silu" if family == "nomic_bert" else "gelu", 1000.0)
    _check_states(model, reference)


def test_attention_weights_equal_transformers(built) -> None:
    reference, path = built
    model = mha_engine.load_model(path)
    ids, mask = tm.random_padded([9])
    with torch.no_grad():
        out = reference(input_ids=ids, attention_mask=mask, output_attentions=True)
        embeds = model.embeddings(ids).to(model.dtype)
    _, weights = model.attention_weights(embeds)  # (L, B, H, T, T)
    torch.testing.assert_close(weights, torch.stack(out.attentions), **FP32_TOL)


def _hub_names(state: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """transformers' names back to the Hub checkpoints' (the inverse of transformers'
    conversion_mapping for the family, which from_pretrained applies)."""
    out = {}
    for key, value in state.items():
        if not key.startswith("layers."):
            nomic_ln = family == "nomic_bert" and key.startswith("embeddings.LayerNorm.")
            out[key.replace("embeddings.LayerNorm.", "emb_ln.") if nomic_ln else key] = value
            continue
        i, rest = key.split(".", 2)[1:]
        p = f"encoder.layers.{i}." if family == "nomic_bert" else f"encoder.layer.{i}."
        nomic = {"self_attn.o_proj": "attn.out_proj", "mlp.up_proj": "mlp.fc11",
                 "mlp.gate_proj": "mlp.fc12", "mlp.down_proj": "mlp.fc2",
                 "post_attention_layernorm": "norm1", "post_mlp_layernorm": "norm2"}  # fmt: skip
        gte = {"self_attn.o_proj": "attention.o_proj", "mlp.down_proj": "mlp.down_proj",
               "post_attention_layernorm": "attn_ln", "post_mlp_layernorm": "mlp_ln"}  # fmt: skip
        module, leaf = rest.rsplit(".", 1)
        names = nomic if family == "nomic_bert" else gte
        if module in names:
            out[f"{p}{names[module]}.{leaf}"] = value
        elif module == "self_attn.q_proj":
            parts = [state[key.replace("q_proj", n)] for n in ("q_proj", "k_proj", "v_proj")]
            fused = "attn.Wqkv" if family == "nomic_bert" else "attention.qkv_proj"
            out[f"{p}{fused}.{leaf}"] = torch.cat(parts)
        elif module == "mlp.up_proj" and family == "gte":
            gate = state[key.replace("up_proj", "gate_proj")]
            out[f"{p}mlp.up_gate_proj.{leaf}"] = torch.cat([value, gate])
    return out


def _hub_form(reference, directory: Path, config: dict | None = None, prefix: str = "") -> Path:
    directory.mkdir()
    family = reference.config.model_type
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    base = family + "."
    head = {k: v for k, v in state.items() if not k.startswith(base)}
    if head.keys() != state.keys():  # a task model: its base under the family's prefix
        inner = {k[len(base) :]: v for k, v in state.items() if k.startswith(base)}
        state = {**{prefix + k: v for k, v in _hub_names(inner, family).items()}, **head}
    else:
        state = _hub_names(state, family)
    save_file(state, directory / "model.safetensors")
    written = config or reference.config.to_dict()
    (directory / "config.json").write_text(json.dumps(written))
    tm.write_tokenizer(directory, 0)
    return directory


@pytest.mark.parametrize("family", FAMILIES)
def test_the_hubs_weight_names_load_as_transformers_renames_them(tmp_path, family) -> None:
    reference = tm.build(family)
    path = _hub_form(reference, tmp_path / "hub")
    again = transformers.AutoModel.from_pretrained(path, attn_implementation="eager")
    ids, mask = tm.random_padded(LENGTHS)
    assert torch.equal(_states(again, ids, mask), _states(reference, ids, mask))
    _check_states(mha_engine.load_model(path), reference)


def test_nomic_embed_texts_own_config_fields(tmp_path) -> None:
    """nomic-embed-text's config.json (written for its remote code): GPT-2's field names."""
    reference = tm.build("nomic_bert")
    c = reference.config
    config = {
        "model_type": "nomic_bert", "architectures": ["NomicBertModel"],
        "auto_map": {"AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"
                     },
        "n_embd": c.hidden_size, "n_head": c.num_attention_heads, "n_layer": c.num_hidden_layers,
        "n_inner": c.intermediate_size, "n_positions": 8192, "max_trained_positions": 2048,
        "activation_function": "swiglu", "layer_norm_epsilon": c.layer_norm_eps,
        "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
        "rotary_scaling_factor": None, "prenorm": False, "causal": False, "qkv_proj_bias": False,
        "mlp_fc1_bias": False, "mlp_fc2_bias": False, "use_rms_norm": False,
        "parallel_block": False, "type_vocab_size": 2, "vocab_size": c.vocab_size,
        "pad_token_id": 0,
    }  # fmt: skip
    model = mha_engine.load_model(_hub_form(reference, tmp_path / "hub", config))
    assert (model.config.d_model, model.config.max_position_embeddings) == (tm.D, 8192)
    _check_states(model, reference)
    # dynamic NTK past the trained length: the max length stops there (plain RoPE up to it)
    config.update(rotary_scaling_factor=2.0, max_trained_positions=32)
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    model = mha_engine.load_model(tmp_path / "hub")
    assert (model.max_seq_len, model.config.rope_scaling) == (32, None)
    _check_states(model, reference, [30, 7, 1])


def test_gtes_new_model_type_loads_as_gte(tmp_path) -> None:
    """gte-multilingual-base's config.json names model_type `new` (its remote code)."""
    reference = tm.build("gte")
    config = {
        **reference.config.to_dict(), "model_type": "new", "architectures": ["NewModel"],
        "position_embedding_type": "rope", "layer_norm_type": "layer_norm",
        "logn_attention_scale": False, "logn_attention_clip1": False, "pack_qkv": True,
        "unpad_inputs": True,
    }  # fmt: skip
    model = mha_engine.load_model(_hub_form(reference, tmp_path / "hub", config))
    assert model.model_type == "gte"
    _check_states(model, reference)


def _gte_en_v15(tmp_path: Path, factor: float = 2.0, theta: float = 1000.0) -> tuple:
    """gte-base-en-v1.5's form (model_type new, no token types, `rope_scaling` fixed NTK, which
    transformers 5 cannot load) beside its reference: transformers' GteModel with base
    theta * factor and linear scaling by factor^(2 / head_dim), the frequencies NTK defines."""
    head_dim = tm.D // tm.HEADS
    linear = {"rope_type": "linear", "factor": factor ** (2 / head_dim)}
    linear["rope_theta"] = theta * factor
    reference = tm.build("gte", type_vocab_size=0, rope_parameters=linear)
    config = {**reference.config.to_dict(), "model_type": "new", "architectures": ["NewModel"],
              "rope_theta": theta, "rope_scaling": {"type": "ntk", "factor": factor}}  # fmt: skip
    del config["rope_parameters"]
    return reference, _hub_form(reference, tmp_path / "hub", config)


def test_gte_en_v15s_fixed_ntk_scaling_equals_transformers_linear_form(tmp_path) -> None:
    reference, path = _gte_en_v15(tmp_path)
    model = mha_engine.load_model(path)
    c = model.config
    assert (c.type_vocab_size, c.rope_theta, c.rope_scaling.rope_type) == (0, 1000.0, "ntk")
    assert "embeddings.token_type_embeddings.weight" not in model.state_dict()
    head_dim = tm.D // tm.HEADS  # the frequencies are transformers' linear ones, bit for bit
    ours = rope.inverse_frequencies(head_dim, c.rope_theta, c.rope_scaling)
    assert torch.equal(ours, reference.rotary_emb.inv_freq)
    # and GTE's remote code's expression, written out: 1 / (theta * s)^(2i / d) / s^(2 / d)
    base, s = 1000.0 * 2.0, 2.0
    literal = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim) / s ** (2 / head_dim)
    assert torch.equal(ours, literal)
    _check_states(model, reference)
    # unscaled RoPE on the same weights is not close: the check above exercises the scaling
    (path / "config.json").write_text(
        json.dumps({**json.loads((path / "config.json").read_text()), "rope_scaling": None})
    )
    with pytest.raises(AssertionError):
        _check_states(mha_engine.load_model(path), reference)


def test_save_model_writes_fixed_ntk_as_transformers_loads_it(tmp_path) -> None:
    reference, path = _gte_en_v15(tmp_path)
    mha_engine.save_model(mha_engine.load_model(path), tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["rope_parameters"] == reference.config.rope_parameters
    again = transformers.AutoModel.from_pretrained(tmp_path / "out", attn_implementation="eager")
    ids, mask = tm.random_padded(LENGTHS)
    assert torch.equal(_states(again, ids, mask), _states(reference, ids, mask))
    _check_states(mha_engine.load_model(tmp_path / "out"), reference)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("labels", [3, 1])
def test_sequence_classifiers_and_rerankers_equal_transformers(tmp_path, family, labels) -> None:
    """`...ForSequenceClassification`: BERT's pooler (first token, dense, tanh) and classifier;
    one label: a reranker (gte-multilingual-reranker-base's form)."""
    reference = tm.build(family, "ForSequenceClassification", num_labels=labels)
    model = mha_engine.load_model(tm.save(reference, tmp_path / "native"))
    assert isinstance(model, RotaryBertClassifierModel) and model.info.num_labels == labels
    ids, mask = tm.random_padded([9, 5, 14, 1])
    seqs = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(model.classify_varlen(seqs), want, **FP32_TOL)
    if family == "gte":  # the Hub's form: `new.` prefix, model_type new
        config = {**reference.config.to_dict(), "model_type": "new",
                  "architectures": ["NewForSequenceClassification"]}  # fmt: skip
        hub = mha_engine.load_model(_hub_form(reference, tmp_path / "hub", config, "new."))
        torch.testing.assert_close(hub.classify_varlen(seqs), want, **FP32_TOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_sequences_numbers_never_depend_on_its_batch(built, dtype) -> None:
    _, path = built
    model = mha_engine.load_model(path, dtype=dtype)
    ids, mask = tm.random_padded(LENGTHS)
    seqs = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    together = model.encode_varlen(seqs)
    for one, got in zip(seqs, together, strict=True):
        assert torch.equal(model.encode_varlen([one])[0], got)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_bf16_and_int8_stay_close(built, dtype) -> None:
    reference, path = built
    ids, mask = tm.random_padded(LENGTHS)
    m = mask[..., None].float()
    want = (_states(reference, ids, mask) * m).sum(1) / m.sum(1)
    seqs = [row[k.bool()] for row, k in zip(ids, mask, strict=True)]
    got = mha_engine.load_model(path, dtype=dtype).embed_varlen(seqs)
    # measured here on mean-pooled values up to 2.2: bf16 1.7e-2 (NomicBERT), 2.4e-2 (GTE); int8
    # 3.2e-3, 2.4e-3; least cosine similarity 0.99998 (bf16), 0.999999 (int8)
    torch.testing.assert_close(got, want, atol=5e-2, rtol=0)


def test_save_model_round_trips_through_transformers(built, tmp_path) -> None:
    reference, path = built
    model = mha_engine.load_model(path)
    mha_engine.save_model(model, tmp_path / "out")
    assert mha_engine.load_model(tmp_path / "out").config == model.config
    again = transformers.AutoModel.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert type(again) is type(reference)
    ids, mask = tm.random_padded(LENGTHS)
    assert torch.equal(_states(again, ids, mask), _states(reference, ids, mask))


@pytest.mark.parametrize(
    ("family", "changes", "match"),
    [
        ("nomic_bert", {"prenorm": True}, "prenorm is True"),
        ("nomic_bert", {"rotary_emb_fraction": 0.5}, "rotary_emb_fraction"),
        ("nomic_bert", {"qkv_proj_bias": True}, "qkv_proj_bias"),
        ("nomic_bert", {"hidden_act": "relu"}, "hidden_act 'relu'"),
        ("nomic_bert", {"hidden_act": ["silu"]}, "hidden_act"),
        ("nomic_bert", {"rotary_emb_scale_base": 512}, "rotary_emb_scale_base"),
        ("nomic_bert", {"scale_attn_weights": False}, "scale_attn_weights"),
        ("gte", {"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.6}}, "mixed_b"),
        ("gte", {"rope_scaling": {"type": "ntk", "factor": 0.5}}, "factor 0.5 < 1"),
        ("nomic_bert", {"rope_scaling": {"type": "ntk", "factor": 2.0}}, "'ntk' is not"),
        ("gte", {"logn_attention_scale": True}, "logn_attention_scale"),
        ("gte", {"layer_norm_type": "rms_norm"}, "layer_norm_type"),
        ("gte", {"type_vocab_size": -1}, "type_vocab_size"),
    ],
)
def test_what_the_engine_does_not_run_is_refused(tmp_path, family, changes, match) -> None:
    path = tm.save(tm.build(family), tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(CheckpointError, match=match):
        mha_engine.load_model(path)


def test_causal_masks_and_cuda_graphs_are_refused(built, monkeypatch) -> None:
    _, path = built
    model = mha_engine.load_model(path)
    with pytest.raises(ValueError, match="attends both ways"):
        model(torch.randn(1, 3, tm.D), is_causal=True)
    assert "rotary positions" in model.diagnostics()["engine_path"]
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match="not captured yet"):
        cuda_graphs.capture(model, True, False, 64, 8, 4, None)
