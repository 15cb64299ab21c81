"""The batcher in-process with the real engine: a forward that raises fails only its culprit."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

import mha_engine
from service.oip.inputs import Payload
from service.pipeline.errors import InferenceError
from service.runtime.batcher import DynamicBatcher
from service.runtime.forward import hidden_states
from service.runtime.work import Work


def payload(x: np.ndarray) -> Payload:
    """(B, T, E) hidden states as a packed payload."""
    return Payload(x.reshape(-1, x.shape[-1]), [x.shape[1]] * x.shape[0])


def make_work(x: np.ndarray, loop: asyncio.AbstractEventLoop) -> Work:
    deadline = time.monotonic() + 30
    return Work(payload=payload(x), runner=hidden_states, deadline=deadline, loop=loop)


def test_raising_forward_fails_only_its_request_and_the_batcher_keeps_serving(caplog) -> None:
    model = mha_engine.build_demo_model(device="cpu")
    reference = mha_engine.demo_module().eval()
    batcher = DynamicBatcher(
        model, max_batch_size=16, max_batch_tokens=4096, max_batch_delay_s=0.2, max_queue=64
    )
    rng = np.random.default_rng(0)
    good = [rng.standard_normal((1, 5, 512)).astype(np.float32) for _ in range(3)]
    # Width 7 never passes the service's validation; sent straight to the batcher it makes the
    # real engine raise inside the shared forward, like any fault at forward time would.
    bad = rng.standard_normal((1, 5, 7)).astype(np.float32)

    async def run() -> list[object]:
        loop = asyncio.get_running_loop()
        works = [make_work(x, loop) for x in (good[0], bad, *good[1:])]
        for work in works:
            batcher.submit(work)  # all queued within the 200 ms window: one batch
        results = await asyncio.gather(*(w.future for w in works), return_exceptions=True)
        after = make_work(good[0], loop)
        batcher.submit(after)
        return [*results, await after.future]

    batcher.start()
    try:
        results = asyncio.run(run())
    finally:
        batcher.stop(timeout=10)
    assert isinstance(results[1], InferenceError)
    assert "forward failed for a batch of 4 requests" in caplog.text  # it really shared a batch
    for x, got in zip((good[0], *good[1:], good[0]), results[:1] + results[2:], strict=True):
        want = reference(torch.from_numpy(x)).detach()[0]
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=1.3e-6)  # (T, E)


def test_constructor_arguments_are_validated() -> None:
    model = mha_engine.build_demo_model(device="cpu")
    with pytest.raises(ValueError, match="max_batch_size"):
        DynamicBatcher(
            model, max_batch_size=0, max_batch_tokens=1, max_batch_delay_s=0, max_queue=1
        )
    with pytest.raises(ValueError, match="max_batch_delay_s"):
        DynamicBatcher(
            model, max_batch_size=1, max_batch_tokens=1, max_batch_delay_s=-1, max_queue=1
        )


def test_work_that_does_not_wait_for_batch_mates_starts_at_once() -> None:
    """The warm-up's work (wait_for_batch=False) skips the batch delay; client work waits it."""
    model = mha_engine.build_demo_model(device="cpu")
    batcher = DynamicBatcher(
        model, max_batch_size=16, max_batch_tokens=4096, max_batch_delay_s=0.5, max_queue=64
    )
    x = np.random.default_rng(0).standard_normal((1, 4, 512)).astype(np.float32)

    async def queued_for(wait_for_batch: bool) -> float:
        work = make_work(x, asyncio.get_running_loop())
        work.wait_for_batch = wait_for_batch
        batcher.submit(work)
        await work.future
        return work.queue_s

    batcher.start()
    try:
        at_once = asyncio.run(queued_for(False))
        waited = asyncio.run(queued_for(True))
    finally:
        batcher.stop(timeout=10)
    assert waited >= 0.5 > 0.25 > at_once


def test_flush_ends_the_batch_delay_on_the_engine_thread() -> None:
    """Draining (flush, here from another thread as the --workers engine process calls it):
    work waiting out a 30 s batch delay runs now, in one batch, and later work does not wait."""
    model = mha_engine.build_demo_model(device="cpu")
    batcher = DynamicBatcher(
        model, max_batch_size=16, max_batch_tokens=4096, max_batch_delay_s=30, max_queue=64
    )
    x = np.random.default_rng(3).standard_normal((1, 4, 512)).astype(np.float32)

    async def run() -> float:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        works = [make_work(x, loop) for _ in range(2)]
        for work in works:
            batcher.submit(work)
        await asyncio.sleep(0.05)
        assert not any(work.future.done() for work in works)
        await asyncio.to_thread(batcher.flush)
        await asyncio.wait_for(asyncio.gather(*(w.future for w in works)), 5)
        later = make_work(x, loop)
        batcher.submit(later)
        await asyncio.wait_for(later.future, 5)
        assert works[0].started_at == works[1].started_at  # one batch
        return time.monotonic() - started

    batcher.start()
    try:
        assert asyncio.run(run()) < 5
    finally:
        batcher.stop(timeout=10)
