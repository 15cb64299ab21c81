"""CUDA-graph replay of packed attention forwards, one graph per bucketed shape.

At small and medium batches the GPU finishes a layer faster than Python can launch its kernels;
a CUDA graph launches the whole forward at once. A graph has fixed shapes and addresses, so each
one owns static buffers for a bucket (graph_buckets.py): a batch's rows are copied into the
first rows, the padding rows form sequences of their own that no real row attends to, and the
batch's cu_seqlens are uploaded into a static buffer, so a real row's numbers are those of the
same bucket's eager forward. All graphs share one memory pool; their number is bounded and what
they hold is reported (`count`, `memory_bytes`).

Two kinds replay, unmasked: packed self-attention (every sequence causal or none: the varlen
kernel's one causal flag) and cross-attention, queries against a memory of their own (decoder
stacks: causal self-attention, then cross-attention to the memory; an attention block given its
own key and value tensors). Non-causal self-attention buckets are captured at load, the rest on
first use. Masked calls, mixed causal flags and batches past the largest bucket run eagerly,
and so does every bucket not yet captured once a capture failed. Captures run one at a time in
the process, on the model's device and one capture stream per pool. The non-causal
self-attention graphs were verified on an H100 by tests/gpu; the causal and cross-attention
ones, the double-buffered cu_seqlens upload and the capture's device, stream and lock follow
the same design and are tested on the CPU with the capture stood in for
(tests/mha_engine/test_cuda_graphs.py), not yet on a GPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .graph_buckets import (
    MIN_BUCKET,
    bucket_key,
    bucket_slots,
    cross_key,
    cross_layout,
    cross_slots,
    self_layout,
)
from .packed_attention import varlen_capable
from .quantize import is_int8
from .varlen import Plan

log = logging.getLogger(__name__)

# run(x (tokens, E) on the device, plan) -> (tokens, E): the model's packed self-attention
# forward without input checks or casts (what the graph captures)
PackedRun = Callable[[Tensor, Plan], Tensor]
# cross_run(x (tq, E), memory tensors (tk, width) each, self-attention plan of x, cross plan
# x -> memory) -> (tq, E): the model's packed cross-attention forward
CrossRun = Callable[[Tensor, tuple[Tensor, ...], Plan, Plan], Tensor]
# (tokens, max_len, causal) for self-attention, (tq, mq, tk, mk, causal) for cross-attention
Key = tuple


def _no_groups() -> list:
    raise RuntimeError("a CUDA-graph plan has no SDPA groups: it runs the varlen kernel only")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]  # static inputs: queries (tq, E), then any memory (tk, width)
    cus: Tensor  # (1 or 2, slots + 1) int32: cu_seqlens of the queries (then of the memory)
    out: Tensor  # (tq, E) static output
    # two pinned host copies of `cus`, used in turn for the next layout, each with the event of
    # its last upload: a new layout waits only for the upload two layouts back (long done),
    # never for the batch just queued
    cu_hosts: tuple[Tensor, Tensor]
    uploads: tuple[torch.cuda.Event, torch.cuda.Event]
    turn: int = 0  # the host copy the last upload used
    last_cu: list[list[int]] | None = None  # what `cus` holds: an unchanged layout skips uploads


# PyTorch allows one graph capture at a time in a process, and models (or versions of one)
# capture on their own threads: a load's warm-up while others serve, first-use buckets.
_CAPTURE_LOCK = threading.Lock()


def _record(
    fn: Callable[[], Tensor], device: torch.device, pool, stream: torch.cuda.Stream
) -> tuple[object, Tensor]:
    """(graph, static output) of `fn` captured into `pool` on `stream` (a stream of `device`,
    the same for every graph of the pool), after two warm-up calls on a side stream (kernels
    pick their algorithms outside the capture).

    On `device` as the current device: new threads start on cuda:0, and a capture on another
    device's stream would record nothing (the model's kernels would run eagerly, outside it).
    The capture forbids unsafe CUDA calls in this thread only ("thread_local"): a bucket
    captured on first use while serving must not fail because another thread (the
    `--cuda-overlap` completer, a shared-memory registration) makes a CUDA call meanwhile. A
    failed capture leaves its stream current (torch's context exits at capture_end, which
    raised): the thread's stream is put back."""
    with _CAPTURE_LOCK, torch.cuda.device(device):
        before = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(before)
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                fn()
        before.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with (
                torch.inference_mode(),
                torch.cuda.graph(graph, pool, stream=stream, capture_error_mode="thread_local"),
            ):
                out = fn()
        except BaseException:
            torch.cuda.set_stream(before)
            raise
    return graph, out


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _current_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream `device`'s work is queued on by this thread (not the current device's)."""
    return torch.cuda.current_stream(device)


def _pinned(like: Tensor) -> Tensor:
    """A pinned host tensor of like's shape and dtype."""
    return torch.empty(like.shape, dtype=like.dtype).pin_memory()


def _event() -> torch.cuda.Event:
    return torch.cuda.Event()


class CudaGraphs:
    """Graphs of `run` (self-attention) and `cross_run` (cross-attention to memory tensors of
    `memory_widths` columns) keyed by bucket, captured on first use or by `warm`.

    max_tokens bounds the largest bucket (bigger batches are GPU-bound: eager is as fast);
    max_sequences the sequences of one batch that can replay; max_graphs the graphs held.
    """

    def __init__(
        self,
        run: PackedRun | None,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        max_tokens: int = 4096,
        max_sequences: int = 256,
        max_graphs: int = 64,
        cross_run: CrossRun | None = None,
        memory_widths: tuple[int, ...] = (),
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if max_tokens < MIN_BUCKET or max_tokens & (max_tokens - 1):
            raise ValueError(f"max_tokens must be a power of two >= {MIN_BUCKET}, got {max_tokens}")
        self.run, self.width, self.dtype, self.device = run, width, dtype, device
        self.cross_run, self.memory_widths = cross_run, memory_widths
        self.max_tokens, self.max_sequences = max_tokens, max_sequences
        self.max_graphs = max_graphs
        self.graphs: dict[Key, _Graph] = {}
        self.failed: set[Key] = set()  # the bucket whose capture failed (then none is tried)
        self._stream: torch.cuda.Stream | None = None  # every capture's, made at the first
        self.replays = 0
        self._memory: tuple[int, int] = (0, 0)  # (graph count, bytes) when last measured
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def stopped(self) -> bool:
        """A capture failed: no more are tried (the graphs held still replay)."""
        return bool(self.failed)

    @property
    def count(self) -> int:
        return len(self.graphs)

    def key(self, lens: list[int]) -> tuple[int, int] | None:
        """The bucket of a batch with these sequence lengths, or None when it cannot replay."""
        return bucket_key(lens, self.max_tokens, self.max_sequences)

    def _zeros(self, rows: int, width: int) -> Tensor:
        return torch.zeros(rows, width, dtype=self.dtype, device=self.device)

    def _capture(self, key: Key) -> _Graph | None:
        if key in self.graphs:
            return self.graphs[key]
        if self.stopped or len(self.graphs) >= self.max_graphs:
            return None
        if len(key) == 3:  # self-attention
            tq, mq, causal = key
            slots = bucket_slots(tq, mq, self.max_sequences)
            layout = [self_layout([], tq, mq, slots)]  # the padding rows as chunks of mq
            inputs = (self._zeros(tq, self.width),)
        else:  # cross-attention
            tq, mq, tk, mk, causal = key
            slots = cross_slots(tq, mq, tk, mk, self.max_sequences)
            layout = cross_layout([], [], tq, mq, tk, mk, slots)
            memory = tuple(self._zeros(tk, width) for width in self.memory_widths)
            inputs = (self._zeros(tq, self.width), *memory)
        cus = torch.tensor(layout, dtype=torch.int32).to(self.device)  # (1|2, slots + 1)
        plan = Plan([mq], [mq], cus[0], not causal, _no_groups, causal=causal, varlen_ok=True)
        if len(key) == 3:

            def fn() -> Tensor:
                return self.run(inputs[0], plan)
        else:
            cross = Plan([mq], [mk], cus[0], False, _no_groups, cus[1], varlen_ok=True)

            def fn() -> Tensor:
                return self.cross_run(inputs[0], inputs[1:], plan, cross)

        if self._stream is None:
            self._stream = _new_stream(self.device)
        try:
            graph, out = _record(fn, self.device, self._pool, self._stream)  # (tq, E)
        except RuntimeError as exc:  # refused by the driver (or out of memory): eager from now
            # on for it, and no further capture: what a failed capture leaves behind (the
            # allocator's capture bookkeeping) is not worth a second try while serving
            self.failed.add(key)
            log.warning(
                "CUDA graph capture of bucket %s failed; it and every bucket not yet captured "
                "run eagerly (%d graphs held still replay): %s",
                key,
                len(self.graphs),
                exc,
            )
            return None
        hosts, events = (_pinned(cus), _pinned(cus)), (_event(), _event())
        self.graphs[key] = _Graph(graph, inputs, cus, out, hosts, events)
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
            statics = (t for g in self.graphs.values() for t in (*g.inputs, g.cus))
            held += sum(t.nbytes for t in statics)
            self._memory = (self.count, held)
        return self._memory[1]

    def warm(self, max_len: int | None = None, causal: bool = False) -> int:
        """Capture every self-attention bucket up to max_tokens (and sequences up to max_len),
        non-causal or causal; returns the number of graphs held. Done at load so no request
        pays for a capture."""
        tokens = MIN_BUCKET
        while self.run is not None and tokens <= self.max_tokens:
            length = MIN_BUCKET
            while length <= tokens and (max_len is None or length < 2 * max_len):
                if len(self.graphs) >= self.max_graphs:
                    return self.count
                self._capture((tokens, length, causal))  # a failed one is logged and skipped
                length *= 2
            tokens *= 2
        return self.count

    def __call__(self, x: Tensor, lens: list[int], causal: bool = False) -> Tensor | None:
        """The self-attention forward of packed x (N, E) split into `lens` (every sequence
        causal, or none) by graph replay; None when no graph applies (the caller runs
        eagerly)."""
        key = None if self.run is None else self.key(lens)
        graph = None if key is None else self._capture((*key, causal))
        if graph is None:
            return None
        tokens, max_len = key
        layout = [self_layout(lens, tokens, max_len, graph.cus.shape[1] - 1)]
        return self._replay(graph, (x,), layout)

    def cross(
        self,
        x: Tensor,
        lens: list[int],
        memory: tuple[Tensor, ...],
        memory_lens: list[int],
        causal: bool = False,
    ) -> Tensor | None:
        """The cross-attention forward of packed x (N, E) split into `lens` against `memory`
        (tensors of M rows, split into `memory_lens`, sequence i for query sequence i), x's
        own self-attention causal or not; None when no graph applies."""
        if self.cross_run is None or len(memory) != len(self.memory_widths):
            return None
        key = cross_key(lens, memory_lens, self.max_tokens, self.max_sequences)
        graph = None if key is None else self._capture((*key, causal))
        if graph is None:
            return None
        layout = cross_layout(lens, memory_lens, *key, graph.cus.shape[1] - 1)
        return self._replay(graph, (x, *memory), layout)

    def _replay(self, graph: _Graph, tensors: tuple[Tensor, ...], layout: list[list[int]]):
        """Upload the layout (when it changed), copy the tensors into the static inputs (the
        rest zeroed), replay; the first N output rows, (N, E)."""
        if layout != graph.last_cu:  # uniform traffic repeats its layout: no upload then
            turn = graph.turn = 1 - graph.turn
            graph.uploads[turn].synchronize()  # this host copy's last upload has left it
            graph.cu_hosts[turn].numpy()[:] = layout
            graph.cus.copy_(graph.cu_hosts[turn], non_blocking=True)
            graph.uploads[turn].record(_current_stream(self.device))
            graph.last_cu = layout
        for static, tensor in zip(graph.inputs, tensors, strict=True):
            n = tensor.shape[0]
            static[:n].copy_(tensor)
            static[n:].zero_()
        graph.graph.replay()
        self.replays += 1
        return graph.out[: tensors[0].shape[0]].clone()  # overwritten by the next replay


def capture(
    model,
    captures: bool,
    crosses: bool,
    max_tokens: int,
    max_sequences: int,
    max_graphs: int,
    warm_max_len: int | None,
) -> CudaGraphs:
    """CudaGraphs of an engine model's `packed_run` (`captures`: it has one) and
    `packed_cross_run` (`crosses`), self-attention buckets warmed now; ValueError saying why
    where the model cannot replay."""
    if model.device.type != "cuda":
        raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {model.device}")
    if not (captures or crosses):
        raise ValueError(f"{model.architecture} has no packed attention forward to capture")
    if is_int8(model) or not all(varlen_capable(a) for a in model.attention_layers()):
        raise ValueError(
            "CUDA graphs need every attention layer to run the varlen kernel (fused Q/K/V, "
            "no bias_k/add_zero_attn, no GQA, head_dim a multiple of 8 up to 256)"
        )
    refusal = getattr(getattr(model, "encoder", None), "cuda_graphs_refusal", None)
    if refusal is not None:  # a stack whose layers add score biases (MPNet, JinaBERT, ModernBERT)
        raise ValueError(f"CUDA graphs replay the varlen kernel only: {refusal}")
    graphs = CudaGraphs(
        model.packed_run if captures else None,
        model.embed_dim,
        model.dtype,
        model.device,
        max_tokens,
        max_sequences,
        max_graphs,
        model.packed_cross_run if crosses else None,
        model.cross_memory_widths,
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
