"""Models saved by sentence-transformers 5.4 and later (its modules renamed, `pooling_mode: "mean"`,
the max length kept as the tokenizer's model_max_length): written by the real library, loaded
by the engine, and compared with what that library's own encode / predict give at fp32
tolerance. The files of earlier releases are covered by test_hf_minilm.py, test_dense.py and
test_sparse.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

from service.text.tokenizer import TextTokenizer
from tests import text_models as tm
from tests.support import FP32_TOL

TEXTS = tm.LONG_AND_SHORT  # the third is 17 tokens with [CLS]/[SEP]: cut at 16 below


def _saved(tmp: Path, base: Path, pooling: str, *, dense: bool = False, **kw) -> Path:
    """A SentenceTransformer over `base` saved by sentence-transformers itself."""
    transformer = Transformer(str(base), max_seq_length=kw.pop("max_seq_length", None))
    modules = [transformer, Pooling(tm.D, pooling, include_prompt=kw.pop("include_prompt", True))]
    if dense:
        torch.manual_seed(5)
        modules.append(Dense(tm.D, 8, activation_function=torch.nn.Tanh()))
    modules.append(Normalize())
    out = tmp / "saved"
    SentenceTransformer(modules=modules, **kw).save(str(out))
    return out


def _engine_vectors(path: Path) -> torch.Tensor:
    """The engine's vectors of TEXTS, tokenized as the server does (truncated to its max)."""
    model = mha_engine.load_model(path)
    tokenizer = TextTokenizer(path / "tokenizer.json", model.max_seq_len)
    return model.embed_varlen([torch.from_numpy(e.ids) for e in tokenizer.encode(TEXTS)])


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return tm.save(tm.build("bert"), tmp_path_factory.mktemp("bert"))


def test_new_module_names_and_pooling_mode_are_read(bert_dir, tmp_path) -> None:
    path = _saved(tmp_path, bert_dir, "mean")
    kinds = [m["type"] for m in json.loads((path / "modules.json").read_text())]
    assert "sentence_transformers.base.modules.transformer.Transformer" in kinds  # 5.4's names
    assert json.loads((path / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "mean"
    model = mha_engine.load_model(path)
    assert (model.config.pooling, model.config.normalize) == ("mean", True)
    want = SentenceTransformer(str(path)).encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(_engine_vectors(path), want, **FP32_TOL)


def test_cls_dense_and_a_max_length_kept_in_the_tokenizer_config(bert_dir, tmp_path) -> None:
    """max_seq_length 16 is saved only as tokenizer_config.json's model_max_length: the engine
    truncates where sentence-transformers does (the 17-token text), so the vectors agree."""
    path = _saved(tmp_path, bert_dir, "cls", dense=True, max_seq_length=16)
    assert "max_seq_length" not in json.loads((path / "sentence_bert_config.json").read_text())
    model = mha_engine.load_model(path)
    assert (model.max_seq_len, model.embedding_dim) == (16, 8)
    want = SentenceTransformer(str(path)).encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(_engine_vectors(path), want, **FP32_TOL)


def test_a_causal_embedder_with_last_token_pooling(tmp_path) -> None:
    base = tm.save(tm.build("qwen3"), tmp_path / "qwen3")
    path = _saved(tmp_path, base, "lasttoken", include_prompt=False)  # no effect on last token
    assert mha_engine.load_model(path).config.pooling == "last_token"
    want = SentenceTransformer(str(path)).encode(TEXTS, convert_to_tensor=True)  # left-padded
    torch.testing.assert_close(_engine_vectors(path), want, **FP32_TOL)


def test_a_sparse_encoder(tmp_path) -> None:
    base = tm.save(tm.build("bert", "ForMaskedLM", seed=2), tmp_path / "mlm")
    path = tmp_path / "splade"
    modules = [MLMTransformer(str(base)), SpladePooling("max")]
    SparseEncoder(modules=modules).save(str(path))
    model = mha_engine.load_model(path)
    tokenizer = TextTokenizer(path / "tokenizer.json", 40)
    ids = [torch.from_numpy(e.ids) for e in tokenizer.encode(TEXTS)]
    lens = [len(i) for i in ids]
    ours = model.sparse_embed_packed(torch.cat(ids), torch.tensor([0, *lens]).cumsum(0).tolist())
    want = SparseEncoder(str(path)).encode(TEXTS, convert_to_tensor=True).to_dense()
    torch.testing.assert_close(ours, want, **FP32_TOL)


def test_a_cross_encoder(tmp_path) -> None:
    _, base = tm.classifier("bert", tmp_path / "ce", {0: "score"})
    path = tmp_path / "saved"
    CrossEncoder(str(base)).save(str(path))
    model = mha_engine.load_model(path)
    pairs = [(TEXTS[0], TEXTS[2]), (TEXTS[1], TEXTS[3])]
    enc = TextTokenizer(path / "tokenizer.json", 40).encode(pairs)
    logits = model.classify_varlen(
        [torch.from_numpy(e.ids) for e in enc], [torch.from_numpy(e.types) for e in enc]
    )
    want = CrossEncoder(str(path)).predict(pairs, convert_to_tensor=True)  # sigmoid of the logit
    torch.testing.assert_close(torch.sigmoid(logits[:, 0]), want, **FP32_TOL)


@pytest.mark.parametrize(
    ("pooling", "include_prompt", "error"),
    [
        ("max", True, "pooling_mode 'max'"),
        (["mean", "cls"], True, "pooling_mode ['mean', 'cls']"),
        ("mean", False, "excludes prompt tokens from mean pooling"),
        ("cls", False, "excludes prompt tokens from cls pooling"),
    ],
)
def test_poolings_the_engine_does_not_run_are_refused(
    bert_dir, tmp_path, pooling, include_prompt, error
) -> None:
    path = _saved(tmp_path, bert_dir, "mean", prompts={"query": "query: "})
    config = {"embedding_dimension": tm.D, "pooling_mode": pooling}
    config["include_prompt"] = include_prompt
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=error.replace("[", r"\[")):
        mha_engine.load_model(path)


def test_prompts_left_out_of_pooling_matter_only_where_a_prompt_exists(bert_dir, tmp_path) -> None:
    """include_prompt false on a model without prompts pools what sentence-transformers pools:
    it loads (directories that loaded before still do)."""
    path = _saved(tmp_path, bert_dir, "mean", include_prompt=False)
    assert mha_engine.load_model(path).config.pooling == "mean"
    want = SentenceTransformer(str(path)).encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(_engine_vectors(path), want, **FP32_TOL)


def test_a_dense_residual_is_refused(bert_dir, tmp_path) -> None:
    path = _saved(tmp_path, bert_dir, "cls", dense=True)
    config_path = path / "2_Dense" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "use_residual": True}))
    with pytest.raises(CheckpointError, match="use_residual"):
        mha_engine.load_model(path)


@pytest.mark.parametrize(
    ("files", "want"),
    [
        ({"tokenizer_config.json": {"model_max_length": 24}}, 24),
        ({"tokenizer_config.json": {"model_max_length": 10**30}}, tm.POSITIONS),  # unset
        ({"tokenizer_config.json": {"model_max_length": 10**6}}, tm.POSITIONS),  # table's
        (
            {
                "sentence_bert_config.json": {"max_seq_length": 12},
                "tokenizer_config.json": {"model_max_length": 24},
            },
            12,
        ),
    ],
)
def test_max_length_sources(bert_dir, tmp_path, files, want) -> None:
    """sentence_bert_config.json's max_seq_length wins, as in every release; else the
    tokenizer's model_max_length (transformers' 1e30 means none); never past the table."""
    path = tm.save(tm.build("bert"), tmp_path / "m")
    for name, value in files.items():
        (path / name).write_text(json.dumps(value))
    assert mha_engine.load_model(path).max_seq_len == want
