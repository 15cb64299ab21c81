"""Packed variable-length batches: plan the attention groups once, reuse them in every layer.

Tokens of all sequences sit in one (N, E) tensor with `cu_seqlens` (B+1,) boundaries, the
flash-attention convention. Projections, out_proj and the FFN run once on all N tokens; only
attention needs sequence boundaries, and `make_plan` decides its SDPA calls once per forward.

Grouping policy (the default is exact): sequences sharing (T, S, is_causal, has_mask) are
stacked into one (G, H, T, head_dim) SDPA call. No row of any call depends on padding or on
batch-mates, so a sequence's numbers never depend on what it was batched with (where SDPA itself
would not keep that, few queries on more keys, packed_attention runs a group's sequences one by
one).

Opt-in bucketing (`bucket_padding` > 0): sequences of nearby lengths share one masked SDPA
call, padded to the bucket's longest (T, S). A bucket grows (longest first) while
G * T_max * S_max <= (1 + bucket_padding) * sum(T_i * S_i), so the attention FLOPs spent on
padding are at most `bucket_padding` times the useful ones (projections and FFN never see
padding). Masked padding is not bit-exact against the unpadded call on CPU SDPA (differences
~3e-7 in fp32), so bucketing gives up bit-exact batch invariance; it stays off by default.

On CUDA, a plan without masks and with one causal flag for all sequences (self- or
cross-attention, GQA in fp16/bf16) goes through one varlen kernel call (cuda_varlen.py: flash for
fp16/bf16, memory-efficient for fp32) with no nested tensors and no host sync; other plans take
the groups and are counted (FusedAttention.cuda_grouped_calls). Checked on an H100 (tests/gpu).

A layer may add a score bias that depends only on a sequence's (T, S) (`AttnBias`: MPNet's
relative positions, ModernBERT's sliding window): each group's bias is broadcast over its
sequences (a LocalWindow is attended by blocks, one sequence at a time). Neither varlen kernel
takes one: on the CPU a sequence whose bias is None still takes cpu_varlen's kernel (decided per
sequence, so never by batch-mates); on CUDA a layer with a bias runs every sequence grouped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise

import torch
from torch import Tensor

from . import cpu_varlen
from .devices import upload
from .fused import MIN_ROWS as MIN_GEMM_ROWS  # noqa: F401 (re-exported)
from .fused import pad_rows  # noqa: F401 (re-exported)

Rows = Tensor | slice


@dataclass(frozen=True)
class LocalWindow:
    """What an AttnBias gives for long sequences of a sliding-window layer: attend to the keys
    within `window` positions of each query, `block` queries at a time against their keys only
    (packed_attention.banded_attention), never a (T, S) mask."""

    window: int
    block: int = 128


# (tgt_len, src_len) -> an additive (1, H|1, T, S) score bias, a LocalWindow, or None where it
# adds nothing
AttnBias = Callable[[int, int], Tensor | LocalWindow | None]


@dataclass
class Group:
    """Sequences attended in one SDPA call, each padded (or not) to (tgt_len, src_len)."""

    tgt_len: int
    src_len: int
    is_causal: bool
    size: int
    q_rows: Rows  # (G*T,) packed query row of every position, or one contiguous slice
    kv_rows: Rows  # (G*S,) packed key/value row of every position
    key_padding_mask: Tensor | None  # (G, S) bool or float, padding included
    real: Tensor | None = None  # padded groups: (sum T_i,) positions in (G*T) that are tokens
    out_rows: Tensor | None = None  # padded groups: their packed query rows


@dataclass
class Plan:
    """Attention layout of one packed call, reused by every layer of an encoder."""

    q_lens: list[int]
    kv_lens: list[int]
    cu_seqlens: Tensor  # (B+1,) int32 on the model's device (the varlen kernels' type)
    plain: bool  # equal query/key lengths, no masks, no causal (what CUDA graphs replay)
    build_groups: Callable[[Callable[[int], bool] | None], list[Group]] = field(repr=False)
    cu_seqlens_k: Tensor | None = None  # (B+1,) int32 of the keys where their lengths differ
    causal: bool = False  # every sequence causal (only with varlen_ok)
    varlen_ok: bool = False  # one varlen kernel call can do it (no masks, one causal flag)
    seq_causal: list[bool] = field(default_factory=list)  # per sequence
    seq_masked: list[bool] = field(default_factory=list)  # per sequence: its mask hides keys
    _groups: list[Group] | None = field(default=None, repr=False)
    _cpu: dict[tuple, tuple[Tensor | None, list[Group]]] = field(default_factory=dict, repr=False)

    @property
    def groups(self) -> list[Group]:
        """The SDPA groups, built on first use: a forward that takes the CUDA varlen kernel
        never builds them (each group's index tensors would be host-to-device copies)."""
        if self._groups is None:
            self._groups = self.build_groups(None)
        return self._groups

    def cpu_split(
        self, limit: int, biased: tuple[bool, ...] = ()
    ) -> tuple[Tensor | None, list[Group]]:
        """For cpu_varlen's kernel with this length limit: each sequence's mode, (B,) uint8
        (0: not the kernel's; None when no sequence is), and the SDPA groups of the mode-0
        sequences; `biased` sequences (a layer's score bias applies) are never the kernel's.
        Cached per (limit, biased)."""
        key = (limit, biased)
        if key not in self._cpu:
            hidden = (
                [m or b for m, b in zip(self.seq_masked, biased, strict=True)]
                if biased
                else self.seq_masked
            )
            modes = cpu_varlen.modes(self.q_lens, self.kv_lens, self.seq_causal, hidden, limit)
            if not any(modes):  # none for the kernel: all of them grouped, as without it
                self._cpu[key] = (None, self.groups)
            else:
                groups = self.build_groups(lambda i: modes[i] == 0) if 0 in modes else []
                self._cpu[key] = (torch.tensor(modes, dtype=torch.uint8), groups)
        return self._cpu[key]

    @property
    def num_sdpa_calls(self) -> int:
        return len(self.groups)


def lengths(cu_seqlens: Tensor | Sequence[int], total: int, name: str = "cu_seqlens") -> list[int]:
    """Sequence lengths from (B+1,) boundaries; checks they start at 0, rise and end at `total`."""
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
    if not cu or cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total}, got {cu}")
    lens = [b - a for a, b in pairwise(cu)]
    if any(n < 0 for n in lens):
        raise ValueError(f"{name} must not decrease, got {cu}")
    return lens


def cumulative(lens: list[int]) -> list[int]:
    """cu_seqlens (B+1,) of these lengths: [0, n_0, n_0 + n_1, ...]."""
    return [0, *accumulate(lens)]


def _offsets(lens: list[int]) -> list[int]:
    """Each sequence's first packed row: cu_seqlens without its end."""
    return cumulative(lens)[:-1]


def _rows(offsets: list[int], length: int, device: torch.device) -> Rows:
    """Packed rows of sequences of `length` starting at `offsets`: a slice when they lie back to
    back (one sequence, or a uniform batch: views, no gather), else an index tensor."""
    if all(o == offsets[0] + i * length for i, o in enumerate(offsets)):
        return slice(offsets[0], offsets[0] + len(offsets) * length)
    starts = torch.tensor(offsets, dtype=torch.long, device=device)
    return (starts[:, None] + torch.arange(length, device=device)).reshape(-1)  # (G*T,)


def take(x: Tensor, rows: Rows) -> Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _masked(kpm: Tensor | None, kv_lens: list[int]) -> list[bool]:
    """Per sequence: does its slice of the packed mask hide anything? All-False is no mask."""
    if kpm is None:
        return [False] * len(kv_lens)
    hides = kpm if kpm.dtype == torch.bool else kpm != 0  # (M,)
    seg = torch.repeat_interleave(
        torch.arange(len(kv_lens), device=kpm.device), torch.tensor(kv_lens, device=kpm.device)
    )
    counts = torch.zeros(len(kv_lens), device=kpm.device).index_add_(0, seg, hides.float())
    return [c > 0 for c in counts.tolist()]


def _exact_group(members, q_lens, kv_lens, q_off, kv_off, causal, masked, kpm, device) -> Group:
    t, s, size = q_lens[members[0]], kv_lens[members[0]], len(members)
    kv_rows = _rows([kv_off[i] for i in members], s, device)
    mask = take(kpm, kv_rows).view(size, s) if masked[members[0]] else None  # (G, S)
    return Group(
        t, s, causal[members[0]], size, _rows([q_off[i] for i in members], t, device), kv_rows, mask
    )


def _padded_group(members, q_lens, kv_lens, q_off, kv_off, causal, masked, kpm, device) -> Group:
    """Members padded at the end to the longest (T, S); padding keys masked, queries dropped."""
    T, S = max(q_lens[i] for i in members), max(kv_lens[i] for i in members)
    tq = torch.tensor([q_lens[i] for i in members], device=device)  # (G,)
    ts = torch.tensor([kv_lens[i] for i in members], device=device)  # (G,)
    q0 = torch.tensor([q_off[i] for i in members], device=device)
    k0 = torch.tensor([kv_off[i] for i in members], device=device)
    pos_t, pos_s = torch.arange(T, device=device), torch.arange(S, device=device)
    # padded positions read the sequence's last row: finite values, masked or dropped later
    q_rows = (q0[:, None] + torch.minimum(pos_t[None], tq[:, None] - 1)).reshape(-1)  # (G*T,)
    kv_rows = (k0[:, None] + torch.minimum(pos_s[None], ts[:, None] - 1)).reshape(-1)  # (G*S,)
    pad = pos_s[None] >= ts[:, None]  # (G, S) True on padding keys
    mask: Tensor | None = pad
    if any(masked[i] for i in members):
        own = take(kpm, kv_rows).view(len(members), S)
        mask = own | pad if own.dtype == torch.bool else own.masked_fill(pad, float("-inf"))
    real_q = pos_t[None] < tq[:, None]  # (G, T)
    real = real_q.reshape(-1).nonzero().squeeze(1)  # (sum T_i,)
    out_rows = q_rows.index_select(0, real)
    return Group(T, S, causal[members[0]], len(members), q_rows, kv_rows, mask, real, out_rows)


def _buckets(seqs: list[int], q_lens: list[int], kv_lens: list[int], budget: float):
    """Greedy buckets, longest first, while padded attention FLOPs <= (1 + budget) * useful."""
    order = sorted(seqs, key=lambda i: (kv_lens[i], q_lens[i]), reverse=True)
    bucket: list[int] = []
    T = S = useful = 0
    for i in order:
        t, s = q_lens[i], kv_lens[i]
        T2, S2, useful2 = max(T, t), max(S, s), useful + t * s
        if bucket and (len(bucket) + 1) * T2 * S2 > (1 + budget) * useful2:
            yield bucket
            bucket, T2, S2, useful2 = [], t, s, t * s
        bucket.append(i)
        T, S, useful = T2, S2, useful2
    if bucket:
        yield bucket


def make_plan(
    q_lens: list[int],
    kv_lens: list[int] | None = None,
    is_causal: bool | Sequence[bool] = False,
    key_padding_mask: Tensor | None = None,
    device: torch.device | str = "cpu",
    bucket_padding: float = 0.0,
) -> Plan:
    """Group sequences for SDPA (see the module docstring for the policy and its bound).

    key_padding_mask: packed (M,) over all keys, bool (True = ignore) or additive float; a
    sequence whose slice hides nothing counts as unmasked, so omitting a mask and sending an
    all-False one give the same numbers.
    """
    device = torch.device(device)
    n = len(q_lens)
    if isinstance(is_causal, Tensor):
        is_causal = is_causal.tolist()
    kv_lens = list(q_lens) if kv_lens is None else list(kv_lens)
    causal = [bool(is_causal)] * n if isinstance(is_causal, bool) else [bool(c) for c in is_causal]
    if len(kv_lens) != n or len(causal) != n:
        raise ValueError(
            f"{n} query sequences but {len(kv_lens)} key sequences and "
            f"{len(causal)} is_causal flags"
        )
    if key_padding_mask is not None:
        if key_padding_mask.shape != (sum(kv_lens),):
            raise ValueError(
                f"key_padding_mask shape {tuple(key_padding_mask.shape)} != "
                f"{(sum(kv_lens),)} (one entry per packed key)"
            )
        key_padding_mask = key_padding_mask.to(device)
    if bucket_padding < 0:
        raise ValueError(f"bucket_padding must be >= 0, got {bucket_padding}")
    masked = _masked(key_padding_mask, kv_lens)

    def build_groups(only: Callable[[int], bool] | None) -> list[Group]:
        q_off, kv_off = _offsets(q_lens), _offsets(kv_lens)
        args = (q_lens, kv_lens, q_off, kv_off, causal, masked, key_padding_mask, device)
        exact: dict[tuple[int, int, bool, bool], list[int]] = {}
        classes: dict[bool, list[int]] = {}
        for i in range(n):
            if only is not None and not only(i):
                continue
            if bucket_padding > 0 and q_lens[i] > 0 and kv_lens[i] > 0:
                classes.setdefault(causal[i], []).append(i)
            else:
                exact.setdefault((q_lens[i], kv_lens[i], causal[i], masked[i]), []).append(i)
        groups = [_exact_group(members, *args) for members in exact.values()]
        for seqs in classes.values():
            for bucket in _buckets(seqs, q_lens, kv_lens, bucket_padding):
                same = len({(q_lens[i], kv_lens[i], masked[i]) for i in bucket}) == 1
                groups.append((_exact_group if same else _padded_group)(bucket, *args))
        return groups

    cu = _upload(cumulative(q_lens), device)
    cu_k = None if kv_lens == q_lens else _upload(cumulative(kv_lens), device)
    unmasked, all_causal = not any(masked), all(causal)
    # one kernel call: no masks, one causal flag for all (causal only on square sequences,
    # where flash's and SDPA's alignments of the causal mask agree)
    varlen_ok = unmasked and (not any(causal) or (all_causal and q_lens == kv_lens))
    plain = q_lens == kv_lens and not any(causal) and unmasked
    return Plan(
        q_lens, kv_lens, cu, plain, build_groups, cu_k, all_causal and bool(n), varlen_ok,
        causal, masked,
    )  # fmt: skip


def _upload(values: list[int], device: torch.device) -> Tensor:
    """An int32 tensor of `values` on `device` (see devices.upload)."""
    return upload(torch.tensor(values, dtype=torch.int32), device)
