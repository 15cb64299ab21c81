"""MPNet's relative position bias: one learned score per head and distance bucket, added to every
layer's attention scores before the softmax (as T5's, bidirectional).

A key j seen from query i falls into a bucket of the distance j - i: 16 per direction, the 8
nearest exact, the rest logarithmic up to 128 tokens and clamped beyond. Like transformers'
MPNetEncoder, the bucket count is fixed at 32 and the bias is computed once per forward and
shared by all layers; it depends only on (tgt_len, src_len), so sequences of one length share it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

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

    def forward(self, tgt_len: int, src_len: int, dtype: torch.dtype) -> Tensor:
        device = self.relative_attention_bias.weight.device
        query = torch.arange(tgt_len, device=device)[:, None]  # (T, 1)
        key = torch.arange(src_len, device=device)[None, :]  # (1, S)
        buckets = relative_position_bucket(key - query)  # (T, S)
        bias = self.relative_attention_bias(buckets)  # (T, S, H)
        return bias.permute(2, 0, 1).unsqueeze(0).to(dtype).contiguous()  # (1, H, T, S)


class BiasCache:
    """The bias of each (tgt_len, src_len) one forward meets, computed once for all layers."""

    def __init__(self, bias: RelativePositionBias, dtype: torch.dtype) -> None:
        self._bias, self._dtype = bias, dtype
        self._seen: dict[tuple[int, int], Tensor] = {}

    def __call__(self, tgt_len: int, src_len: int) -> Tensor:
        key = (tgt_len, src_len)
        if key not in self._seen:
            self._seen[key] = self._bias(tgt_len, src_len, self._dtype)  # (1, H, T, S)
        return self._seen[key]
