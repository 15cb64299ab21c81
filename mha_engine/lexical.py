"""BGE-M3's lexical (sparse) weights beside its dense vector: the checkpoint's `sparse_linear.pt`
(FlagEmbedding's file: a Linear(d_model, 1) state dict) scores every token as
relu(w . h + b) on its last hidden state; a sequence's weight for a vocabulary id is the
largest score among its tokens with that id, the tokenizer's cls, eos, pad and unk tokens left
out (<s>, </s>, <pad>, <unk> for XLM-R; others, such as <mask>, count), as FlagEmbedding's
BGEM3FlagModel computes `lexical_weights`. One weight per vocabulary id present, the rest
zero: what /embed_sparse answers, while the model's pooling still gives /embed its dense vector.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .devices import upload
from .errors import CheckpointError
from .text_config import TextEncoderConfig
from .text_model import TextEncoderModel
from .varlen import cumulative, lengths

FILE = "sparse_linear.pt"


UNUSED = ("cls_token", "eos_token", "pad_token", "unk_token")  # FlagEmbedding's unused_tokens


def _token_ids(directory: Path) -> dict[str, int]:
    """tokenizer.json's token -> id: its added tokens, and its model's vocabulary (WordPiece's
    and BPE's a dict, Unigram's a list of [piece, score])."""
    path = directory / "tokenizer.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = dict(vocab) if isinstance(vocab, dict) else {p[0]: i for i, p in enumerate(vocab)}
    ids.update({t["content"]: int(t["id"]) for t in data.get("added_tokens") or []})
    return ids


def special_ids(directory: Path, hf_config: dict) -> tuple[int, ...]:
    """The ids FlagEmbedding leaves out: the tokenizer's cls, eos, pad and unk tokens, named in
    special_tokens_map.json (or tokenizer_config.json) and looked up in tokenizer.json; without
    those files, config.json's bos (XLM-R's cls), eos, pad and unk ids."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = directory / name
        if not path.exists():
            continue
        named = json.loads(path.read_text())
        tokens = [named.get(key) for key in UNUSED]
        tokens = [t.get("content") if isinstance(t, dict) else t for t in tokens if t]
        ids = _token_ids(directory)
        if tokens and all(t in ids for t in tokens):
            return tuple(sorted({ids[t] for t in tokens}))
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    found = {hf_config.get(k) for k in keys}
    return tuple(sorted(i for i in found if isinstance(i, int)))


def read_head(directory: Path, config: TextEncoderConfig) -> dict[str, Tensor] | None:
    """`sparse_linear.pt` as {"weight": (1, D), "bias": (1,)}, or None without one. Read with
    torch.load(weights_only=True): tensors only, no code."""
    path = directory / FILE
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a pickle with code in it, or not a torch file
        raise CheckpointError(f"{path}: not a plain tensor state dict ({exc})") from None
    d = config.d_model
    shapes = {k: tuple(v.shape) for k, v in state.items()} if isinstance(state, dict) else None
    if shapes != {"weight": (1, d), "bias": (1,)}:
        raise CheckpointError(
            f"{path}: expected BGE-M3's sparse_linear, a Linear({d}, 1) state dict "
            f"(weight (1, {d}), bias (1,)); found {shapes}"
        )
    return {k: v.float() for k, v in state.items()}


class LexicalHead(nn.Module):
    """relu(w . h + b) per token, in float32: each row's dot product on its own (a (N, D) x
    (D, 1) GEMM's sums may depend on N), and not an nn.Linear, so int8 leaves it as it is."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, d_model))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, states: Tensor) -> Tensor:
        """(N, D) -> (N,) float32."""
        return F.relu((states.float() * self.weight).sum(-1) + self.bias)


class LexicalEncoderModel(TextEncoderModel):
    """A BGE-M3-style encoder: its dense vector (the configured pooling) and, from its
    sparse_linear head, lexical weights (/embed_sparse)."""

    text_kind = "embedding"
    offers_sparse = True  # service.text.kinds.offers: /embed_sparse as well

    def __init__(self, config: TextEncoderConfig, specials: Sequence[int]) -> None:
        super().__init__(config)
        self.lexical = LexicalHead(config.d_model)
        self.specials = tuple(specials)

    @torch.inference_mode()
    def sparse_embed_packed(self, input_ids: Tensor, cu_seqlens: Tensor | Sequence[int]) -> Tensor:
        """Lexical weights (B, V) float32 of packed id sequences (N,) split at cu_seqlens: per
        sequence and vocabulary id, the largest relu(w . h + b) among its tokens with that id
        (special tokens: none). A token's score never depends on the others and a maximum is
        exact in any order, so the weights never depend on the batch."""
        lens = lengths(cu_seqlens, input_ids.shape[0])  # host, before the forward is queued
        owner = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))  # (N,)
        ids = input_ids.cpu()  # the batcher's are host tensors already
        slot = owner * self.vocab_size + ids  # (N,) index into (B * V)
        keep = ~torch.isin(ids, torch.tensor(self.specials, dtype=ids.dtype))
        states = self.encode_packed(input_ids, cu_seqlens)  # (N, D)
        scores = self.lexical(states) * upload(keep, states.device)  # (N,) 0 for specials
        best = torch.zeros(len(lens) * self.vocab_size, device=states.device)
        best.scatter_reduce_(0, upload(slot, states.device), scores, reduce="amax")
        return best.view(len(lens), self.vocab_size)

    def sparse_embed_varlen(self, input_ids: list[Tensor]) -> Tensor:
        """Lexical weights (B, V) of unpadded id sequences: a sparse_embed_packed wrapper."""
        lens = [int(t.shape[0]) for t in input_ids]
        return self.sparse_embed_packed(torch.cat(input_ids), cumulative(lens))
