"""A front-end's side of `--workers N`: the batcher and statistics the routes use, which forward
to the engine process's own over its link (service.workers.link), so the routes are unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from service.oip.datatypes import DATATYPES
from service.pipeline.errors import NotReady
from service.runtime.batcher import SHUTTING_DOWN
from service.runtime.forward import hidden_states
from service.runtime.statistics import ModelStats, Timing
from service.runtime.work import QueueItem, Work
from service.workers.link import EngineLink, down
from service.workers.messages import (
    Cancel,
    Executed,
    Failed,
    Release,
    Reserve,
    RunAlone,
    StatsQuery,
    Submit,
)
from service.workers.wire import EntryInfo, payload_to_wire


@dataclass(eq=False, kw_only=True)
class RemoteItem(QueueItem):
    """An engine call (run_exclusive) sent to the engine process."""

    slots: int

    @property
    def sequences(self) -> int:
        return self.slots


class RemoteBatcher:
    """A Batcher (service.runtime.batcher) forwarding to the engine process's batcher of one
    model version: the queue, its limits and 429s are the engine's, shared by all front-ends."""

    def __init__(self, link: EngineLink, info: EntryInfo) -> None:
        self.link = link
        self.key = (info.name, info.version)
        self.model = info.view
        self.embed_dim = info.limits.embed_dim
        self.max_batch_size = info.max_batch_size
        self.max_batch_delay_s = info.max_batch_delay_s
        self.max_queue = info.max_queue
        self.queued_sequences = 0  # the engine's; read its /metrics gauge
        self.closed = False
        self._ids: dict[int, int] = {}  # id(item) -> message id

    def start(self) -> None:
        pass

    def stop(self, timeout: float | None = None) -> None:
        pass

    def check_open(self) -> None:
        if self.closed:
            raise NotReady(SHUTTING_DOWN, headers={"Retry-After": "1"})
        if not self.link.connected:
            raise down()

    def flush(self) -> None:
        """Draining: the engine process flushes its own batchers when it is told to drain."""

    def close(self) -> int:
        """End of this front-end's drain grace; the engine sheds what is queued at its own."""
        self.closed = True
        return 0

    def _output_bytes(self, work: Work) -> int:
        """Room to reserve for the result: hidden states come back as (tokens, embed_dim) in
        the wire type; other runners' small results travel inline."""
        if work.runner is hidden_states:
            itemsize = DATATYPES[work.payload.datatype].itemsize
            return work.payload.num_tokens * self.embed_dim * itemsize
        return 0

    def submit(self, work: QueueItem) -> None:
        """Send `work` to the engine's queue; a 429 or 503 from there resolves its future."""
        self.check_open()
        assert isinstance(work, Work)
        slab = self.link.slab
        regions: list[tuple[int, int]] = []
        out = None
        if slab is not None and (nbytes := self._output_bytes(work)):
            offset = slab.alloc(nbytes)
            if offset is not None:
                out = (offset, nbytes)
                regions.append(out)
        try:
            wire = payload_to_wire(work.payload, slab, regions)
        except BaseException:
            for offset, nbytes in regions:
                slab.free(offset, nbytes)
            raise
        ident = next(self.link.ids)
        self._ids[id(work)] = ident
        work.future.add_done_callback(lambda _: self._ids.pop(id(work), None))
        message = Submit(ident, self.key, work.runner, work.deadline, wire, out)
        self.link.submit(work, message, regions, out)

    def run_exclusive(
        self, fn: Callable[..., Any], args: tuple = (), *, sequences: int, deadline: float
    ) -> QueueItem:
        """`fn(model, *args)` on the engine thread, alone; `fn` and `args` travel pickled."""
        self.check_open()
        item = RemoteItem(
            slots=max(1, sequences), deadline=deadline, loop=asyncio.get_running_loop()
        )
        ident = next(self.link.ids)
        self._ids[id(item)] = ident
        item.future.add_done_callback(lambda _: self._ids.pop(id(item), None))
        message = RunAlone(ident, self.key, fn, args, sequences, deadline)
        self.link.submit(item, message, [], None)
        return item

    def cancel(self, item: QueueItem) -> bool:
        """Ask the engine to drop `item` if still queued (not waiting for the answer)."""
        ident = self._ids.get(id(item))
        if ident is not None and self.link.connected:
            self.link.send(Cancel(0, ident))  # 0: no one awaits the answer
        return False

    async def withdraw(self, items: list[QueueItem]) -> bool:
        """Take `items` out of the engine's queue; True if any was still queued. A withdrawn
        item's future is cancelled and its slab regions freed."""
        withdrawn = False
        for item in items:
            ident = self._ids.get(id(item))
            if ident is None or not self.link.connected:
                continue
            if await self.link.ask(Cancel, ident):  # the link frees it and cancels it
                withdrawn = True
        return withdrawn

    @contextlib.asynccontextmanager
    async def reserve(self, sequences: int) -> AsyncIterator[None]:
        """Hold queue slots in the engine's queue while this request tokenizes (429 when full)."""
        self.check_open()
        reply_to = next(self.link.ids)
        future = asyncio.get_running_loop().create_future()
        self.link.replies[reply_to] = future
        self.link.send(Reserve(reply_to, self.key, sequences))
        error = await future
        if error is not None:
            raise error
        try:
            yield
        finally:
            if self.link.connected:
                self.link.send(Release(reply_to))


class RemoteStats(ModelStats):
    """Triton statistics kept by the engine process: this front-end's request-side figures go
    there (one small message each), and reading asks it."""

    def __init__(self, link: EngineLink, info: EntryInfo) -> None:
        super().__init__(info.name, info.version)
        self.link = link
        self.key = (info.name, info.version)

    def executed(self, timing: Timing) -> None:
        if self.link.connected:
            self.link.send(Executed(self.key, timing))

    def failed(self, seconds: float) -> None:
        if self.link.connected:
            self.link.send(Failed(self.key, seconds))

    async def snapshot(self) -> dict[str, Any]:
        return await self.link.ask(StatsQuery, self.key)
