"""A front-end's channel to the engine process under `--workers N`: requests out (payloads in
its shared-memory slab), replies in, one frame per event-loop turn.

The link reconnects forever: while the engine process is down (crashed and being restarted by
the supervisor) every request waiting on it gets 503 + Retry-After, new ones too, and the
front-end is not ready; it is ready again once the new engine has warmed up and said hello.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from service.pipeline.errors import InferenceError, NotReady
from service.runtime.work import QueueItem
from service.workers.channel import FrameBuffer, frame, frame_all
from service.workers.messages import (
    Cancelled,
    Done,
    Error,
    Hello,
    Reply,
    RunAlone,
    Submit,
    Welcome,
)
from service.workers.slab import Slab
from service.workers.wire import EntryInfo, result_from_wire

log = logging.getLogger("service.workers")

ENGINE_DOWN = "the engine process is restarting; retry shortly"
RECONNECT_S = 0.1


async def _ignore(welcome: list[EntryInfo] | None) -> None:
    pass


def down() -> NotReady:
    """The answer while the engine process is away: 503, retry in a second."""
    return NotReady(ENGINE_DOWN, headers={"Retry-After": "1"})


@dataclass
class _Pending:
    item: QueueItem
    regions: list[tuple[int, int]]  # slab regions to free when the reply comes
    out: tuple[int, int] | None  # the output region, among `regions`
    slab: Slab | None  # the slab of the connection it was sent on


class _Protocol(asyncio.Protocol):
    def __init__(self, link: EngineLink) -> None:
        self.link = link
        self.buffer = FrameBuffer()

    def data_received(self, data: bytes) -> None:
        for message in self.buffer.feed(data):
            try:
                self.link.dispatch(message)
            except Exception:  # a bug: one reply lost (its request fails), not the channel
                name = type(message).__name__
                log.exception("front-end %d: cannot handle %s", self.link.index, name)

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.lost()


class EngineLink:
    """The channel to the engine process, its slab, and what is waiting on replies."""

    def __init__(self, path: str, index: int, slab_bytes: int) -> None:
        self.path = path
        self.index = index
        self.slab_bytes = slab_bytes
        self.slab: Slab | None = None
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, _Pending] = {}
        self.replies: dict[int, asyncio.Future] = {}
        self.ids = itertools.count(1)
        # told the engine's welcome on connecting, None on losing it (set by the lifespan)
        self.on_change: Callable[[list[EntryInfo] | None], Awaitable[None]] = _ignore
        self._welcome: asyncio.Future | None = None
        self._closed: asyncio.Future | None = None
        self._stopping = False
        self._out: list[Any] = []  # messages to write at the end of this loop turn, one frame

    @property
    def connected(self) -> bool:
        return self.transport is not None and self._welcome is not None and self._welcome.done()

    async def run(self) -> None:
        """Connect, serve until the engine goes, reconnect; until stop()."""
        loop = asyncio.get_running_loop()
        while not self._stopping:
            try:
                welcome = await self._connect(loop)
            except (OSError, asyncio.TimeoutError, EOFError):
                await asyncio.sleep(RECONNECT_S)
                continue
            log.info("front-end %d: connected to the engine", self.index)
            await self.on_change(welcome)
            await self._closed
            await self.on_change(None)
            if not self._stopping:
                log.warning("front-end %d: lost the engine process; reconnecting", self.index)

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> list[EntryInfo]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, self.path)
            slab = Slab(self.slab_bytes)
            hello = frame(Hello(self.index, self.slab_bytes))
            socket.send_fds(sock, [hello], [slab.fd])
        except BaseException:
            sock.close()
            raise
        self._welcome = loop.create_future()
        self._closed = loop.create_future()
        self.slab = slab
        transport, _ = await loop.create_unix_connection(lambda: _Protocol(self), sock=sock)
        self.transport = transport
        try:
            return await asyncio.wait_for(asyncio.shield(self._welcome), 30)
        except BaseException:
            transport.close()
            raise

    def stop(self) -> None:
        self._stopping = True
        if self.transport is not None:
            self.transport.close()

    # -- replies ----------------------------------------------------------------------------
    def dispatch(self, message: Any) -> None:
        match message:
            case Done(ident, result, queue_s, infer_s):
                pending = self.pending.pop(ident, None)
                if pending is None:
                    return
                try:
                    value = result_from_wire(pending.slab, pending.out, result)
                finally:
                    self._free(pending)
                item = pending.item
                item.started_at = item.enqueued_at + queue_s  # measured in the engine process
                item.infer_s = infer_s
                item.deliver(value, None)
            case Error(ident, error):
                pending = self.pending.pop(ident, None)
                if pending is not None:
                    self._free(pending)
                    pending.item.deliver(None, error)
            case Cancelled(ident, withdrawn, reply_to):
                if withdrawn:
                    pending = self.pending.pop(ident, None)
                    if pending is not None:
                        self._free(pending)
                        pending.item.future.cancel()
                future = self.replies.pop(reply_to, None)
                if future is not None and not future.done():
                    future.set_result(withdrawn)
            case Reply(reply_to, value):
                future = self.replies.pop(reply_to, None)
                if future is not None and not future.done():
                    future.set_result(value)
            case Welcome(entries) if self._welcome is not None and not self._welcome.done():
                self._welcome.set_result(entries)

    def _free(self, pending: _Pending) -> None:
        if pending.slab is self.slab and self.slab is not None:
            for offset, nbytes in pending.regions:
                self.slab.free(offset, nbytes)

    def lost(self) -> None:
        """The engine went: everything waiting on it gets 503; the slab is dropped (a new
        engine gets a new one, so nothing can write into regions handed out again)."""
        self.transport = None
        self._out = []  # frames for the engine that went (their slab regions die with it)
        pending, self.pending = self.pending, {}
        replies, self.replies = self.replies, {}
        for p in pending.values():
            p.item.deliver(None, down())
        for future in replies.values():
            if not future.done():
                future.set_exception(down())
        if self.slab is not None:
            self.slab.close()
            self.slab = None
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_exception(EOFError("engine closed the channel"))
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    # -- requests ---------------------------------------------------------------------------
    def send(self, message: Any) -> None:
        """Queue `message`; what one turn of the event loop sends goes out as one frame in one
        write (under load many requests' submits and statistics share a pickle and a syscall)."""
        if self.transport is None:
            raise down()
        self._out.append(message)
        if len(self._out) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and out:
            self.transport.write(frame_all(out, self._unsendable))

    def _unsendable(self, message: Any) -> None:
        """A message that does not pickle (a bug): what waits on it fails now, not at its
        deadline; nothing is sent in its place."""
        log.exception("front-end %d: cannot send %s", self.index, type(message).__name__)
        failed = InferenceError("inference failed for this request")
        pending = self.pending.pop(getattr(message, "ident", None), None)
        if pending is not None:
            self._free(pending)
            pending.item.deliver(None, failed)
        future = self.replies.pop(getattr(message, "reply_to", None), None)
        if future is not None and not future.done():
            future.set_exception(failed)

    async def ask(self, question: Callable[..., Any], *fields: Any) -> Any:
        """Send `question(reply_to, *fields)` with a fresh reply id; await the engine's answer."""
        if not self.connected:
            raise down()
        reply_to = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.replies[reply_to] = future
        self.send(question(reply_to, *fields))
        return await future

    def submit(self, item: QueueItem, message: Submit | RunAlone, regions: list, out: Any) -> None:
        ident = message.ident
        self.pending[ident] = _Pending(item, regions, out, self.slab)
        try:
            self.send(message)
        except BaseException:
            pending = self.pending.pop(ident)
            self._free(pending)
            raise
