"""Dynamic batcher: requests queue on the event loop; one engine thread runs a plain loop of
collect-a-batch, forward, hand results back (or, for short CPU batches, the event loop runs it:
below).

A batch closes when it holds `max_batch_size` sequences or `max_batch_tokens` tokens, or
`max_batch_delay_s` after its first request was queued. Requests stay whole and keep FIFO order.
With `adaptive_delay` a batch waits only while batch-mates are likely (service.runtime.rates);
otherwise it starts with what is queued.

With `loop_batch_max_s` (--loop-batch-max-ms, CPU models) a batch runs on the event loop
itself while batches are that short (service.runtime.placement): no GIL handoffs between the
loop and the engine thread. Requests submitted off the loop (the --workers engine's readers)
and exclusive calls always run on the engine thread; only one batch runs at a time either way.

With `overlap` (--cuda-overlap, CUDA models) a batch is launched on the engine thread and
finished on a completer thread (service.runtime.completer), so the next batch is staged and
queued on the GPU while the previous one computes and comes down (unverified on a GPU).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from mha_engine import ServedModel
from service.pipeline.errors import NotReady, Overloaded
from service.runtime.loop_turns import LoopTurns
from service.runtime.rates import Arrivals
from service.runtime.runner import BatchRunner
from service.runtime.statistics import BatchObserver
from service.runtime.work import Exclusive, QueueItem, Work

SHUTTING_DOWN = "server is shutting down; retry on another replica"


class DynamicBatcher(LoopTurns):
    """Bounded queue + one engine worker thread running `model.forward_packed` on batches
    (short CPU batches: on the event loop, service.runtime.loop_turns)."""

    def __init__(
        self,
        model: ServedModel,
        *,
        max_batch_size: int,
        max_batch_tokens: int,
        max_batch_delay_s: float,
        max_queue: int,
        observer: BatchObserver | None = None,
        threads: int | None = None,
        overlap: bool = False,
        adaptive_delay: bool = False,
        loop_batch_max_s: float = 0.0,
    ) -> None:
        if max_batch_size < 1 or max_batch_tokens < 1 or max_queue < 1:
            raise ValueError(
                "max_batch_size, max_batch_tokens and max_queue must be >= 1, got "
                f"{max_batch_size}, {max_batch_tokens}, {max_queue}"
            )
        if max_batch_delay_s < 0:
            raise ValueError(f"max_batch_delay_s must be >= 0, got {max_batch_delay_s}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_delay_s = max_batch_delay_s
        self.max_queue = max_queue
        self.threads = threads  # intra-op threads of the engine thread; None: torch's default
        self.overlap = overlap  # finish batches on a completer thread (see the module's doc)
        self._arrivals = Arrivals(max_batch_delay_s) if adaptive_delay else None
        self._queue: collections.deque[QueueItem] = collections.deque()
        self._queued_sequences = 0
        self._queued_tokens = 0
        self._reserved = 0  # slots held by requests still being prepared (e.g. tokenizing)
        self._closed = False  # the drain grace ended: nothing more is queued
        self._flushing = False  # draining: batches no longer wait for batch-mates
        self._runner = BatchRunner(model, observer, overlap)
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self._init_turns(loop_batch_max_s)
        self._busy = False  # a batch or exclusive call is running (thread or loop)

    # -- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; called on the event loop that may run short batches."""
        self._bind_loop()
        self._thread.start()

    @property
    def observer(self) -> BatchObserver | None:
        return self._runner.observer

    @observer.setter
    def observer(self, observer: BatchObserver | None) -> None:
        self._runner.observer = observer

    @property
    def queued_sequences(self) -> int:
        return self._queued_sequences

    def check_open(self) -> None:
        """503 + Retry-After once the drain grace has ended (nothing more is queued)."""
        if self._closed or self._stopping:
            raise NotReady(SHUTTING_DOWN, headers={"Retry-After": "1"})

    def _check_room(self, size: int) -> None:
        self.check_open()
        waiting = self._queued_sequences + self._reserved
        if waiting + size > self.max_queue:
            raise Overloaded(
                f"queue full ({waiting} of {self.max_queue} sequences waiting); retry later",
                headers={"Retry-After": "1"},
            )

    @contextlib.asynccontextmanager
    async def reserve(self, sequences: int) -> AsyncIterator[None]:
        """Hold `sequences` queue slots while a request prepares its work off the engine (e.g.
        tokenizing), so that preparation counts against --max-queue (429 when full)."""
        self.hold(sequences)
        try:
            yield
        finally:
            self.release(sequences)

    def hold(self, sequences: int) -> None:
        """Take `sequences` queue slots for work being prepared (429 when full); release()."""
        with self._cond:
            self._check_room(sequences)
            self._reserved += sequences
            self._report_depth()

    def release(self, sequences: int) -> None:
        with self._cond:
            self._reserved -= sequences
            self._report_depth()

    def submit(self, work: QueueItem) -> None:
        """Queue `work`, or raise Overloaded (429) when the queue is full or would outlast its
        deadline (queued tokens ÷ recent engine tokens/s): shed now rather than time out later.
        After the drain grace (`close`) it raises NotReady (503)."""
        size = work.sequences
        with self._cond:
            self._check_room(size)
            wait = self._runner.drain.wait_s(self._queued_tokens)
            if wait:
                budget = work.deadline - time.monotonic()
                if wait > budget:
                    raise Overloaded(
                        f"queue holds ~{wait:.2f} s of work, more than this request's "
                        f"{budget:.2f} s deadline; retry later",
                        headers={"Retry-After": str(max(1, math.ceil(wait - budget)))},
                    )
            first = not self._queue
            if self._arrivals is not None and isinstance(work, Work) and work.wait_for_batch:
                self._arrivals.arrived(time.monotonic(), not first or self._runner.running > 0)
            self._queue.append(work)
            self._queued_sequences += size
            self._queued_tokens += work.tokens
            self._report_depth()
            if self._wants_loop(work):
                self._schedule_turn()
            # Wake the engine thread only when it has something new to decide: work after an
            # empty queue, or a batch now full (it waits out the delay otherwise). No wake-up
            # (and recount of the queue) per request while a batch fills.
            elif first or self._full() or isinstance(work, Exclusive):
                self._cond.notify()

    def _full(self) -> bool:
        return (
            self._queued_sequences >= self.max_batch_size
            or self._queued_tokens >= self.max_batch_tokens
        )

    def run_exclusive(
        self, fn: Callable[..., Any], args: tuple = (), *, sequences: int, deadline: float
    ) -> Exclusive:
        """Queue `fn(model, *args)` to run on the engine thread alone, in FIFO turn with batches;
        await `.future` for its result. Counts `sequences` against --max-queue (429 when full).
        `fn` is a module-level function (worker front-ends send it by name)."""
        item = Exclusive(
            fn=functools.partial(fn, self.model, *args),
            slots=max(1, sequences),
            deadline=deadline,
            loop=asyncio.get_running_loop(),
        )
        self.submit(item)
        return item

    def cancel(self, work: QueueItem) -> bool:
        """Drop `work` if it is still queued (never run); False if it has already started."""
        with self._cond:
            if work.started_at is not None:
                return False
            try:
                self._queue.remove(work)
            except ValueError:
                return False
            self._queued_sequences -= work.sequences
            self._queued_tokens -= work.tokens
            self._report_depth()
            return True

    async def withdraw(self, items: list[QueueItem]) -> bool:
        """Take `items` out of the queue; True if any was still queued (never run)."""
        return any([self.cancel(item) for item in items])

    def flush(self) -> None:
        """Draining began: no new request will join a batch, so what is queued stops waiting out
        the batch delay and runs now, inside the drain grace (a long delay would otherwise hold
        it until the grace ends and it is shed)."""
        with self._cond:
            self._flushing = True
            self._flush_turn()
            self._cond.notify()

    def close(self) -> int:
        """End of the drain grace: answer every request not yet started 503 (Retry-After), never
        computing it, and queue nothing more. The batch already running finishes."""
        with self._cond:
            self._closed = True
            shed = list(self._queue)
            self._queue.clear()
            self._queued_sequences = self._queued_tokens = 0
            self._report_depth()
        for item in shed:
            item.resolve(error=NotReady(SHUTTING_DOWN, headers={"Retry-After": "1"}))
        return len(shed)

    def stop(self, timeout: float | None = None) -> None:
        """Finish everything queued, then stop the worker thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- engine-thread side ----------------------------------------------------------------
    def _report_depth(self) -> None:
        if self.observer is not None:
            self.observer.queue_depth(self._queued_sequences + self._reserved)

    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # this thread starts the engine's parallel work
        self._runner.open()
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                started = time.perf_counter()
                try:
                    if isinstance(batch, Exclusive):
                        self._runner.run_exclusive(batch)
                    elif batch:
                        self._runner.run(batch)
                finally:
                    self._done(batch, time.perf_counter() - started, on_loop=False)
        finally:
            self._runner.close()  # every launched batch is answered before the end

    def _fits(self, seqs: int, tokens: int, work: QueueItem) -> bool:
        # An Exclusive never joins a batch: it closes the batch before it.
        return not isinstance(work, Exclusive) and (
            seqs + work.sequences <= self.max_batch_size
            and tokens + work.tokens <= self.max_batch_tokens
        )

    def _thread_may_take(self) -> bool:
        """The engine thread's turn: nothing running, and no loop turn scheduled for the queue
        (a loop turn leaves exclusive calls and, while stopping, everything to the thread)."""
        if self._busy or not self._queue:
            return False
        if self._stopping or isinstance(self._queue[0], Exclusive):
            return True
        return self._turn is None and not self._handoff

    def _next_batch(self) -> list[Work] | Exclusive | None:
        """Wait for work, let the batch fill until full or the delay is up, then take it."""
        with self._cond:
            while True:
                if self._stopping and not self._queue and not self._busy:
                    return None
                if not self._thread_may_take():
                    self._cond.wait()
                    continue
                if isinstance(self._queue[0], Exclusive):
                    item = self._queue.popleft()
                    self._queued_sequences -= item.sequences
                    self._report_depth()
                    item.started_at = time.monotonic()
                    self._busy = True
                    return item
                remaining, _ = self._fill()
                if remaining <= 0 or self._stopping:
                    return self._take()
                self._cond.wait(remaining)

    def _fill(self) -> tuple[float, int]:
        """(seconds the batch at the head of the queue should still wait for batch-mates, its
        tokens now); <= 0 s: take it now (full, or the delay is up, or waiting does not pay)."""
        seqs = tokens = 0
        for work in self._queue:
            if not self._fits(seqs, tokens, work):
                return 0.0, tokens
            seqs += work.sequences
            tokens += work.tokens
        head = self._queue[0]
        if seqs >= self.max_batch_size or not head.wait_for_batch or self._flushing:
            return 0.0, tokens
        if self._arrivals is not None and not self._arrivals.worth_waiting():
            return 0.0, tokens
        return head.enqueued_at + self.max_batch_delay_s - time.monotonic(), tokens

    def _take(self) -> list[Work]:
        """Under the lock: take the batch at the head of the queue (the expired answered)."""
        batch: list[Work] = []
        seqs = tokens = 0
        now = time.monotonic()
        while self._queue and self._fits(seqs, tokens, self._queue[0]):
            work = self._queue.popleft()
            self._queued_sequences -= work.sequences
            self._queued_tokens -= work.tokens
            if now > work.deadline:
                self._runner.expire(work)
                continue
            work.started_at = now
            seqs += work.sequences
            tokens += work.tokens
            batch.append(work)
        self._report_depth()
        self._busy = True
        return batch

    def _done(self, batch: list[Work] | Exclusive, seconds: float, on_loop: bool) -> None:
        """A batch (or exclusive call) ended: let the placement learn from it, then pass the
        queue on: to a loop turn where batches run on the loop, else to the thread (woken only
        when it has something to do: each wake-up is a GIL handoff)."""
        with self._cond:
            self._busy = False
            placement = self._placement
            if placement is None:
                return
            if isinstance(batch, list) and batch:
                tokens = sum(work.tokens for work in batch)
                placement.ran(seconds, tokens, on_loop, time.monotonic())
                if on_loop and self.observer is not None:
                    self.observer.batch_on_loop()
            if not on_loop:  # the thread goes on by itself, unless a loop turn asked for the queue
                self._hand_back()
            elif self._turn_may_follow():
                self._schedule_turn()
            elif self._queue or self._stopping:
                self._cond.notify()
