"""CUDA-graph replay of a packed self-attention forward, one graph per bucketed shape.

At small and medium batches the GPU finishes a layer faster than Python can launch its kernels;
a CUDA graph launches the whole forward at once. A graph has fixed shapes and addresses, so each
one owns static buffers for a bucket: `tokens` rows (a power of two, >= 16) and sequences no
longer than `max_len` (a power of two, <= tokens). A batch of N tokens is copied into the first
N rows; the padding rows N..tokens form extra sequences of at most `max_len` tokens (never
attended by a real one), and unused sequence slots are empty (cu_seqlens repeats its end), so a
real row's numbers are those of the same bucket's eager forward. All graphs share one memory
pool; their number is bounded and what they hold is reported (`count`, `memory_bytes`).

Packed self-attention without masks replays, every sequence causal or none (the varlen kernel's
one causal flag; a causal bucket is its own graph, captured on first use). Masked calls, mixed
causal flags, cross-attention and batches past the largest bucket run eagerly. The non-causal
graphs were verified on an H100 by tests/gpu; the causal ones, and the double-buffered
cu_seqlens upload, are written to the same design and tested on the CPU with the capture stood
in for (tests/mha_engine/test_cuda_graphs.py), not yet on a GPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .quantize import is_int8
from .varlen import Plan, varlen_capable

log = logging.getLogger(__name__)

MIN_BUCKET = 16

# run(x (tokens, E) on the device, plan) -> (tokens, E): the model's packed forward without
# input checks or casts (what the graph captures)
PackedRun = Callable[[Tensor, Plan], Tensor]


def _no_groups() -> list:
    raise RuntimeError("a CUDA-graph plan has no SDPA groups: it runs the varlen kernel only")


def bucket(n: int) -> int:
    """The power of two >= max(n, MIN_BUCKET)."""
    return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())


# (tokens, max_len, causal): a graph's bucket and its causal flag
Key = tuple[int, int, bool]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x: Tensor  # (tokens, E) static input
    cu: Tensor  # (slots + 1,) int32 static cu_seqlens
    out: Tensor  # (tokens, E) static output
    # two pinned (slots + 1,) int32 host buffers, used in turn for the next cu_seqlens, each
    # with the event of its last upload: a new layout waits only for the upload two layouts
    # back (long done), never for the batch just queued
    cu_hosts: tuple[Tensor, Tensor]
    uploads: tuple[torch.cuda.Event, torch.cuda.Event]
    turn: int = 0  # the buffer the last upload used
    last_cu: list[int] | None = None  # what `cu` holds now: an unchanged layout skips the upload


def _record(fn: Callable[[], Tensor], device: torch.device, pool) -> tuple[object, Tensor]:
    """(graph, static output) of `fn` captured into `pool`, after two warm-up calls on a side
    stream (kernels pick their algorithms outside the capture). The capture forbids unsafe CUDA
    calls in this thread only ("thread_local"): a bucket captured on first use while serving
    must not fail because another thread (`--cuda-overlap`'s completer waiting on an event, a
    shared-memory registration) makes a CUDA call meanwhile."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.inference_mode(), torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def _pinned(like: Tensor) -> Tensor:
    """A pinned host tensor of like's shape and dtype."""
    return torch.empty(like.shape, dtype=like.dtype).pin_memory()


def _event() -> torch.cuda.Event:
    return torch.cuda.Event()


class CudaGraphs:
    """Graphs of `run` keyed by (tokens, max_len) buckets, captured on first use or by `warm`.

    max_tokens bounds the largest bucket (bigger batches are GPU-bound: eager is as fast);
    max_sequences the sequences of one batch that can replay; max_graphs the graphs held.
    """

    def __init__(
        self,
        run: PackedRun,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        max_tokens: int = 4096,
        max_sequences: int = 256,
        max_graphs: int = 64,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if max_tokens < MIN_BUCKET or max_tokens & (max_tokens - 1):
            raise ValueError(f"max_tokens must be a power of two >= {MIN_BUCKET}, got {max_tokens}")
        self.run, self.width, self.dtype, self.device = run, width, dtype, device
        self.max_tokens, self.max_sequences, self.max_graphs = (
            max_tokens,
            max_sequences,
            max_graphs,
        )
        self.graphs: dict[Key, _Graph] = {}
        self.failed: set[Key] = set()  # buckets whose capture failed: never tried again
        self.replays = 0
        self._memory: tuple[int, int] = (0, 0)  # (graph count, bytes) when last measured
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def count(self) -> int:
        return len(self.graphs)

    def key(self, lens: list[int]) -> tuple[int, int] | None:
        """The bucket of a batch with these sequence lengths, or None when it cannot replay."""
        return bucket_key(lens, self.max_tokens, self.max_sequences)

    def _capture(self, key: Key) -> _Graph | None:
        if key in self.graphs:
            return self.graphs[key]
        if key in self.failed or len(self.graphs) >= self.max_graphs:
            return None
        tokens, max_len, causal = key
        slots = bucket_slots(tokens, max_len, self.max_sequences)
        x = torch.zeros(tokens, self.width, dtype=self.dtype, device=self.device)  # (tokens, E)
        # warm-up layout: the padding rows as chunks of max_len, the rest empty slots
        cu = torch.tensor(_cu_seqlens([], tokens, max_len, slots), dtype=torch.int32)
        cu = cu.to(self.device)  # (slots + 1,)
        plan = Plan([max_len], [max_len], cu, not causal, _no_groups, causal=causal, varlen_ok=True)
        try:
            graph, out = _record(lambda: self.run(x, plan), self.device, self._pool)  # (tokens, E)
        except RuntimeError as exc:  # refused by the driver: this bucket runs eagerly from now on
            self.failed.add(key)
            log.warning("CUDA graph capture of bucket %s failed; it runs eagerly: %s", key, exc)
            return None
        hosts, events = (_pinned(cu), _pinned(cu)), (_event(), _event())
        self.graphs[key] = _Graph(graph, x, cu, out, hosts, events)
        return self.graphs[key]

    @property
    def memory_bytes(self) -> int:
        """GPU memory the graphs hold: their private pool's segments and static inputs.
        Measured (an allocator snapshot) only when the graph count changed since last time."""
        if self._memory[0] != self.count:
            pool = tuple(self._pool)
            held = sum(
                seg["total_size"]
                for seg in torch.cuda.memory_snapshot()
                if tuple(seg.get("segment_pool_id", ())) == pool
            )
            held += sum(g.x.nbytes + g.cu.nbytes for g in self.graphs.values())
            self._memory = (self.count, held)
        return self._memory[1]

    def warm(self, max_len: int | None = None, causal: bool = False) -> int:
        """Capture every bucket up to max_tokens (and sequences up to max_len), non-causal or
        causal; returns the number of graphs held. Done at load so no request pays for a
        capture."""
        tokens = MIN_BUCKET
        while tokens <= self.max_tokens:
            length = MIN_BUCKET
            while length <= tokens and (max_len is None or length < 2 * max_len):
                if len(self.graphs) >= self.max_graphs:
                    return self.count
                self._capture((tokens, length, causal))  # a failed one is logged and skipped
                length *= 2
            tokens *= 2
        return self.count

    def __call__(self, x: Tensor, lens: list[int], causal: bool = False) -> Tensor | None:
        """The forward of packed x (N, E) split into `lens` (every sequence causal, or none) by
        graph replay; None when no graph applies (the caller runs eagerly)."""
        key = self.key(lens)
        graph = None if key is None else self._capture((*key, causal))
        if graph is None:
            return None
        tokens, max_len = key
        n = x.shape[0]
        cu = _cu_seqlens(lens, tokens, max_len, graph.cu.shape[0] - 1)
        if cu != graph.last_cu:  # uniform traffic repeats its layout: no upload then
            turn = graph.turn = 1 - graph.turn
            graph.uploads[turn].synchronize()  # this buffer's last upload has left it
            graph.cu_hosts[turn].numpy()[:] = cu
            graph.cu.copy_(graph.cu_hosts[turn], non_blocking=True)
            graph.uploads[turn].record()
            graph.last_cu = cu
        graph.x[:n].copy_(x)
        graph.x[n:].zero_()
        graph.graph.replay()
        self.replays += 1
        return graph.out[:n].clone()  # (N, E): the static output is overwritten next replay


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


def _cu_seqlens(lens: list[int], tokens: int, max_len: int, slots: int) -> list[int]:
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


def capture(
    model,
    captures: bool,
    max_tokens: int,
    max_sequences: int,
    max_graphs: int,
    warm_max_len: int | None,
) -> CudaGraphs:
    """CudaGraphs of an engine model's `packed_run`, warmed now; ValueError saying why where
    the model cannot replay (`captures`: it has a packed self-attention forward at all)."""
    if model.device.type != "cuda":
        raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {model.device}")
    if not captures:
        raise ValueError(f"{model.architecture} has no packed self-attention forward to capture")
    if is_int8(model) or not all(varlen_capable(a) for a in model.attention_layers()):
        raise ValueError(
            "CUDA graphs need every attention layer to run the varlen kernel (fused Q/K/V, "
            "no bias_k/add_zero_attn, no GQA, head_dim a multiple of 8 up to 256)"
        )
    graphs = CudaGraphs(
        model.packed_run,
        model.embed_dim,
        model.dtype,
        model.device,
        max_tokens,
        max_sequences,
        max_graphs,
    )
    graphs.warm(warm_max_len)
    return graphs


def graph_mode(
    key_padding_mask: Tensor | None, is_causal: bool | Sequence[bool] | Tensor
) -> bool | None:
    """The causal flag a CUDA graph replays this self-attention call with: False (no sequence
    causal) or True (all of them); None when none can (a mask, or mixed causal flags)."""
    if key_padding_mask is not None:
        return None
    if isinstance(is_causal, bool):
        return is_causal
    flags = is_causal.reshape(-1).tolist() if isinstance(is_causal, Tensor) else list(is_causal)
    if all(flags):
        return bool(flags)  # an empty batch: not causal
    return None if any(flags) else False
