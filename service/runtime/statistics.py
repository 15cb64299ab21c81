"""Triton's statistics extension for the served model: cumulative counts and durations.

As Triton records them: an executed request's success, queue, compute_input, compute_infer,
compute_output (and cache_miss, or for a response cache hit cache_hit instead of compute_*) are
written together, once, when it completes (service.pipeline), so their counts
always agree (perf_analyzer requires it); a failed request counts in `fail` only. Batch-level
figures (inference_count, execution_count, batch_stats) come from the batcher's observer.
Warm-up batches are not counted.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from service.runtime.work import Work


class Timing(NamedTuple):
    """One executed request's durations in seconds (Triton's inference_stats kinds)."""

    input_s: float  # compute_input: decode + validate
    queue_s: float  # queued until its batch started
    infer_s: float  # compute_infer: its batch's forward
    output_s: float  # compute_output: encode
    total_s: float  # success: the whole request
    # response cache (--response-cache-bytes): a hit's look-up and encode (it has no queue or
    # compute_* then), or a miss's look-up and insert; None: the model's outputs are not cached
    cache_hit_s: float | None = None
    cache_miss_s: float | None = None


class Duration:
    """A cumulative count and total nanoseconds (Triton's StatisticDuration)."""

    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += round(seconds * 1e9)

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class ModelStats:
    """One model version's statistics; a BatchObserver, updated from the engine thread and the
    event loop under one lock."""

    KINDS = (
        "success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
        "cache_hit", "cache_miss",
    )  # fmt: skip

    def __init__(self, name: str, version: str) -> None:
        self.name = name
        self.version = version
        self.counting = False  # set once warm-up is over
        self._lock = threading.Lock()
        self._durations = {kind: Duration() for kind in self.KINDS}
        self._batches: dict[int, Duration] = {}  # sequences per forward -> compute_infer
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference = 0  # ms since the epoch

    # -- request side (event loop) ----------------------------------------------------------
    def executed(self, timing: Timing) -> None:
        """One executed request (or response cache hit), all its durations written together.
        As Triton: a hit counts in success, queue (0 s: it never waited) and cache_hit, not in
        compute_*; a miss in cache_miss as well."""
        durations = self._durations
        with self._lock:
            durations["success"].add(timing.total_s)
            durations["queue"].add(timing.queue_s)
            if timing.cache_hit_s is not None:
                durations["cache_hit"].add(timing.cache_hit_s)
                return
            if timing.cache_miss_s is not None:
                durations["cache_miss"].add(timing.cache_miss_s)
            durations["compute_input"].add(timing.input_s)
            durations["compute_infer"].add(timing.infer_s)
            durations["compute_output"].add(timing.output_s)

    def failed(self, seconds: float) -> None:
        """One request that failed (before, in or after its forward): counted in `fail` only."""
        with self._lock:
            self._durations["fail"].add(seconds)

    # -- batcher side (BatchObserver) -------------------------------------------------------
    def queue_depth(self, sequences: int) -> None:
        pass

    def batch_started(self, works: list[Any]) -> None:
        pass

    def expired(self, work: Any) -> None:
        pass  # the pipeline counts the failure

    def batch_on_loop(self) -> None:
        pass

    def batch_done(self, works: list[Any], compute_s: float, ok: bool) -> None:
        if not (ok and self.counting):
            return  # a failed batch is retried one request at a time, which reports again
        sequences = sum(w.payload.num_sequences for w in works)
        with self._lock:
            self.execution_count += 1
            self.inference_count += sequences
            self.last_inference = int(time.time() * 1000)
            self._batches.setdefault(sequences, Duration()).add(compute_s)

    # -- reading -----------------------------------------------------------------------------
    async def snapshot(self) -> dict[str, Any]:
        """as_dict(), awaitable like a worker front-end's (service.workers.remote.RemoteStats)."""
        return self.as_dict()

    def as_dict(self) -> dict[str, Any]:
        """Triton's ModelStatistics as JSON (the HTTP answer; gRPC parses the same dict)."""
        with self._lock:
            return {
                "name": self.name,
                "version": self.version,
                "last_inference": self.last_inference,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {k: d.as_dict() for k, d in self._durations.items()},
                "batch_stats": [
                    {"batch_size": size, "compute_infer": d.as_dict()}
                    for size, d in sorted(self._batches.items())
                ],
            }


class BatchObserver(Protocol):
    """What the batcher reports (implemented by service.runtime.metrics and ModelStats)."""

    def queue_depth(self, sequences: int) -> None: ...
    def batch_started(self, works: list[Work]) -> None: ...
    def expired(self, work: Work) -> None: ...
    def batch_done(self, works: list[Work], compute_s: float, ok: bool) -> None: ...
    def batch_on_loop(self) -> None: ...


class Observers:
    """Several BatchObservers behind the batcher's one `observer` (metrics and statistics)."""

    def __init__(self, *observers: Any) -> None:
        self.observers = observers

    def queue_depth(self, sequences: int) -> None:
        for observer in self.observers:
            observer.queue_depth(sequences)

    def batch_started(self, works: list[Any]) -> None:
        for observer in self.observers:
            observer.batch_started(works)

    def expired(self, work: Any) -> None:
        for observer in self.observers:
            observer.expired(work)

    def batch_done(self, works: list[Any], compute_s: float, ok: bool) -> None:
        for observer in self.observers:
            observer.batch_done(works, compute_s, ok)

    def batch_on_loop(self) -> None:
        for observer in self.observers:
            observer.batch_on_loop()
