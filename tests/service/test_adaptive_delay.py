"""--batch-delay-policy adaptive: a batch waits for batch-mates only while recent requests overlap
and come at least one per delay. The estimate on synthetic arrivals, and the real batcher with the
real engine: a lone sequential client never waits; concurrent requests still form one batch."""

from __future__ import annotations

import asyncio
import time

import numpy as np

import mha_engine
from service.runtime.batcher import DynamicBatcher
from service.runtime.rates import MIN_OVERLAP, Arrivals
from tests.service.test_batcher import make_work


def test_nothing_known_yet_waits():
    assert Arrivals(0.002).worth_waiting()


def test_a_lone_closed_loop_client_stops_waiting():
    """Arrivals 1 ms apart (well within the delay) that never find other work: no wait."""
    arrivals = Arrivals(0.002)
    for i in range(10):
        arrivals.arrived(i * 0.001, busy=False)
    assert arrivals.worth_waiting()  # too few yet to overturn the assumption
    for i in range(10, 40):
        arrivals.arrived(i * 0.001, busy=False)
    assert arrivals.gap_s is not None and arrivals.gap_s <= 0.002
    assert arrivals.overlap < MIN_OVERLAP
    assert not arrivals.worth_waiting()


def test_overlapping_arrivals_within_the_delay_wait_and_sparse_ones_do_not():
    arrivals = Arrivals(0.002)
    for i in range(40):
        arrivals.arrived(i * 0.0005, busy=i % 2 == 0)  # 2,000/s, half of them overlapping
    assert arrivals.worth_waiting()
    sparse = Arrivals(0.002)
    for i in range(40):
        sparse.arrived(i * 0.01, busy=True)  # 100/s: no batch-mate expected within 2 ms
    assert not sparse.worth_waiting()
    for i in range(30):  # the rate rises: it waits again (after 26 arrivals, 13 ms here)
        sparse.arrived(0.4 + i * 0.0005, busy=True)
    assert sparse.worth_waiting()


def test_an_idle_spell_counts_as_a_few_delays():
    """A burst after a minute of silence: the long gap is capped, so the estimate still expects
    batch-mates after a handful of fast arrivals."""
    arrivals = Arrivals(0.002)
    for i in range(40):
        arrivals.arrived(i * 0.0005, busy=True)
    arrivals.arrived(60.0, busy=False)
    for i in range(1, 4):
        arrivals.arrived(60.0 + i * 0.0002, busy=True)
    assert arrivals.worth_waiting()


def _batcher(delay_s: float) -> DynamicBatcher:
    model = mha_engine.build_demo_model(device="cpu")
    return DynamicBatcher(
        model,
        max_batch_size=16,
        max_batch_tokens=4096,
        max_batch_delay_s=delay_s,
        max_queue=64,
        adaptive_delay=True,
    )


def test_a_lone_sequential_client_is_answered_without_the_delay():
    """With a 40 ms delay: the first requests wait it (batching is assumed to pay until the
    arrivals show otherwise); once ~36 requests have never overlapped, each is answered in far
    less than the delay."""
    delay = 0.04
    batcher = _batcher(delay)
    x = np.random.default_rng(0).standard_normal((1, 4, 512)).astype(np.float32)

    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        times = []
        for _ in range(45):
            work = make_work(x, loop)
            start = time.monotonic()
            batcher.submit(work)
            await work.future
            times.append(time.monotonic() - start)
        return times

    batcher.start()
    try:
        times = asyncio.run(run())
    finally:
        batcher.stop(timeout=10)
    assert times[0] >= delay  # nothing known: it waited
    assert max(times[-5:]) < delay / 2, times


def test_concurrent_requests_still_form_one_batch():
    """A burst of overlapping requests at a rate within the delay: the head waits, one batch."""
    batcher = _batcher(0.3)
    sizes: list[int] = []

    class Observer:
        def queue_depth(self, sequences):
            pass

        def expired(self, work):
            pass

        def batch_started(self, works):
            sizes.append(len(works))

        def batch_done(self, works, compute_s, ok):
            pass

    batcher.observer = Observer()
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((1, 3, 512)).astype(np.float32) for _ in range(8)]

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(3):
            works = [make_work(x, loop) for x in inputs]
            for work in works:
                batcher.submit(work)
            await asyncio.gather(*(w.future for w in works))

    batcher.start()
    try:
        asyncio.run(run())
    finally:
        batcher.stop(timeout=10)
    assert sizes[-1] == 8, sizes  # the last burst, with overlap and rate known: one batch
