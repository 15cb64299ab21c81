"""Interleaved timing of cases (no project imports, so a benchmark run as a script against another
tree's mha_engine can load it from beside itself: benchmarks.host_cost --root)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def _calibrate(fn: Callable[[], object], min_time: float) -> int:
    """Warm up and return how many calls fill one timed block of about `min_time` seconds."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_time:
        fn()
        calls += 1
    return max(1, calls)


def time_cases(
    cases: dict[str, Callable[[], object]],
    repeats: int,
    min_time: float,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each case; repeats are interleaved across cases so a burst of
    load from other processes hits every implementation alike and ratios stay meaningful.
    `clock`: wall time by default; `time.thread_time` counts the calling thread's CPU only
    (steadier on a shared host for single-threaded calls). `sync` ends every timed block
    (torch.cuda.synchronize: a block of asynchronous launches is timed to its end)."""
    blocks = {name: _calibrate(fn, min_time) for name, fn in cases.items()}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = clock()
            for _ in range(blocks[name]):
                fn()
            if sync is not None:
                sync()
            samples[name].append((clock() - t0) / blocks[name])
    return {name: statistics.median(values) for name, values in samples.items()}
