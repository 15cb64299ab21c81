"""Bucket shapes and cu_seqlens layouts for CUDA-graph replay (host side, no CUDA).

A graph has fixed shapes, so a batch of N tokens replays the graph of its bucket: `tokens` rows
(a power of two, >= MIN_BUCKET) and sequences no longer than `max_len` (a power of two, <=
tokens). The real sequences come first; the padding rows N..tokens form extra sequences of at
most `max_len` rows, which no real row attends to; unused sequence slots are empty (cu_seqlens
repeats its end). Cross-attention pairs query sequence i with memory sequence i, so its two
layouts have the same number of slots, and every padding query chunk gets a memory chunk of at
least one row (the memory bucket leaves room for them): no query ever attends to zero keys.
"""

from __future__ import annotations

import math

MIN_BUCKET = 16


def bucket(n: int) -> int:
    """The power of two >= max(n, MIN_BUCKET)."""
    return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())


def bucket_slots(tokens: int, max_len: int, max_sequences: int) -> int:
    """Sequence slots of a bucket: the real sequences plus the padding's chunks."""
    return min(tokens, max_sequences + math.ceil(tokens / max_len))


def bucket_key(lens: list[int], max_tokens: int, max_sequences: int) -> tuple[int, int] | None:
    """(tokens, max_len) bucket of a batch with these lengths; None past the largest bucket,
    past max_sequences, or with more (empty) sequences than the bucket has slots."""
    n = sum(lens)
    if not lens or n > max_tokens or len(lens) > max_sequences:
        return None
    tokens = bucket(n)
    max_len = min(tokens, bucket(max(lens)))
    pad_chunks = math.ceil((tokens - n) / max_len)
    if len(lens) + pad_chunks > bucket_slots(tokens, max_len, max_sequences):
        return None
    return tokens, max_len


def self_layout(lens: list[int], tokens: int, max_len: int, slots: int) -> list[int]:
    """cu_seqlens (slots + 1,) of `lens` followed by the padding rows up to `tokens` in chunks
    of at most max_len, then empty slots."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    while cu[-1] < tokens:
        cu.append(min(tokens, cu[-1] + max_len))
    if len(cu) > slots + 1:
        raise ValueError(f"{len(cu) - 1} sequences do not fit the bucket's {slots} slots")
    return cu + [tokens] * (slots + 1 - len(cu))


def cross_slots(tq: int, mq: int, tk: int, mk: int, max_sequences: int) -> int:
    """Sequence slots of a cross-attention bucket: the real pairs plus the padding's chunks
    (as many memory chunks as query chunks, or more)."""
    return max_sequences + max(math.ceil(tq / mq), math.ceil(tk / mk))


def cross_key(
    q_lens: list[int], k_lens: list[int], max_tokens: int, max_sequences: int
) -> tuple[int, int, int, int] | None:
    """(tq, mq, tk, mk) bucket of a cross-attention batch: queries as a self-attention bucket,
    memory rows rounded up past one row per query padding chunk; None where it cannot replay."""
    q = bucket_key(q_lens, max_tokens, max_sequences)
    if q is None or len(k_lens) != len(q_lens) or not all(k_lens):
        return None
    tq, mq = q
    pad_chunks = math.ceil((tq - sum(q_lens)) / mq)
    tk = bucket(sum(k_lens) + pad_chunks)
    if tk > max_tokens:
        return None
    return tq, mq, tk, min(tk, bucket(max(k_lens)))


def cross_layout(
    q_lens: list[int], k_lens: list[int], tq: int, mq: int, tk: int, mk: int, slots: int
) -> list[list[int]]:
    """[cu_seqlens of the queries, of the memory], each (slots + 1,): the real pairs, then the
    query padding in chunks of at most mq rows, each paired with a non-empty memory chunk of
    at most mk rows, then empty slots. With too few memory padding rows (only the all-padding
    layout a graph is captured with) the query chunks without a partner are left out: their
    rows belong to no sequence and are never read."""
    nq, nk = sum(q_lens), sum(k_lens)
    q_pad = [min(mq, tq - start) for start in range(nq, tq, mq)]
    k_rows = tk - nk
    chunks = max(len(q_pad), math.ceil(k_rows / mk))
    if k_rows < chunks:  # capture layout only: cross_key leaves a row per query chunk
        chunks = k_rows
        q_pad = q_pad[:chunks]
    k_pad = [k_rows // chunks + (i < k_rows % chunks) for i in range(chunks)] if chunks else []
    cu_q, cu_k = [0], [0]
    for n in (*q_lens, *q_pad):
        cu_q.append(cu_q[-1] + n)
    for n in (*k_lens, *k_pad):
        cu_k.append(cu_k[-1] + n)
    if max(len(cu_q), len(cu_k)) > slots + 1:
        raise ValueError(f"{len(k_lens) + chunks} sequences do not fit the bucket's {slots} slots")
    return [cu + [cu[-1]] * (slots + 1 - len(cu)) for cu in (cu_q, cu_k)]
