"""The engine's second thread with --cuda-overlap: it waits for each launched batch, in launch
order, while the engine thread stages and launches the next one; at most `depth` batches are
launched and not yet finished."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Completer:
    """Hands each launched batch to `finish(*item)` on its own thread, in order."""

    def __init__(self, finish: Callable[..., None], depth: int = 2) -> None:
        self._finish = finish
        self._slots = threading.Semaphore(depth)
        self._items: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-completer", daemon=True)
        self._thread.start()

    def reserve(self) -> None:
        """Before a launch: wait while `depth` batches are in flight."""
        self._slots.acquire()

    def unreserve(self) -> None:
        """The launch after reserve() failed: nothing will come to finish."""
        self._slots.release()

    def put(self, *item: Any) -> None:
        """A launched batch (after reserve()): finished on the completer thread."""
        self._items.put(item)

    def close(self) -> None:
        """Finish every batch put so far, then end the thread."""
        self._items.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._items.get()) is not None:
            try:
                self._finish(*item)
            except Exception:  # `finish` answers its own errors; this thread must not die
                log.exception("finishing a batch failed")
            finally:
                self._slots.release()
