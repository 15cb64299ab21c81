"""Running one batch and answering its requests: the forward (finished here, or with
--cuda-overlap on a completer thread), a failed batch's requests retried one at a time so that
a bad request fails alone, the answers handed to the event loop in one call, the observers told.
The batcher (service.runtime.batcher) decides what runs when, and where."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from mha_engine import ServedModel
from service.pipeline.errors import DeadlineExceeded, InferenceError, ServiceError
from service.runtime.completer import Completer
from service.runtime.device_copies import DeviceCopies
from service.runtime.forward import Finish, launch_batch
from service.runtime.rates import DrainRate
from service.runtime.statistics import BatchObserver
from service.runtime.work import Exclusive, Work, resolve_all

log = logging.getLogger(__name__)


class BatchRunner:
    """Runs a model's batches and exclusive calls, one caller at a time (the batcher sees to
    it); `running` and `drain` are what the batcher's admission reads of it."""

    def __init__(self, model: ServedModel, observer: BatchObserver | None, overlap: bool) -> None:
        self.model = model
        self.observer = observer
        self.overlap = overlap
        self.drain = DrainRate()
        self.running = 0  # batches started and not yet reported done
        self._lock = threading.Lock()
        self._completer: Completer | None = None
        self._copies: DeviceCopies | None = None

    def open(self) -> None:
        """On the engine thread, before its first batch."""
        if self.overlap:
            self._completer = Completer(self._finish)
            if self.model.device.type == "cuda":
                self._copies = DeviceCopies(self.model.device)

    def close(self) -> None:
        """Every launched batch answered."""
        if self._completer is not None:
            self._completer.close()

    def run_exclusive(self, item: Exclusive) -> None:
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

    def expire(self, work: Work) -> None:
        waited = time.monotonic() - work.enqueued_at
        work.resolve(error=DeadlineExceeded(f"request timed out after {waited:.3f} s in the queue"))
        if self.observer is not None:
            self.observer.expired(work)

    def run(self, works: list[Work]) -> None:
        with self._lock:
            self.running += 1
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
                    self.run([work])
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
        self.drain.batch_done(works, time.monotonic())
        outcomes = []
        sequences = sum(work.sequences for work in works)
        for work, result in zip(works, results, strict=True):
            work.infer_s = compute_s
            work.batch_sequences = sequences
            error = result if isinstance(result, ServiceError) else None
            outcomes.append((work, None if error is not None else result, error))
        resolve_all(outcomes)

    def _report_batch(self, works: list[Work], compute_s: float, ok: bool) -> None:
        with self._lock:
            self.running -= 1
        if self.observer is not None:
            self.observer.batch_done(works, compute_s, ok)
