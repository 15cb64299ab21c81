"""What the batcher queues: a request's `Work` (its payload and the runner that computes it) or
an `Exclusive` callable the engine thread runs alone; both resolve a future on the event loop.
`Batcher` is what routes queue them through (the DynamicBatcher, or a worker front-end's
RemoteBatcher)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from service.oip.inputs import Payload


class Runner(Protocol):
    """Computes the payloads of one batch that share this runner, in one engine call on the
    engine thread: runner(model, payloads) -> per payload its result or its own ServiceError."""

    def __call__(self, model: Any, payloads: list[Payload], /) -> list[Any]: ...


@dataclass(eq=False, kw_only=True)
class QueueItem:
    """Something waiting in the batcher's queue; its future is resolved from the engine thread."""

    deadline: float  # time.monotonic() by which it must have started
    # The event loop whose future it resolves; None for work queued by a worker front-end
    # (service.workers.engine), which overrides resolve() to answer over its channel.
    loop: asyncio.AbstractEventLoop | None
    future: asyncio.Future = field(init=False)
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    infer_s: float = 0.0  # its batch's forward (set by the batcher before it resolves)
    batch_sequences: int = 0  # sequences in its batch (likewise; 0: not known, as over --workers)
    # False: at the head of the queue it starts its batch at once rather than waiting the batch
    # delay for batch-mates (the warm-up, which nothing else can join before the model is ready)
    wait_for_batch: bool = True

    def __post_init__(self) -> None:
        if self.loop is not None:
            self.future = self.loop.create_future()

    @property
    def sequences(self) -> int:
        """Queue slots it holds (counted against --max-queue)."""
        raise NotImplementedError

    @property
    def tokens(self) -> int:
        """Tokens it adds to a batch (counted against --max-batch-tokens)."""
        return 0

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        """Hand the outcome to the event loop (safe from any thread)."""
        self.loop.call_soon_threadsafe(self.deliver, result, error)

    @property
    def queue_s(self) -> float:
        """Seconds it waited in the queue before its batch started."""
        return 0.0 if self.started_at is None else self.started_at - self.enqueued_at

    def deliver(self, result: Any, error: BaseException | None) -> None:
        """Resolve its future now, on the event loop's thread (a no-op once resolved)."""
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


@dataclass(eq=False, kw_only=True)
class Work(QueueItem):
    """One request's payload; its future resolves to what `runner` made of it."""

    payload: Payload
    # The batch's works sharing a runner go to it in one call (hidden states through the
    # model's forward_packed; token ids through a text model's embed_packed for /v1/embeddings).
    runner: Runner

    @property
    def sequences(self) -> int:
        return self.payload.num_sequences

    @property
    def tokens(self) -> int:
        return self.payload.num_tokens


@dataclass(eq=False, kw_only=True)
class Exclusive(QueueItem):
    """A callable the engine thread runs alone between batches (e.g. the attention-weights
    debug path); it holds `slots` queue slots and its future resolves to `fn()`."""

    fn: Callable[[], Any]
    slots: int

    @property
    def sequences(self) -> int:
        return self.slots


def resolve_all(outcomes: list[tuple[QueueItem, Any, BaseException | None]]) -> None:
    """Hand a batch's outcomes to the event loop in one call (one wake-up of the loop, not one
    per request) when they are plain items of one loop; else each its own way."""
    loops = {work.loop for work, _, _ in outcomes}
    plain = all(type(work).resolve is QueueItem.resolve for work, _, _ in outcomes)
    if len(loops) == 1 and plain and None not in loops:
        loop = loops.pop()
        if asyncio.events._get_running_loop() is loop:  # a batch run on the loop itself
            deliver_all(outcomes)
        else:
            loop.call_soon_threadsafe(deliver_all, outcomes)
        return
    for work, result, error in outcomes:
        work.resolve(result, error)


def deliver_all(outcomes: list[tuple[QueueItem, Any, BaseException | None]]) -> None:
    for work, result, error in outcomes:
        work.deliver(result, error)


class Batcher(Protocol):
    """What the routes and the pipeline use of a model's batcher: the DynamicBatcher
    (service.runtime.batcher), or with --workers a front-end's RemoteBatcher
    (service.workers.remote) forwarding to the engine process's."""

    model: Any
    max_batch_size: int
    max_batch_delay_s: float
    max_queue: int

    @property
    def queued_sequences(self) -> int: ...
    def start(self) -> None: ...
    def stop(self, timeout: float | None = None) -> None: ...
    def check_open(self) -> None: ...
    def close(self) -> int: ...
    def flush(self) -> None: ...
    def submit(self, work: QueueItem) -> None: ...
    def run_exclusive(
        self, fn: Callable[..., Any], args: tuple = (), *, sequences: int, deadline: float
    ) -> QueueItem: ...
    def cancel(self, work: QueueItem) -> bool: ...
    async def withdraw(self, items: list[QueueItem]) -> bool: ...
    def reserve(self, sequences: int) -> contextlib.AbstractAsyncContextManager[None]: ...
