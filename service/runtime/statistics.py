"""Triton's statistics extension for the served model: cumulative counts and durations.

Request-level figures (success, fail, compute_input, compute_output) come from the inference
handlers of both protocols; batch-level figures (inference_count, execution_count, queue,
compute_infer, batch_stats) from the batcher's observer. Warm-up batches are not counted.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any


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

    KINDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")

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
    def add(self, kind: str, seconds: float) -> None:
        """Record one request's `kind` duration (compute_input: decode + validate; compute_output:
        encode)."""
        with self._lock:
            self._durations[kind].add(seconds)

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Count the inference request run inside as a success or a failure, with its duration."""
        started = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            self.add("success" if ok else "fail", time.perf_counter() - started)

    # -- batcher side (BatchObserver) -------------------------------------------------------
    def queue_depth(self, sequences: int) -> None:
        pass

    def batch_started(self, works: list[Any]) -> None:
        pass

    def expired(self, work: Any) -> None:
        pass  # the handler's request() counts the failure

    def batch_done(self, works: list[Any], compute_s: float, ok: bool) -> None:
        if not (ok and self.counting):
            return  # a failed batch is retried one request at a time, which reports again
        sequences = sum(w.payload.num_sequences for w in works)
        with self._lock:
            self.execution_count += 1
            self.inference_count += sequences
            self.last_inference = int(time.time() * 1000)
            self._batches.setdefault(sequences, Duration()).add(compute_s)
            for work in works:
                self._durations["queue"].add(work.started_at - work.enqueued_at)
                self._durations["compute_infer"].add(compute_s)

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
