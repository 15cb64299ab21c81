"""Hugging Face BERT-family directories load onto the engine and give transformers' numbers.

Tiny randomly initialised models (bert, roberta, xlm-roberta, camembert, distilbert, mpnet) are
saved with save_pretrained, loaded with load_model and compared with transformers on padded
batches.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from engine_helpers import FP32
from safetensors.torch import load_file, save_file

from mha_engine import CheckpointError, TextEncoderModel, load_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the hub
transformers = pytest.importorskip("transformers")

VOCAB, D, HEADS, LAYERS, FFN, POSITIONS = 99, 32, 4, 2, 48, 40
PAD = 1  # not 0, so RoBERTa's position numbering (from pad_token_id + 1) is really exercised


def _config(model_type: str, **overrides):
    if model_type == "distilbert":
        kwargs = dict(dim=D, n_heads=HEADS, n_layers=LAYERS, hidden_dim=FFN)
    else:
        kwargs = dict(
            hidden_size=D,
            num_attention_heads=HEADS,
            num_hidden_layers=LAYERS,
            intermediate_size=FFN,
            type_vocab_size=2,
            layer_norm_eps=1e-12,
        )
    kwargs.update(vocab_size=VOCAB, max_position_embeddings=POSITIONS, pad_token_id=PAD)
    kwargs.update(overrides)
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def make_hf(model_type: str, head: str = "", seed: int = 0, **overrides):
    """A seeded eval-mode transformers model whose every parameter is perturbed (biases and
    LayerNorms start at 0/1, which would hide mapping mistakes)."""
    torch.manual_seed(seed)
    config = _config(model_type, **overrides)
    cls = getattr(transformers, f"AutoModel{head}")
    eager = model_type == "mpnet"  # transformers' MPNet has no SDPA implementation
    model = cls.from_config(config, attn_implementation="eager" if eager else "sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def save_hf(model, path):
    model.save_pretrained(path, safe_serialization=True)
    return path


def _batch(lengths: list[int], seed: int = 3):
    """Right-padded ids (B, T) and attention mask; ids avoid the pad id."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(2, VOCAB, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


LENGTHS = [7, 3, 12, 7, 1]


@pytest.mark.parametrize(
    "model_type", ["bert", "roberta", "xlm-roberta", "camembert", "distilbert", "mpnet"]
)
def test_last_hidden_state_matches_transformers(tmp_path, model_type):
    ref = make_hf(model_type)
    model = load_model(save_hf(ref, tmp_path), device="cpu")
    assert isinstance(model, TextEncoderModel)
    assert model.model_type == model_type
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, D)
    real = mask.bool()
    got = model.encode(ids, mask)
    torch.testing.assert_close(got[real], want[real], **FP32)
    # Packed, unpadded sequences give the same token states.
    outs = model.encode_varlen([row[m] for row, m in zip(ids, real, strict=True)])
    for out, w, m in zip(outs, want, real, strict=True):
        torch.testing.assert_close(out, w[m], **FP32)


def test_token_types_and_tanh_gelu(tmp_path):
    ref = make_hf("bert", hidden_act="gelu_new")
    model = load_model(save_hf(ref, tmp_path), device="cpu")
    assert model.config.activation == "gelu_tanh"
    ids, mask = _batch([6, 6])
    types = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 0, 1, 0, 1]])
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    torch.testing.assert_close(model.encode(ids, mask, types), want, **FP32)


def test_task_head_checkpoint_loads_its_base_model(tmp_path):
    """BertForMaskedLM keys are 'bert.…' plus 'cls.…': the head is ignored, the base loads."""
    ref = make_hf("bert", head="ForMaskedLM")
    state = load_file(str(save_hf(ref, tmp_path) / "model.safetensors"))
    assert any(k.startswith("bert.") for k in state) and any(k.startswith("cls.") for k in state)
    model = load_model(tmp_path, device="cpu")
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        want = ref.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32)


def test_hidden_state_api_is_the_encoder_stack(tmp_path):
    """forward([B, T, D] hidden states, padding mask) runs the encoder alone, like transformers'
    BertModel.encoder, so the tensor API serves text models unchanged."""
    ref = make_hf("bert")
    model = load_model(save_hf(ref, tmp_path), device="cpu")
    hidden = torch.randn(2, 9, D)
    with torch.no_grad():
        want = ref.encoder(hidden).last_hidden_state
    torch.testing.assert_close(model(hidden), want, **FP32)
    [out] = model.forward_varlen([hidden[0]])
    torch.testing.assert_close(out, want[0], **FP32)
    weights = model.attention_weights(hidden, layer=1)[1]
    assert weights.shape == (2, HEADS, 9, 9)


def test_pooling_and_normalisation(tmp_path):
    ref = make_hf("bert")
    save_hf(ref, tmp_path)
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        hidden = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).float()
    mean = (hidden * m).sum(1) / m.sum(1)
    seqs = [row[r] for row, r in zip(ids, mask.bool(), strict=True)]

    plain = load_model(tmp_path, device="cpu")  # a bare HF dir: mean pooling, not normalised
    assert (plain.pooling, plain.normalize, plain.max_seq_len) == ("mean", False, POSITIONS)
    torch.testing.assert_close(plain.embed_varlen(seqs), mean, **FP32)
    torch.testing.assert_close(plain.embed(ids, mask), mean, **FP32)
    cls = plain.embed_varlen(seqs, pooling="cls", normalize=True)
    torch.testing.assert_close(cls, torch.nn.functional.normalize(hidden[:, 0], dim=-1), **FP32)

    # sentence-transformers files choose pooling, normalisation and the max length.
    parts = {"": "Transformer", "1_Pooling": "Pooling", "2_Normalize": "Normalize"}
    modules = [{"path": p, "type": f"sentence_transformers.models.{k}"} for p, k in parts.items()]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    pooling = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    st = load_model(tmp_path, device="cpu")
    assert (st.pooling, st.normalize, st.max_seq_len) == ("cls", True, 16)
    torch.testing.assert_close(st.embed_varlen(seqs), cls, **FP32)
    with pytest.raises(ValueError, match="max_seq_len 16"):
        st.embed_varlen([torch.arange(2, 19)])


def test_cuda_mean_pooling_equals_the_cpu_one(tmp_path):
    """CUDA's mean pooling (segment_reduce in a fixed order, no device reads) run here on the
    CPU's hidden states: the same means as the CPU path's index_add."""
    from mha_engine.text import pool_packed, segment_mean

    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    hidden = torch.randn(sum(lengths), D)
    torch.testing.assert_close(
        segment_mean(hidden, lengths), pool_packed(hidden, lengths, "mean"), **FP32
    )


def test_a_dtype_cast_keeps_the_embedding_tables_where_they_are(tmp_path):
    """The tables stay float32 on a cast and move only with the model: a cast by dtype alone
    (model.to(torch.bfloat16), .half()) must not move a CUDA model's tables to the CPU. A meta
    model stands in for the CUDA one."""
    model = load_model(save_hf(make_hf("bert"), tmp_path), device="cpu")
    embeddings = model.embeddings
    embeddings.to("meta")
    embeddings.to(torch.bfloat16)
    table = embeddings.word_embeddings.weight
    assert (table.device.type, table.dtype) == ("meta", torch.float32)


def test_bf16_model_stays_close(tmp_path):
    ref = make_hf("bert")
    model = load_model(save_hf(ref, tmp_path), device="cpu", dtype="bfloat16")
    ids, mask = _batch([9, 4])
    seqs = [row[r] for row, r in zip(ids, mask.bool(), strict=True)]
    with torch.no_grad():
        hidden = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).float()
    want = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
    got = model.embed_varlen(seqs, normalize=True)
    assert got.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.999


# -- loader errors -----------------------------------------------------------------------------


def _edit_weights(path, fn):
    state = load_file(str(path / "model.safetensors"))
    fn(state)
    save_file(state, str(path / "model.safetensors"))


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_layer_key_is_named(tmp_path):
    save_hf(make_hf("bert"), tmp_path)
    _edit_weights(tmp_path, lambda s: s.pop("encoder.layer.1.attention.self.key.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing keys \['encoder\.layer\.1\.attention\.self\.key\.weight'\]"
    ):
        load_model(tmp_path)


def test_extra_layer_is_unexpected(tmp_path):
    save_hf(make_hf("bert"), tmp_path)
    _edit_config(tmp_path, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"unexpected keys \['encoder\.layer\.1\."):
        load_model(tmp_path)


def test_mismatched_hidden_size_names_key_and_shapes(tmp_path):
    save_hf(make_hf("bert"), tmp_path)
    _edit_config(tmp_path, hidden_size=48, num_attention_heads=4)
    with pytest.raises(
        CheckpointError,
        match=r"word_embeddings\.weight: expected shape \(99, 48\), got \(99, 32\) "
        r"\(from the bert config\)",
    ):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"model_type": "gpt2"}, r"unsupported model_type 'gpt2'; supported: \['bert', 'roberta'"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
        ({"hidden_act": "silu"}, "hidden_act 'silu' is not supported"),
        ({"is_decoder": True}, "only encoder-only models"),
        ({"num_attention_heads": 5}, "hidden size 32 is not divisible by the number of heads 5"),
    ],
)
def test_bad_hf_config(tmp_path, changes, match):
    save_hf(make_hf("bert"), tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_model(tmp_path)


def test_unsupported_sentence_transformers_module(tmp_path):
    save_hf(make_hf("bert"), tmp_path)
    modules = [{"path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match=r"module 'sentence_transformers\.models\.LayerNorm'"):
        load_model(tmp_path)


def test_bad_token_ids_are_refused(tmp_path):
    model = load_model(save_hf(make_hf("bert"), tmp_path))
    with pytest.raises(ValueError, match=r"ids outside \[0, 99\)"):
        model.embed_varlen([torch.tensor([2, 99])])
    with pytest.raises(ValueError, match="at least one token"):
        model.embed_varlen([torch.tensor([], dtype=torch.long)])
