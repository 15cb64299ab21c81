"""sentence-transformers' Dense modules after pooling (LaBSE: CLS, Dense with tanh, Normalize;
distiluse: mean, Dense to a narrower width; EmbeddingGemma's form: two Dense without bias or
activation): vectors equal to transformers' states pooled and passed through torch Linears, the
vector width they give, batch invariance in every precision, save_model round trips, and what is
refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError
from mha_engine.text_config import DENSE_ACTIVATIONS
from mha_engine.text_model import DENSE_FUNCTIONS

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm
from tests.support import FP32_TOL

TEXTS = tm.LONG_AND_SHORT
TANH, IDENTITY, GELU = "activation.Tanh", "linear.Identity", "activation.GELU"


def _pooled(reference, path: Path, pooling: str) -> torch.Tensor:
    ids, mask, types = tm.padded(tm.tokenize(path, TEXTS))
    kwargs = {"token_type_ids": types} if reference.config.model_type == "bert" else {}
    with torch.no_grad():
        hidden = reference(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state
    if pooling == "cls":
        return hidden[:, 0]
    m = mask[..., None].float()
    return (hidden * m).sum(1) / m.sum(1)


def _seqs(path: Path) -> list[torch.Tensor]:
    return [ids for ids, _ in tm.tokenize(path, TEXTS)]


@pytest.fixture(scope="module")
def labse(tmp_path_factory) -> tuple:
    """LaBSE's layout: BERT, CLS pooling, Dense (tanh, bias) to 24 features, Normalize."""
    path = tmp_path_factory.mktemp("labse")
    reference, _ = tm.sentence_transformer(path, "cls", normalize=True)
    linears = tm.add_dense(path, [(tm.D, 24, True, TANH)], legacy=True)
    return reference, path, linears


def test_labse_vectors_equal_pooled_then_dense_then_normalized(labse) -> None:
    reference, path, [linear] = labse
    model = mha_engine.load_model(path)
    assert model.embedding_dim == 24 and model.config.dense[0].activation == "tanh"
    with torch.no_grad():
        want = torch.nn.functional.normalize(torch.tanh(linear(_pooled(reference, path, "cls"))))
    torch.testing.assert_close(model.embed_varlen(_seqs(path)), want, **FP32_TOL)
    ids, mask, _ = tm.padded(tm.tokenize(path, TEXTS))
    torch.testing.assert_close(model.embed(ids, mask), want, **FP32_TOL)


def test_dense_path_runs_another_dense_module(tmp_path: Path) -> None:
    """TEI's --dense-path: the named folder's Dense module instead of the one modules.json
    lists."""
    reference, path = tm.sentence_transformer(tmp_path / "m", "mean", normalize=True)
    tm.add_dense(path, [(tm.D, 24, True, IDENTITY)])
    other = tm.write_dense(path, "2_Dense_16", 16)
    model = mha_engine.load_model(path, dense_path="2_Dense_16")
    assert model.embedding_dim == 16 and mha_engine.load_model(path).embedding_dim == 24
    with torch.no_grad():
        want = torch.nn.functional.normalize(other(_pooled(reference, path, "mean")))
    torch.testing.assert_close(model.embed_varlen(_seqs(path)), want, **FP32_TOL)
    inside = "must name a folder inside"
    for bad, match in (("../m", inside), ("", inside), (".", inside), ("/tmp", inside),
                       ("3_Dense", "no Dense module")):  # fmt: skip
        with pytest.raises(CheckpointError, match=match):
            mha_engine.load_model(path, dense_path=bad)
    _, plain = tm.sentence_transformer(tmp_path / "plain", "mean")  # lists no Dense module
    tm.write_dense(plain, "2_Dense_16", 16)
    with pytest.raises(CheckpointError, match="replaces the one Dense module"):
        mha_engine.load_model(plain, dense_path="2_Dense_16")
    mha_engine.save_model(torch.nn.MultiheadAttention(8, 2, batch_first=True), tmp_path / "mha")
    with pytest.raises(CheckpointError, match="is not a text model"):
        mha_engine.load_model(tmp_path / "mha", dense_path="2_Dense_16")


@pytest.mark.parametrize(
    ("model_type", "layers", "normalize"),
    [
        ("distilbert", [(tm.D, 16, True, TANH)], False),  # distiluse-base-multilingual
        ("bert", [(tm.D, 64, False, IDENTITY), (64, 20, False, IDENTITY)], True),  # Gemma's form
        ("qwen3", [(tm.D, 12, True, GELU)], True),
    ],
)
def test_other_dense_layouts(tmp_path: Path, model_type: str, layers: list, normalize: bool):
    reference, path = tm.sentence_transformer(tmp_path, "mean", normalize, model_type=model_type)
    linears = tm.add_dense(path, layers)
    model = mha_engine.load_model(path)
    want = _pooled(reference, path, "mean")
    functions = {TANH: torch.tanh, IDENTITY: torch.nn.Identity(), GELU: torch.nn.GELU()}
    with torch.no_grad():
        for linear, (*_, act) in zip(linears, layers, strict=True):
            want = functions[act](linear(want))
    want = torch.nn.functional.normalize(want) if normalize else want
    assert model.embedding_dim == layers[-1][1]
    torch.testing.assert_close(model.embed_varlen(_seqs(path)), want, **FP32_TOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_vector_never_depends_on_its_batch(labse, dtype: str) -> None:
    _, path, _ = labse
    model = mha_engine.load_model(path, dtype=dtype)
    seqs = _seqs(path) * 5  # 20 vectors: past the Dense GEMM's small-batch padding
    together = model.embed_varlen(seqs)
    assert together.dtype == torch.float32 and together.shape == (20, 24)
    for one, got in zip(seqs, together, strict=True):
        assert torch.equal(model.embed_varlen([one])[0], got)


def test_save_model_writes_the_dense_modules_back(labse, tmp_path: Path) -> None:
    _, path, _ = labse
    model = mha_engine.load_model(path)
    mha_engine.save_model(model, tmp_path)
    modules = json.loads((tmp_path / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == [
        "Transformer", "Pooling", "Dense", "Normalize"
    ]  # fmt: skip
    again = mha_engine.load_model(tmp_path)
    assert again.config == model.config
    assert torch.equal(again.embed_varlen(_seqs(path)), model.embed_varlen(_seqs(path)))


def test_every_dense_activation_has_a_function_and_a_file_name() -> None:
    from mha_engine.st_files import ST_DENSE_ACTIVATIONS

    assert set(DENSE_FUNCTIONS) == set(DENSE_ACTIVATIONS) == set(ST_DENSE_ACTIVATIONS.values())


def _edit_dense(path: Path, tmp_path: Path, edit) -> Path:
    """A copy of the directory with `edit(modules, dense_config)` applied to its files."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    modules = json.loads((copy / "modules.json").read_text())
    config = json.loads((copy / "2_Dense" / "config.json").read_text())
    edit(modules, config)
    (copy / "modules.json").write_text(json.dumps(modules))
    (copy / "2_Dense" / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m, c: c.update(activation_function="torch.nn.modules.activation.SiLU"), "SiLU"),
        (lambda m, c: c.update(in_features=31), "takes 31 features, but gets 32"),
        (lambda m, c: c.update(out_features=25), r"linear.weight.*\(25, 32\)"),
        (lambda m, c: c.update(use_residual=True), "adds a residual"),
        (lambda m, c: c.update(residual_scale=2.0), r"does not run: \['residual_scale'\]"),
        (lambda m, c: c.update(module_input_name="token_embeddings"), "'token_embeddings'"),
        (lambda m, c: m.insert(1, m.pop(2)), "Dense module before Pooling"),
        (lambda m, c: m.append(m.pop(2)), "after Normalize"),
        (lambda m, c: m[2].update(path="../labse0"), "outside the model directory: '../labse0'"),
        (lambda m, c: m[2].update(path="/etc"), "outside the model directory: '/etc'"),
    ],
)
def test_what_the_engine_does_not_run_is_refused(labse, tmp_path, edit, match) -> None:
    _, path, _ = labse
    with pytest.raises(CheckpointError, match=match):
        mha_engine.load_model(_edit_dense(path, tmp_path, edit))
