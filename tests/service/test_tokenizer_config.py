"""The server tokenizes as transformers.AutoTokenizer does whatever tokenizer_config.json says of
add_bos_token / add_eos_token: transformers 5 keeps tokenizer.json's post-processor (or adds
nothing when the file has none), and so does the server. Token ids and token types of texts and
pairs equal AutoTokenizer's; a last-token embedder reads the same last token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.text.tokenizer import TextTokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm  # noqa: E402

TEXTS = ["the cat sat on the mat", "hello"]
PAIRS = [("what is deep learning ?", "a model"), ("paris", "the capital city")]


def _tokenizer_dir(tmp_path: Path, flags: dict, post_processor: bool) -> Path:
    tm.write_tokenizer(tmp_path, 1)  # [CLS] A [SEP] (B [SEP]) in tokenizer.json
    if not post_processor:
        config = json.loads((tmp_path / "tokenizer.json").read_text())
        config["post_processor"] = None
        (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[CLS]",
              "eos_token": "[SEP]", "pad_token": "[PAD]", **flags}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("post_processor", [True, False])
@pytest.mark.parametrize(
    "flags",
    [{}, {"add_eos_token": True}, {"add_bos_token": True, "add_eos_token": True},
     {"add_bos_token": False, "add_eos_token": False}],
)  # fmt: skip
def test_special_tokens_as_transformers_adds_them(tmp_path, flags, post_processor) -> None:
    path = _tokenizer_dir(tmp_path, flags, post_processor)
    ours = TextTokenizer(path / "tokenizer.json", 40)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    for got, text in zip(ours.encode(TEXTS), TEXTS, strict=True):
        assert got.ids.tolist() == theirs(text)["input_ids"]
    for got, (a, b) in zip(ours.encode(PAIRS), PAIRS, strict=True):
        want = theirs(a, b, return_token_type_ids=True)
        assert got.ids.tolist() == want["input_ids"]
        assert got.types.tolist() == want["token_type_ids"]
