"""--loop-batch-max-ms: a CPU model's short batches run on the event loop itself, long ones on
the engine thread. The policy on synthetic batch times; the real batcher with the real engine
(where each batch ran is read from its runner's thread); the served app's metric."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import numpy as np
import pytest

import mha_engine
from service.pipeline.errors import InferenceError
from service.runtime.batcher import DynamicBatcher
from service.runtime.forward import hidden_states
from service.runtime.placement import FIRST_HOLD_S, MAX_HOLD_S, LoopPlacement
from service.runtime.work import Work
from tests.inprocess import asgi_client
from tests.service.test_batcher import payload

# -- the policy ------------------------------------------------------------------------------


def test_it_starts_on_the_thread_and_a_short_thread_batch_moves_it_to_the_loop() -> None:
    placement = LoopPlacement(0.002)
    assert not placement.on_loop
    placement.ran(0.003, 16, on_loop=False, now=1.0)  # long on the thread: stays there
    assert not placement.on_loop
    placement.ran(0.001, 16, on_loop=False, now=2.0)
    assert placement.on_loop
    placement.ran(0.0015, 16, on_loop=True, now=2.1)  # short on the loop: stays there
    assert placement.on_loop
    placement.ran(0.004, 16, on_loop=True, now=2.2)  # one slow batch: the average stays within
    assert placement.on_loop
    for i in range(3):
        placement.ran(0.004, 16, on_loop=True, now=2.3 + i / 10)  # slow on average: back
    assert not placement.on_loop


def test_a_long_loop_batch_holds_the_next_ones_on_the_thread_for_a_doubling_hold() -> None:
    placement = LoopPlacement(0.002)
    placement.ran(0.001, 16, on_loop=False, now=0.0)
    now, hold = 0.0, FIRST_HOLD_S
    for _ in range(10):
        placement.ran(0.02, 16, on_loop=True, now=now)
        assert not placement.on_loop
        placement.ran(0.001, 16, on_loop=False, now=now + hold - 0.01)  # within the hold
        assert not placement.on_loop
        placement.ran(0.001, 16, on_loop=False, now=now + hold)
        assert placement.on_loop
        now += hold
        hold = min(2 * hold, MAX_HOLD_S)
    assert hold == MAX_HOLD_S


def test_a_whole_hold_of_short_loop_batches_resets_the_hold() -> None:
    placement = LoopPlacement(0.002)
    placement.ran(0.001, 16, on_loop=False, now=0.0)
    placement.ran(0.02, 16, on_loop=True, now=0.0)  # hold 1 s, the next one 2 s
    placement.ran(0.001, 16, on_loop=False, now=1.0)
    placement.ran(0.001, 16, on_loop=True, now=3.5)  # short on the loop for longer than 2 s
    placement.ran(0.02, 16, on_loop=True, now=3.6)
    placement.ran(0.001, 16, on_loop=False, now=3.6 + FIRST_HOLD_S)
    assert placement.on_loop


def test_the_loop_takes_at_most_twice_the_tokens_of_the_largest_short_batch() -> None:
    placement = LoopPlacement(0.002)
    assert not placement.fits(1)  # on the thread
    placement.ran(0.001, 16, on_loop=False, now=0.0)
    assert placement.fits(32) and not placement.fits(33)
    placement.ran(0.003, 1000, on_loop=False, now=0.1)  # too slow: teaches nothing
    assert not placement.fits(33)
    placement.ran(0.0015, 32, on_loop=True, now=0.2)
    assert placement.fits(64) and not placement.fits(65)


def test_it_needs_a_positive_limit() -> None:
    with pytest.raises(ValueError, match="max_s must be > 0"):
        LoopPlacement(0)


# -- the batcher -----------------------------------------------------------------------------


class Recorder:
    """A runner that notes the thread each batch ran on (and can be made slow), then computes
    the batch with the service's own hidden-states runner."""

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.sizes: list[int] = []
        self.sleep_s = 0.0

    def __call__(self, model: Any, payloads: list[Any]) -> list[Any]:
        self.threads.append(threading.get_ident())
        self.sizes.append(len(payloads))
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return hidden_states(model, payloads)

    def where(self) -> list[str]:
        main = threading.main_thread().ident
        return ["loop" if t == main else "thread" for t in self.threads]


class LoopCount:
    def __init__(self) -> None:
        self.loop_batches = 0

    def queue_depth(self, sequences: int) -> None:
        pass

    def batch_started(self, works: list[Any]) -> None:
        pass

    def expired(self, work: Any) -> None:
        pass

    def batch_done(self, works: list[Any], compute_s: float, ok: bool) -> None:
        pass

    def batch_on_loop(self) -> None:
        self.loop_batches += 1


def _batcher(max_s: float, delay_s: float = 0.0) -> DynamicBatcher:
    return DynamicBatcher(
        mha_engine.build_demo_model(device="cpu"),
        max_batch_size=16,
        max_batch_tokens=4096,
        max_batch_delay_s=delay_s,
        max_queue=64,
        observer=LoopCount(),
        loop_batch_max_s=max_s,
    )


def _work(x: np.ndarray, runner: Recorder, loop: asyncio.AbstractEventLoop) -> Work:
    return Work(payload=payload(x), runner=runner, deadline=time.monotonic() + 30, loop=loop)


def _inputs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 4, 512)).astype(np.float32) for _ in range(n)]


async def _idle(batcher: DynamicBatcher) -> None:
    """Wait for the batch that answered to end: the thread answers a batch's requests first,
    then lets the placement learn from its time."""
    for _ in range(1000):
        if not batcher._busy:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the batcher stayed busy")


def _warm_input() -> np.ndarray:
    """One sequence of 16 tokens: once it ran within the limit, the loop takes batches of up to
    32 tokens."""
    return np.random.default_rng(9).standard_normal((1, 16, 512)).astype(np.float32)


def _serve(batcher: DynamicBatcher, coro_fn: Any) -> Any:
    async def main() -> Any:
        batcher.start()  # on the loop: the loop batches may run on
        return await coro_fn(asyncio.get_running_loop())

    try:
        return asyncio.run(main())
    finally:
        batcher.stop(timeout=10)


def _one_by_one(batcher: DynamicBatcher, recorder: Recorder, inputs: list[np.ndarray]) -> Any:
    async def run(loop: asyncio.AbstractEventLoop) -> list[Any]:
        out = []
        for x in inputs:
            work = _work(x, recorder, loop)
            batcher.submit(work)
            out.append(await work.future)
            await _idle(batcher)
        return out

    return _serve(batcher, run)


def test_short_batches_move_to_the_event_loop_with_the_same_numbers() -> None:
    inputs = _inputs(5)
    reference = _one_by_one(_batcher(0.0), Recorder(), inputs)  # placement off: the thread
    batcher, recorder = _batcher(0.5), Recorder()
    results = _one_by_one(batcher, recorder, inputs)
    assert recorder.where() == ["thread", "loop", "loop", "loop", "loop"]
    assert batcher.observer.loop_batches == 4  # type: ignore[union-attr]
    for got, want in zip(results, reference, strict=True):
        np.testing.assert_array_equal(got, want)  # where it ran changes no bit


def test_with_placement_off_every_batch_runs_on_the_thread() -> None:
    recorder = Recorder()
    _one_by_one(_batcher(0.0), recorder, _inputs(4))
    assert recorder.where() == ["thread"] * 4


def test_batches_over_the_limit_never_leave_the_thread() -> None:
    recorder = Recorder()
    _one_by_one(_batcher(1e-9), recorder, _inputs(4))
    assert recorder.where() == ["thread"] * 4


def test_a_long_loop_batch_sends_the_next_ones_back_to_the_thread() -> None:
    batcher, recorder = _batcher(0.05), Recorder()
    inputs = _inputs(5)

    async def run(loop: asyncio.AbstractEventLoop) -> None:
        for i, x in enumerate(inputs):
            recorder.sleep_s = 0.3 if i == 2 else 0.0
            work = _work(x, recorder, loop)
            batcher.submit(work)
            await work.future
            await _idle(batcher)

    _serve(batcher, run)
    # the third (on the loop) took 0.3 s: the average is over 50 ms, the rest stay on the
    # thread for the hold
    assert recorder.where() == ["thread", "loop", "loop", "thread", "thread"]


def test_a_batch_bigger_than_the_loop_knows_runs_on_the_thread() -> None:
    """Short batches of 4 tokens teach the loop 8 at most: 64 tokens go to the thread, and the
    short requests after it are the loop's again."""
    batcher, recorder = _batcher(0.5), Recorder()
    rng = np.random.default_rng(0)
    lengths = [4, 4, 64, 4]
    inputs = [rng.standard_normal((1, n, 512)).astype(np.float32) for n in lengths]

    async def run(loop: asyncio.AbstractEventLoop) -> None:
        for x in inputs:
            work = _work(x, recorder, loop)
            batcher.submit(work)
            await work.future
            await _idle(batcher)

    _serve(batcher, run)
    assert recorder.where() == ["thread", "loop", "thread", "loop"]


def test_exclusive_calls_and_work_submitted_off_the_loop_run_on_the_thread() -> None:
    batcher, recorder = _batcher(0.5), Recorder()
    inputs = _inputs(3)
    ran_on: list[int] = []

    def exclusive(model: Any) -> str:
        ran_on.append(threading.get_ident())
        return "done"

    async def run(loop: asyncio.AbstractEventLoop) -> None:
        for x in inputs[:2]:  # thread, then loop
            work = _work(x, recorder, loop)
            batcher.submit(work)
            await work.future
            await _idle(batcher)
        item = batcher.run_exclusive(exclusive, sequences=1, deadline=time.monotonic() + 30)
        assert await item.future == "done"
        work = _work(inputs[2], recorder, loop)  # as the --workers engine's reader threads do
        await asyncio.to_thread(batcher.submit, work)
        await work.future

    _serve(batcher, run)
    assert ran_on and ran_on[0] != threading.main_thread().ident
    assert recorder.where() == ["thread", "loop", "thread"]


def test_the_thread_leaves_a_batch_to_the_loop_turn_that_waits_for_it() -> None:
    """A loop turn waits out the delay; work from off the loop fills the batch and wakes the
    thread, which must not take the loop's batch."""
    batcher, recorder = _batcher(0.5, delay_s=0.2), Recorder()
    batcher.max_batch_size = 2
    first, a, b = _inputs(3)

    async def run(loop: asyncio.AbstractEventLoop) -> None:
        work = _work(first, recorder, loop)
        batcher.submit(work)
        await work.future
        await _idle(batcher)
        works = [_work(a, recorder, loop), _work(b, recorder, loop)]
        batcher.submit(works[0])  # a loop turn, on a 200 ms timer
        await asyncio.to_thread(batcher.submit, works[1])  # the batch is full: a wake-up
        await asyncio.gather(*(w.future for w in works))

    _serve(batcher, run)
    assert recorder.sizes == [1, 2]
    assert recorder.where() == ["thread", "loop"]


def test_flush_runs_a_batch_waiting_on_a_loop_timer_at_once() -> None:
    """Draining (flush): the loop turn waiting out a 30 s batch delay on a timer runs now, on
    the loop, and later work no longer waits for batch-mates."""
    batcher, recorder = _batcher(0.5, delay_s=30), Recorder()
    first, a, b = _inputs(3)

    async def run(loop: asyncio.AbstractEventLoop) -> float:
        work = _work(first, recorder, loop)
        work.wait_for_batch = False  # on the thread at once: the loop takes the next batches
        batcher.submit(work)
        await work.future
        await _idle(batcher)
        started = time.monotonic()
        waiting = _work(a, recorder, loop)
        batcher.submit(waiting)  # a loop turn on a 30 s timer
        await asyncio.sleep(0.05)
        assert not waiting.future.done()
        batcher.flush()
        await asyncio.wait_for(waiting.future, 5)
        await _idle(batcher)
        later = _work(b, recorder, loop)
        batcher.submit(later)
        await asyncio.wait_for(later.future, 5)
        return time.monotonic() - started

    assert _serve(batcher, run) < 5
    assert recorder.sizes == [1, 1, 1]
    assert recorder.where() == ["thread", "loop", "loop"]


def test_the_batch_delay_gathers_batch_mates_on_the_loop_too() -> None:
    batcher, recorder = _batcher(0.5, delay_s=0.2), Recorder()
    *later, _ = _inputs(4)
    first = _warm_input()  # 16 tokens: the loop may then take batches of up to 32

    async def run(loop: asyncio.AbstractEventLoop) -> None:
        work = _work(first, recorder, loop)  # on the thread (waits out the delay alone)
        batcher.submit(work)
        await work.future
        await _idle(batcher)
        works = []
        for x in later:  # 20 ms apart, within the 200 ms delay: one batch on the loop
            works.append(_work(x, recorder, loop))
            batcher.submit(works[-1])
            await asyncio.sleep(0.02)
        await asyncio.gather(*(w.future for w in works))

    _serve(batcher, run)
    assert recorder.sizes == [1, 3]
    assert recorder.where() == ["thread", "loop"]


def test_a_bad_request_in_a_loop_batch_fails_alone() -> None:
    batcher, recorder = _batcher(0.5, delay_s=0.2), Recorder()
    good = _inputs(3)
    # Width 7 never passes the service's validation; sent straight to the batcher it makes the
    # real engine raise inside the shared forward.
    bad = np.random.default_rng(1).standard_normal((1, 4, 7)).astype(np.float32)

    async def run(loop: asyncio.AbstractEventLoop) -> list[Any]:
        warm = _work(_warm_input(), recorder, loop)
        batcher.submit(warm)
        await warm.future  # the thread's: short, so the loop takes the next batch
        await _idle(batcher)
        works = [_work(x, recorder, loop) for x in (good[1], bad, good[2])]
        for work in works:
            batcher.submit(work)
        return await asyncio.gather(*(w.future for w in works), return_exceptions=True)

    results = _serve(batcher, run)
    assert isinstance(results[1], InferenceError)
    assert all(isinstance(r, np.ndarray) for r in (results[0], results[2]))
    assert recorder.where()[1:] == ["loop"] * 4  # the batch of 3, then each alone
    assert recorder.sizes[1:] == [3, 1, 1, 1]


def test_stop_finishes_what_waits_for_a_loop_turn() -> None:
    """Queued behind a loop turn's timer when the batcher stops: the thread runs it."""
    batcher, recorder = _batcher(0.5, delay_s=5.0), Recorder()
    inputs = _inputs(3)

    async def run(loop: asyncio.AbstractEventLoop) -> list[Any]:
        batcher.max_batch_delay_s = 0.0
        warm = _work(inputs[0], recorder, loop)
        batcher.submit(warm)
        await warm.future
        await _idle(batcher)
        batcher.max_batch_delay_s = 5.0  # the loop turn now waits on a 5 s timer
        works = [_work(x, recorder, loop) for x in inputs[1:]]
        for work in works:
            batcher.submit(work)
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await asyncio.to_thread(batcher.stop, 10)
        results = await asyncio.gather(*(w.future for w in works))
        assert time.monotonic() - started < 2.5
        return results

    results = _serve(batcher, run)
    assert len(results) == 2 and recorder.where() == ["thread", "thread"]


# -- served ----------------------------------------------------------------------------------


def _loop_batches(text: str) -> float:
    series = r'^mha_event_loop_batches_total\{model="mha",version="1"\} (\S+)$'
    match = re.search(series, text, re.M)
    assert match, "mha_event_loop_batches_total missing"
    return float(match.group(1))


@pytest.mark.parametrize("limit_ms", [200.0, 0.0])
def test_the_served_app_counts_its_loop_batches(limit_ms: float) -> None:
    """The setting reaches the model's batcher; /metrics shows how many batches ran on the loop
    (the demo encoder layer's batches take ~3 ms here: a limit that holds them all)."""
    x = np.random.default_rng(0).standard_normal((1, 2, 512)).astype(np.float32)
    body = {"inputs": [{"name": "input", "shape": [1, 2, 512], "datatype": "FP32",
                        "data": x.ravel().tolist()}]}  # fmt: skip

    async def run() -> float:
        async with asgi_client(loop_batch_max_ms=limit_ms, max_batch_delay_ms=0) as client:
            for _ in range(6):
                r = await client.post("/v2/models/mha/infer", json=body)
                assert r.status_code == 200, r.text
            return _loop_batches((await client.get("/metrics")).text)

    loop_batches = asyncio.run(run())
    assert (loop_batches >= 4) if limit_ms else (loop_batches == 0), loop_batches
