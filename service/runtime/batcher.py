"""Dynamic batcher: requests queue on the event loop; one engine thread runs a plain loop of
collect-a-batch, forward, hand results back. The event loop never runs a forward.

A batch closes when it holds `max_batch_size` sequences or `max_batch_tokens` tokens, or
`max_batch_delay_s` after its first request was queued. Requests stay whole and keep FIFO order.
With `adaptive_delay` a batch waits only while batch-mates are likely (service.runtime.rates);
otherwise it starts with what is queued.

With `overlap` (--cuda-overlap, CUDA models) a batch is launched on the engine thread and
finished on a completer thread (service.runtime.completer), so the next batch is staged and
queued on the GPU while the previous one computes and comes down (unverified on a GPU).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from mha_engine import ServedModel
from service.pipeline.errors import (
    DeadlineExceeded,
    InferenceError,
    NotReady,
    Overloaded,
    ServiceError,
)
from service.runtime.completer import Completer
from service.runtime.device_copies import DeviceCopies
from service.runtime.forward import Finish, launch_batch
from service.runtime.rates import Arrivals, DrainRate
from service.runtime.statistics import BatchObserver
from service.runtime.work import Exclusive, QueueItem, Work, resolve_all

log = logging.getLogger(__name__)

SHUTTING_DOWN = "server is shutting down; retry on another replica"


class DynamicBatcher:
    """Bounded queue + one engine worker thread running `model.forward_packed` on batches."""

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
        self.observer = observer
        self.threads = threads  # intra-op threads of the engine thread; None: torch's default
        self.overlap = overlap  # finish batches on a completer thread (see the module's doc)
        self._completer: Completer | None = None
        self._arrivals = Arrivals(max_batch_delay_s) if adaptive_delay else None
        self._running = 0  # batches started and not yet reported done
        self._copies: DeviceCopies | None = None
        self._queue: collections.deque[QueueItem] = collections.deque()
        self._queued_sequences = 0
        self._queued_tokens = 0
        self._reserved = 0  # slots held by requests still being prepared (e.g. tokenizing)
        self._closed = False  # the drain grace ended: nothing more is queued
        self._drain = DrainRate()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)

    # -- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

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
            wait = self._drain.wait_s(self._queued_tokens)
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
                self._arrivals.arrived(time.monotonic(), not first or self._running > 0)
            self._queue.append(work)
            self._queued_sequences += size
            self._queued_tokens += work.tokens
            self._report_depth()
            # Wake the engine thread only when it has something new to decide: work after an
            # empty queue, or a batch now full (it waits out the delay otherwise). No wake-up
            # (and recount of the queue) per request while a batch fills.
            if first or self._full() or isinstance(work, Exclusive):
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
        if self.overlap:
            self._completer = Completer(self._finish)
            if self.model.device.type == "cuda":
                self._copies = DeviceCopies(self.model.device)
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                if isinstance(batch, Exclusive):
                    self._run_exclusive(batch)
                elif batch:
                    self._execute(batch)
        finally:
            if self._completer is not None:
                self._completer.close()  # every launched batch is answered before the end

    def _fits(self, seqs: int, tokens: int, work: QueueItem) -> bool:
        # An Exclusive never joins a batch: it closes the batch before it.
        return not isinstance(work, Exclusive) and (
            seqs + work.sequences <= self.max_batch_size
            and tokens + work.tokens <= self.max_batch_tokens
        )

    def _next_batch(self) -> list[Work] | Exclusive | None:
        """Wait for work, let the batch fill until full or the delay is up, then take it."""
        with self._cond:
            while not self._queue:
                if self._stopping:
                    return None
                self._cond.wait()
            if isinstance(self._queue[0], Exclusive):
                item = self._queue.popleft()
                self._queued_sequences -= item.sequences
                self._report_depth()
                item.started_at = time.monotonic()
                return item
            head = self._queue[0]
            wait = head.wait_for_batch and (
                self._arrivals is None or self._arrivals.worth_waiting()
            )
            flush_at = head.enqueued_at + (self.max_batch_delay_s if wait else 0.0)
            while not self._stopping:
                seqs = tokens = 0
                full = False
                for work in self._queue:
                    if not self._fits(seqs, tokens, work):
                        full = True
                        break
                    seqs += work.sequences
                    tokens += work.tokens
                remaining = flush_at - time.monotonic()
                if full or seqs >= self.max_batch_size or remaining <= 0:
                    break
                self._cond.wait(remaining)

            batch: list[Work] = []
            seqs = tokens = 0
            now = time.monotonic()
            while self._queue and self._fits(seqs, tokens, self._queue[0]):
                work = self._queue.popleft()
                self._queued_sequences -= work.sequences
                self._queued_tokens -= work.tokens
                if now > work.deadline:
                    self._expire(work)
                    continue
                work.started_at = now
                seqs += work.sequences
                tokens += work.tokens
                batch.append(work)
            self._report_depth()
            return batch

    def _run_exclusive(self, item: Exclusive) -> None:
        if item.started_at > item.deadline:
            waited = item.started_at - item.enqueued_at
            item.resolve(error=DeadlineExceeded(f"request timed out after {waited:.3f} s queued"))
            return
        try:
            item.resolve(item.fn())
        except ServiceError as exc:
            item.resolve(error=exc)
        except Exception:
            log.exception("exclusive engine call failed")
            item.resolve(error=InferenceError("inference failed for this request"))

    def _expire(self, work: Work) -> None:
        waited = time.monotonic() - work.enqueued_at
        work.resolve(error=DeadlineExceeded(f"request timed out after {waited:.3f} s in the queue"))
        if self.observer is not None:
            self.observer.expired(work)

    def _execute(self, works: list[Work]) -> None:
        with self._cond:
            self._running += 1
        if self.observer is not None:
            self.observer.batch_started(works)
        started = time.perf_counter()
        completer = self._completer
        if completer is not None:
            completer.reserve()
        try:
            finish = launch_batch(self.model, works, self._copies)
            results = finish() if completer is None else None
        except Exception:
            if completer is not None:
                completer.unreserve()
            log.exception("forward failed for a batch of %d requests", len(works))
            self._report_batch(works, time.perf_counter() - started, ok=False)
            if len(works) > 1:
                # Isolate the culprit: a bad request must not fail its batch-mates.
                for work in works:
                    self._execute([work])
            else:
                works[0].resolve(error=InferenceError("inference failed for this request"))
            return
        if completer is not None:
            completer.put(works, finish, started)
        else:
            self._complete(works, results, started)

    def _finish(self, works: list[Work], finish: Finish, started: float) -> None:
        """On the completer thread: wait for a launched batch and answer it. A failure here
        is the device's (a bad input fails at launch, where its batch-mates are retried
        alone), so the batch's requests each get the error."""
        try:
            results = finish()
        except Exception:
            log.exception("a batch of %d requests failed on the device", len(works))
            self._report_batch(works, time.perf_counter() - started, ok=False)
            for work in works:
                work.resolve(error=InferenceError("inference failed for this request"))
            return
        self._complete(works, results, started)

    def _complete(self, works: list[Work], results: list[Any], started: float) -> None:
        compute_s = time.perf_counter() - started
        self._report_batch(works, compute_s, ok=True)
        self._drain.batch_done(works, time.monotonic())
        outcomes = []
        for work, result in zip(works, results, strict=True):
            work.infer_s = compute_s
            error = result if isinstance(result, ServiceError) else None
            outcomes.append((work, None if error is not None else result, error))
        resolve_all(outcomes)

    def _report_batch(self, works: list[Work], compute_s: float, ok: bool) -> None:
        with self._cond:
            self._running -= 1
        if self.observer is not None:
            self.observer.batch_done(works, compute_s, ok)
