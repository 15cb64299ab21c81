"""The event loop's side of the dynamic batcher: a CPU model's short batches run in loop
callbacks ("turns", --loop-batch-max-ms) instead of on the engine thread; when they do is
service.runtime.placement's call. The queue, its lock and the busy flag are the batcher's, so
one batch runs at a time wherever it runs, and every path leaves the queue to someone: a turn
(now, or on a timer for the batch delay), a wake-up of the thread, or the thread's own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from service.runtime.placement import LoopPlacement
from service.runtime.work import Exclusive, QueueItem

if TYPE_CHECKING:
    import collections
    import threading

    from service.runtime.runner import BatchRunner
    from service.runtime.work import Work


class LoopTurns:
    """Loop turns, mixed into DynamicBatcher, which provides the queue and its lock, the busy
    and stopping flags, and `_fill`, `_take`, `_full`, `_done` and the runner."""

    if TYPE_CHECKING:  # the batcher's
        _cond: threading.Condition
        _queue: collections.deque[QueueItem]
        _busy: bool
        _stopping: bool
        _runner: BatchRunner

        def _fill(self) -> tuple[float, int]: ...
        def _take(self) -> list[Work]: ...
        def _full(self) -> bool: ...
        def _done(self, batch: list[Work] | Exclusive, seconds: float, on_loop: bool) -> None: ...

    def _init_turns(self, loop_batch_max_s: float) -> None:
        self._placement = LoopPlacement(loop_batch_max_s) if loop_batch_max_s > 0 else None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop batches may run on
        self._turn: asyncio.Handle | None = None  # a loop turn is scheduled: the thread waits
        self._turn_now = False  # ... and it is not a timer (the batch is ready)
        self._handoff = False  # a loop turn found the thread busy: it hands the queue over

    def _bind_loop(self) -> None:
        """At start, on the event loop that may run short batches."""
        if self._placement is not None:
            self._loop = asyncio.events._get_running_loop()

    def _hand_back(self) -> None:
        """Under the lock, on the thread after its batch: the queue to a loop turn, if one found
        the thread busy and the next batch is the loop's."""
        if not self._handoff:
            return
        self._handoff = False
        if self._turn_may_follow():
            with contextlib.suppress(RuntimeError):  # a closed loop: the thread goes on
                self._turn = self._loop.call_soon_threadsafe(self._loop_turn)  # type: ignore[union-attr]
                self._turn_now = True

    def _wants_loop(self, work: QueueItem) -> bool:
        """Under the lock, at submit: run this work's batch on the loop?"""
        return (
            self._placement is not None
            and self._placement.on_loop
            and not isinstance(work, Exclusive)
            and not self._stopping
            and self._loop is not None
            and asyncio.events._get_running_loop() is self._loop
        )

    def _turn_may_follow(self) -> bool:
        """Under the lock, on the loop: the next batch is the loop's too."""
        placement = self._placement
        return (
            placement is not None
            and placement.on_loop
            and not self._stopping
            and bool(self._queue)
            and not isinstance(self._queue[0], Exclusive)
        )

    def _schedule_turn(self) -> None:
        """Under the lock, on the loop: a loop turn soon, unless one is due at once already."""
        if self._turn is not None and (self._turn_now or not self._full()):
            return  # due already, or a timer stands for a batch still filling
        self._turn_at_once()

    def _flush_turn(self) -> None:
        """Under the lock, draining: a turn waiting out the batch delay on a timer runs now."""
        timer = self._turn is not None and not self._turn_now
        if timer and asyncio.events._get_running_loop() is self._loop:
            self._turn_at_once()

    def _turn_at_once(self) -> None:
        """Under the lock, on the loop: a loop turn now, in place of a pending timer."""
        if self._turn is not None:
            self._turn.cancel()
        self._turn = self._loop.call_soon(self._loop_turn)  # type: ignore[union-attr]
        self._turn_now = True

    def _loop_turn(self) -> None:
        """On the event loop: run the batch at the head of the queue here, or wait out its
        delay with a timer; the thread gets the queue when it is busy or stopping, and exclusive
        calls."""
        with self._cond:
            self._turn = None
            placement = self._placement
            assert placement is not None
            if self._busy:  # the thread's batch: it hands the queue back when done
                self._handoff = True
                return
            if not self._queue:
                return
            if self._stopping or not placement.on_loop or isinstance(self._queue[0], Exclusive):
                self._cond.notify()
                return
            remaining, tokens = self._fill()
            if remaining > 0:
                self._turn = self._loop.call_later(remaining, self._loop_turn)  # type: ignore[union-attr]
                self._turn_now = False
                return
            if not placement.fits(tokens):  # bigger than the loop knows to be short
                self._cond.notify()
                return
            batch = self._take()
        started = time.perf_counter()
        try:
            if batch:
                self._runner.run(batch)
        finally:
            self._done(batch, time.perf_counter() - started, on_loop=True)
