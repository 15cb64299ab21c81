"""CUDA-graph buckets and cu_seqlens layouts (host side): the bucket a batch gets, the padding
sequences it replays with, and for cross-attention the pairing of query and memory chunks."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from mha_engine.graph_buckets import (
    bucket,
    bucket_key,
    bucket_slots,
    cross_key,
    cross_layout,
    cross_slots,
    self_layout,
)


@pytest.mark.parametrize(("n", "want"), [(0, 16), (1, 16), (16, 16), (17, 32), (1000, 1024)])
def test_bucket_is_the_next_power_of_two_from_16(n, want):
    assert bucket(n) == want


def test_bucket_key_takes_tokens_and_longest_sequence():
    assert bucket_key([5, 9], 4096, 32) == (16, 16)
    assert bucket_key([300, 20], 4096, 32) == (512, 512)
    assert bucket_key([40] * 20, 4096, 32) == (1024, 64)
    assert bucket_key([5000], 4096, 32) is None  # past the largest bucket: eager
    assert bucket_key([1] * 33, 4096, 32) is None  # past max_sequences
    assert bucket_key([], 4096, 32) is None


def test_padding_rows_form_their_own_sequences_and_slots_stay_empty():
    lens = [3, 7, 1]
    tokens, max_len = bucket_key(lens, 4096, 8)
    slots = bucket_slots(tokens, max_len, 8)
    cu = self_layout(lens, tokens, max_len, slots)
    assert len(cu) == slots + 1
    assert cu[:4] == [0, 3, 10, 11]  # the real sequences, unchanged
    chunks = [b - a for a, b in pairwise(cu[3:]) if b > a]
    assert sum(chunks) == tokens - 11 and max(chunks) <= max_len  # padding, never longer
    assert cu[-1] == tokens and all(a <= b for a, b in pairwise(cu))


def test_more_sequences_than_slots_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        self_layout([1] * 10, 16, 16, 4)


def test_cross_key_leaves_a_memory_row_for_every_query_padding_chunk():
    assert cross_key([5, 9], [7, 3], 4096, 32) == (16, 16, 16, 16)
    # 20 query rows: 12 padding rows in one chunk of <= 32; 16 memory rows + 1 -> 32
    assert cross_key([20], [16], 4096, 32) == (32, 32, 32, 16)
    assert cross_key([40] * 20, [3] * 20, 4096, 32) == (1024, 64, 64, 16)  # 60 + 4 chunks
    assert cross_key([5], [0], 4096, 32) is None  # a query without keys: eager
    assert cross_key([5], [3, 4], 4096, 32) is None  # unpaired
    assert cross_key([5], [4096], 4096, 32) is None  # memory past the largest bucket


def _check_pairs(q_lens, k_lens, max_sequences=32):
    tq, mq, tk, mk = cross_key(q_lens, k_lens, 1 << 14, max_sequences)
    slots = cross_slots(tq, mq, tk, mk, max_sequences)
    cu_q, cu_k = cross_layout(q_lens, k_lens, tq, mq, tk, mk, slots)
    assert len(cu_q) == len(cu_k) == slots + 1
    assert cu_q[-1] == tq and cu_k[-1] == tk  # every row in some sequence
    q_seq = [b - a for a, b in pairwise(cu_q)]
    k_seq = [b - a for a, b in pairwise(cu_k)]
    assert q_seq[: len(q_lens)] == q_lens and k_seq[: len(k_lens)] == k_lens
    assert max(q_seq) <= mq and max(k_seq) <= mk  # the kernel's max lengths hold
    assert all(k > 0 for q, k in zip(q_seq, k_seq, strict=True) if q > 0)  # never zero keys


def test_cross_layouts_pair_every_query_chunk_with_keys():
    _check_pairs([5, 9], [7, 3])
    _check_pairs([20], [16])
    _check_pairs([1] * 17, [1] * 17)
    _check_pairs([40] * 20, [3] * 20)
    rng = random.Random(0)
    for _ in range(300):
        b = rng.randint(1, 32)
        q_lens = [rng.randint(1, 200) for _ in range(b)]
        _check_pairs(q_lens, [rng.randint(1, 300) for _ in range(b)])


def test_the_capture_layout_leaves_unpaired_query_chunks_out():
    """All rows padding (what a graph is captured with): with fewer memory rows than query
    chunks, the chunks without keys belong to no sequence."""
    cu_q, cu_k = cross_layout([], [], 1024, 16, 16, 16, cross_slots(1024, 16, 16, 16, 4))
    q_seq = [b - a for a, b in pairwise(cu_q)]
    k_seq = [b - a for a, b in pairwise(cu_k)]
    assert cu_q[-1] == 16 * 16 and cu_k[-1] == 16  # 16 chunks of 16 queries, 1 key each
    assert all(k > 0 for q, k in zip(q_seq, k_seq, strict=True) if q > 0)
