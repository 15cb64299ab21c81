"""Additive position biases on every layer's attention scores, before the softmax, computed once
per forward and shared by the layers: MPNet's learned relative bias, and JinaBERT's ALiBi.

MPNet: one learned score per head and distance bucket (as T5's, bidirectional).

A key j seen from query i falls into a bucket of the distance j - i: 16 per direction, the 8
nearest exact, the rest logarithmic up to 128 tokens and clamped beyond. Like transformers'
MPNetEncoder, the bucket count is fixed at 32 and the bias is computed once per forward and
shared by all layers; it depends only on (tgt_len, src_len), so sequences of one length share it.

ALiBi (JinaBERT, jina-embeddings-v2): no table, no weights: head h adds -slope_h * |j - i|, the
same in both directions, with the ALiBi paper's slopes (a geometric series from 2^(-8 / H); for a
head count H that is not a power of two, those of the power of two below it, then every other
slope of twice that power). Built in float32, then cast to the scores' dtype, as JinaBERT's code.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .devices import upload

NUM_BUCKETS = 32  # transformers' MPNet always buckets into 32, whatever its config says
MAX_DISTANCE = 128


def relative_position_bucket(relative_position: Tensor) -> Tensor:
    """Bucket (long) of each relative position (key - query), computed as transformers does."""
    half = NUM_BUCKETS // 2
    n = -relative_position
    bucket = (n < 0).long() * half  # keys after the query use the upper half
    n = n.abs()
    exact = half // 2
    far = (
        exact
        + (torch.log(n.float() / exact) / math.log(MAX_DISTANCE / exact) * (half - exact)).long()
    )
    far = far.clamp(max=half - 1)
    return bucket + torch.where(n < exact, n, far)


class RelativePositionBias(nn.Module):
    """`relative_attention_bias` (buckets, H), Hugging Face's name; forward gives the additive
    (1, H, T, S) bias of one sequence length."""

    def __init__(self, num_heads: int, num_buckets: int = NUM_BUCKETS) -> None:
        super().__init__()
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)

    def forward(
        self, tgt_len: int, src_len: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> Tensor:
        """The bias on the table's device (`device` is AlibiBias's argument, unused here)."""
        on = self.relative_attention_bias.weight.device
        query = torch.arange(tgt_len, device=on)[:, None]  # (T, 1)
        key = torch.arange(src_len, device=on)[None, :]  # (1, S)
        buckets = relative_position_bucket(key - query)  # (T, S)
        bias = self.relative_attention_bias(buckets)  # (T, S, H)
        return bias.permute(2, 0, 1).unsqueeze(0).to(dtype).contiguous()  # (1, H, T, S)


def alibi_slopes(num_heads: int) -> list[float]:
    """Each head's ALiBi slope, in head order (the paper's and JinaBERT's)."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))  # 2^(-8 / n)
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two(num_heads)
    below = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(below) + alibi_slopes(2 * below)[0::2][: num_heads - below]


class AlibiBias(nn.Module):
    """ALiBi's additive (1, H, T, S) bias of one sequence length: -slope_h * |key - query|."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        # not a buffer (nothing to load): on the host, explicitly (models are built on the meta
        # device), uploaded without blocking where a forward runs
        self.slopes = torch.tensor(alibi_slopes(num_heads), device="cpu")  # (H,) float32
        self._on: dict[torch.device, Tensor] = {}  # -slopes, uploaded once per device

    def forward(
        self, tgt_len: int, src_len: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> Tensor:
        """The bias on `device` (the host when None), built in float32, cast to `dtype`."""
        device = torch.device("cpu") if device is None else torch.device(device)
        query = torch.arange(tgt_len, device=device)[:, None]  # (T, 1)
        key = torch.arange(src_len, device=device)[None, :]  # (1, S)
        distance = (key - query).abs()  # (T, S)
        slopes = self._on.get(device)
        if slopes is None:
            slopes = self._on[device] = -upload(self.slopes, device)  # (H,)
        return (slopes[:, None, None] * distance).unsqueeze(0).to(dtype)  # (1, H, T, S)


class BiasCache:
    """The bias of each (tgt_len, src_len) one forward meets, computed once for all layers."""

    def __init__(
        self, bias: RelativePositionBias | AlibiBias, dtype: torch.dtype, device: torch.device
    ) -> None:
        self._bias, self._dtype, self._device = bias, dtype, device
        self._seen: dict[tuple[int, int], Tensor] = {}

    def __call__(self, tgt_len: int, src_len: int) -> Tensor:
        key = (tgt_len, src_len)
        if key not in self._seen:
            self._seen[key] = self._bias(tgt_len, src_len, self._dtype, self._device)
        return self._seen[key]
