"""BGE-M3's lexical weights (mha_engine.LexicalEncoderModel) against FlagEmbedding's formula
written out over transformers' own XLM-RoBERTa: relu(sparse_linear(last hidden state)) per
token, per vocabulary id the largest over its tokens, the tokenizer's special tokens left out;
the dense vector as the plain encoder gives it; batch invariance in each precision; what a
bad sparse_linear.pt is told."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError, LexicalEncoderModel, TextEncoderModel
from tests import text_models as tm
from tests.support import FP32_TOL

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TEXTS = ["the cat sat on the mat", "what is deep learning?", "hello", "a [MASK] . a cat . a mat"]
SPECIAL_TOKENS = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]"]
# special_tokens_map.json: XLM-R's names every one FlagEmbedding leaves out (cls, eos, pad,
# unk); BERT's has no eos_token, so FlagEmbedding weighs its [SEP]. [MASK] counts in both.
TOKEN_MAPS = {
    "xlm-roberta": {"cls_token": "[CLS]", "eos_token": "[SEP]", "sep_token": "[SEP]",
                    "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]"},
    "bert": {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
             "unk_token": "[UNK]", "mask_token": {"content": "[MASK]", "special": True}},
}  # fmt: skip


def bge_m3(directory: Path, model_type: str = "xlm-roberta", seed: int = 4) -> tuple:
    """A BGE-M3-shaped directory: the encoder with CLS pooling and Normalize, its tokenizer's
    special tokens marked special (as XLM-R's tokenizer.json marks them) and named in
    special_tokens_map.json, and sparse_linear.pt. Returns (transformers model, directory,
    sparse_linear state)."""
    import json

    from tokenizers import Tokenizer

    model, _ = tm.sentence_transformer(directory, pooling="cls", model_type=model_type)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(SPECIAL_TOKENS)  # the vocabulary's own ids
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "special_tokens_map.json").write_text(json.dumps(TOKEN_MAPS[model_type]))
    torch.manual_seed(seed)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    torch.save(state, directory / "sparse_linear.pt")
    return model, directory, state


def reference(model, directory: Path, texts: list[str], state: dict) -> torch.Tensor:
    """FlagEmbedding's lexical weights, dense (B, V): per token relu(w . h + b); per id the
    largest, the tokenizer's cls, eos, pad and unk tokens (those its map names) skipped."""
    names = TOKEN_MAPS[model.config.model_type]
    specials = {tm.VOCAB.index(names[k]) for k in ("cls_token", "eos_token", "pad_token",
                                                    "unk_token") if k in names}  # fmt: skip
    encoded = tm.tokenize(directory, texts)
    ids, mask, _ = tm.padded(encoded)
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        scores = torch.relu(hidden @ state["weight"].T + state["bias"])[..., 0]  # (B, T)
    out = torch.zeros(len(texts), model.config.vocab_size)
    for b, (row, _) in enumerate(encoded):
        for t, idx in enumerate(row.tolist()):
            if idx not in specials and scores[b, t] > out[b, idx]:
                out[b, idx] = scores[b, t]
    return out


@pytest.fixture(scope="module", params=["xlm-roberta", "bert"])
def m3(request, tmp_path_factory) -> tuple:
    return bge_m3(tmp_path_factory.mktemp("m3") / request.param, request.param)


def test_lexical_weights_equal_flagembeddings_formula(m3) -> None:
    reference_model, path, state = m3
    model = mha_engine.load_model(path)
    assert isinstance(model, LexicalEncoderModel) and model.text_kind == "embedding"
    ids = [ids for ids, _ in tm.tokenize(path, TEXTS)]
    got = model.sparse_embed_varlen(ids)
    want = reference(reference_model, path, TEXTS, state)
    torch.testing.assert_close(got, want, **FP32_TOL)
    assert (got > 0).sum() > len(TEXTS)  # not all zero: the check has teeth
    left_out = {tm.VOCAB[i] for i in model.specials}  # FlagEmbedding's: [MASK] always counts
    bert = reference_model.config.model_type == "bert"  # its map has no eos: [SEP] counts
    assert left_out == {"[CLS]", "[PAD]", "[UNK]"} | (set() if bert else {"[SEP]"})
    for row, seq in zip(got, ids, strict=True):  # ids absent from the text weigh nothing
        absent = torch.ones(model.vocab_size, dtype=torch.bool)
        absent[seq] = False
        assert not row[absent].any()


def test_the_dense_vector_is_the_plain_encoders(m3, tmp_path: Path) -> None:
    _, path, _ = m3
    model = mha_engine.load_model(path)
    (path / "sparse_linear.pt").rename(tmp_path / "aside.pt")
    try:
        plain = mha_engine.load_model(path)
    finally:
        (tmp_path / "aside.pt").rename(path / "sparse_linear.pt")
    assert type(plain) is TextEncoderModel
    ids = [ids for ids, _ in tm.tokenize(path, TEXTS)]
    assert torch.equal(model.embed_varlen(ids), plain.embed_varlen(ids))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_sequences_weights_never_depend_on_its_batch(m3, dtype: str) -> None:
    reference_model, path, state = m3
    model = mha_engine.load_model(path, dtype=dtype)
    ids = [ids for ids, _ in tm.tokenize(path, TEXTS)]
    alone = torch.cat([model.sparse_embed_varlen([one]) for one in ids])
    together = model.sparse_embed_varlen(ids)
    assert torch.equal(alone, together)
    if dtype != "float32":  # measured: bf16 8.3e-3, int8 1.5e-3 on weights up to 1.4
        want = reference(reference_model, path, TEXTS, state)
        torch.testing.assert_close(together, want, atol=2e-2, rtol=0)


def test_a_bad_sparse_linear_is_refused_naming_it(tmp_path: Path) -> None:
    _, path, _ = bge_m3(tmp_path / "m3")
    torch.save({"weight": torch.zeros(2, 32), "bias": torch.zeros(2)}, path / "sparse_linear.pt")
    with pytest.raises(CheckpointError, match=r"sparse_linear, a Linear\(32, 1\)"):
        mha_engine.load_model(path)
    torch.save({"weight": torch.zeros(1, 32), "extra": object()}, path / "sparse_linear.pt")
    with pytest.raises(CheckpointError, match="not a plain tensor state dict"):
        mha_engine.load_model(path)  # torch.load(weights_only=True) runs no pickled code


def test_save_model_refuses_it(m3, tmp_path: Path) -> None:
    _, path, _ = m3
    with pytest.raises(ValueError, match="LexicalEncoderModel is not saved"):
        mha_engine.save_model(mha_engine.load_model(path), tmp_path / "out")
