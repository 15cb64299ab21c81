"""Dynamic batcher: requests queue on the event loop; one engine thread runs a plain loop of
collect-a-batch, forward, hand results back. The event loop never runs a forward.

A batch closes when it holds `max_batch_size` sequences or `max_batch_tokens` tokens, or
`max_batch_delay_s` after its first request was queued. Requests stay whole and keep FIFO order.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from service.errors import DeadlineExceeded, InferenceError, Overloaded
from service.inputs import Payload

log = logging.getLogger(__name__)

TORCH_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}


class BatchObserver(Protocol):
    """What the batcher reports (implemented by service.metrics)."""

    def queue_depth(self, sequences: int) -> None: ...
    def batch_started(self, works: list[Work]) -> None: ...
    def expired(self, work: Work) -> None: ...
    def batch_done(self, works: list[Work], compute_s: float, ok: bool) -> None: ...


@dataclass(eq=False)
class Work:
    """One request in the queue; its future resolves to a list of per-sequence numpy outputs."""

    payload: Payload
    deadline: float  # time.monotonic() by which it must have started
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(init=False)
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None

    def __post_init__(self) -> None:
        self.future = self.loop.create_future()

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        """Hand the outcome to the event loop (safe from any thread)."""

        def deliver() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(deliver)


def _to_torch(array: np.ndarray, datatype: str, device: torch.device, dtype: torch.dtype):
    tensor = torch.from_numpy(array)
    if datatype == "BF16":
        tensor = tensor.view(torch.bfloat16)
    return tensor.to(device=device, dtype=dtype, non_blocking=True)


def _to_numpy(tensor: torch.Tensor, datatype: str) -> np.ndarray:
    tensor = tensor.to(dtype=TORCH_DTYPES[datatype]).cpu()
    if datatype == "BF16":
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


class DynamicBatcher:
    """Bounded queue + one engine worker thread running `model.forward_varlen` on batches."""

    def __init__(
        self,
        model: Any,
        *,
        max_batch_size: int,
        max_batch_tokens: int,
        max_batch_delay_s: float,
        max_queue: int,
        observer: BatchObserver | None = None,
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
        self._queue: collections.deque[Work] = collections.deque()
        self._queued_sequences = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)

    # -- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def queued_sequences(self) -> int:
        return self._queued_sequences

    def submit(self, work: Work) -> None:
        """Queue `work`, or raise Overloaded (429) when it would not fit in the queue."""
        size = work.payload.num_sequences
        with self._cond:
            if self._stopping:
                raise Overloaded("server is shutting down")
            if self._queued_sequences + size > self.max_queue:
                raise Overloaded(
                    f"queue full ({self._queued_sequences} of {self.max_queue} sequences waiting); "
                    "retry later",
                    headers={"Retry-After": "1"},
                )
            self._queue.append(work)
            self._queued_sequences += size
            self._report_depth()
            self._cond.notify()

    def cancel(self, work: Work) -> bool:
        """Drop `work` if it is still queued (never run); False if it has already started."""
        with self._cond:
            if work.started_at is not None:
                return False
            try:
                self._queue.remove(work)
            except ValueError:
                return False
            self._queued_sequences -= work.payload.num_sequences
            self._report_depth()
            return True

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
            self.observer.queue_depth(self._queued_sequences)

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if batch:
                self._execute(batch)

    def _fits(self, seqs: int, tokens: int, work: Work) -> bool:
        return (
            seqs + work.payload.num_sequences <= self.max_batch_size
            and tokens + work.payload.num_tokens <= self.max_batch_tokens
        )

    def _next_batch(self) -> list[Work] | None:
        """Wait for work, let the batch fill until full or the delay is up, then take it."""
        with self._cond:
            while not self._queue:
                if self._stopping:
                    return None
                self._cond.wait()
            flush_at = self._queue[0].enqueued_at + self.max_batch_delay_s
            while not self._stopping:
                seqs = tokens = 0
                full = False
                for work in self._queue:
                    if not self._fits(seqs, tokens, work):
                        full = True
                        break
                    seqs += work.payload.num_sequences
                    tokens += work.payload.num_tokens
                remaining = flush_at - time.monotonic()
                if full or seqs >= self.max_batch_size or remaining <= 0:
                    break
                self._cond.wait(remaining)

            batch: list[Work] = []
            seqs = tokens = 0
            now = time.monotonic()
            while self._queue and self._fits(seqs, tokens, self._queue[0]):
                work = self._queue.popleft()
                self._queued_sequences -= work.payload.num_sequences
                if now > work.deadline:
                    self._expire(work)
                    continue
                work.started_at = now
                seqs += work.payload.num_sequences
                tokens += work.payload.num_tokens
                batch.append(work)
            self._report_depth()
            return batch

    def _expire(self, work: Work) -> None:
        waited = time.monotonic() - work.enqueued_at
        work.resolve(error=DeadlineExceeded(f"request timed out after {waited:.3f} s in the queue"))
        if self.observer is not None:
            self.observer.expired(work)

    def _forward(self, works: list[Work]) -> list[list[np.ndarray]]:
        """Forward every sequence of `works`; returns each request's outputs, in order.

        Self- and cross-attention requests go in separate engine calls, so a sequence's numbers
        never depend on which kind of request it was batched with.
        """
        results: dict[int, list[np.ndarray]] = {}
        for group in (
            [w for w in works if w.payload.key is None],
            [w for w in works if w.payload.key is not None],
        ):
            if group:
                for work, out in zip(group, self._forward_group(group), strict=True):
                    results[id(work)] = out
        return [results[id(w)] for w in works]

    def _forward_group(self, works: list[Work]) -> list[list[np.ndarray]]:
        device, dtype = self.model.device, self.model.dtype
        cross = works[0].payload.key is not None
        query, key, value, masks, causal = [], [], [], [], []
        for work in works:
            p = work.payload
            query += [_to_torch(q, p.datatype, device, dtype) for q in p.query]
            if cross:
                key += [_to_torch(k, p.datatype, device, dtype) for k in p.key]
                value += [_to_torch(v, p.datatype, device, dtype) for v in p.value]
            if p.key_padding_mask is not None:
                masks += [torch.from_numpy(m).to(device) for m in p.key_padding_mask]
            else:
                masks += [None] * p.num_sequences
            causal += [p.is_causal] * p.num_sequences
        outputs = self.model.forward_varlen(
            query,
            key=key if cross else None,
            value=value if cross else None,
            key_padding_mask=masks if any(m is not None for m in masks) else None,
            is_causal=causal,
        )
        results, start = [], 0
        for work in works:
            n = work.payload.num_sequences
            results.append(
                [_to_numpy(o, work.payload.datatype) for o in outputs[start : start + n]]
            )
            start += n
        return results

    def _execute(self, works: list[Work]) -> None:
        if self.observer is not None:
            self.observer.batch_started(works)
        started = time.perf_counter()
        try:
            results = self._forward(works)
        except Exception:
            log.exception("forward failed for a batch of %d requests", len(works))
            self._report_batch(works, time.perf_counter() - started, ok=False)
            if len(works) > 1:
                # Isolate the culprit: a bad request must not fail its batch-mates.
                for work in works:
                    self._execute([work])
            else:
                works[0].resolve(error=InferenceError("inference failed for this request"))
            return
        self._report_batch(works, time.perf_counter() - started, ok=True)
        for work, result in zip(works, results, strict=True):
            work.resolve(result)

    def _report_batch(self, works: list[Work], compute_s: float, ok: bool) -> None:
        if self.observer is not None:
            self.observer.batch_done(works, compute_s, ok)
