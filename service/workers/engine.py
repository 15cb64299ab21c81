"""The engine process of `--workers N`: it loads the models, runs their batchers and engine
threads, warms them up, then serves front-ends on a Unix socket.

Per front-end connection: one reader thread turns messages into queued work on the shared
batchers (the one queue, so --max-queue, batching and 429s are server-wide), and one writer
thread sends replies, so a front-end that stops reading stalls only its own replies, never the
engine thread. Work resolves straight from the engine thread into the front-end's slab.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from service.pipeline.errors import InferenceError, ServiceError
from service.runtime.batcher import DynamicBatcher
from service.runtime.loading import load_entries, warm_up_model
from service.runtime.settings import Settings
from service.runtime.startup import StartupError
from service.runtime.state import ModelEntry, ServiceState
from service.runtime.work import Exclusive, QueueItem, Work
from service.workers.channel import FrameBuffer, frame_all, recv_message
from service.workers.messages import (
    Cancel,
    Cancelled,
    Done,
    Error,
    Executed,
    Failed,
    Hello,
    Key,
    Release,
    Reply,
    Reserve,
    RunAlone,
    StatsQuery,
    Submit,
    Welcome,
)
from service.workers.slab import Slab
from service.workers.wire import (
    EntryInfo,
    ModelView,
    payload_from_wire,
    result_to_wire,
)

log = logging.getLogger("service.workers")


class Connection:
    """One front-end's channel and slab, and the work it has queued."""

    def __init__(self, sock: socket.socket, slab: Slab, index: int) -> None:
        self.sock = sock
        self.slab = slab
        self.index = index
        self.items: dict[int, tuple[QueueItem, DynamicBatcher]] = {}  # id -> queued or running
        self.held: dict[int, tuple[DynamicBatcher, int]] = {}  # reservations
        self.alive = True
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name=f"reply-{index}", daemon=True)
        self._writer.start()

    def send(self, message: Any) -> None:
        """Queue a reply (any thread); dropped once the front-end is gone. The writer thread
        pickles what is queued together (a batch's replies: one frame)."""
        if self.alive:
            self._outbox.put(message)

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            messages = [message]
            with contextlib.suppress(queue.Empty):  # coalesce what a batch resolved at once
                while len(messages) < 256:
                    more = self._outbox.get_nowait()
                    if more is None:
                        self._outbox.put(None)
                        break
                    messages.append(more)
            try:
                self.sock.sendall(frame_all(messages, self._unsendable))
            except OSError:
                self.alive = False

    def _unsendable(self, message: Any) -> Any | None:
        """A reply that does not pickle: its request fails alone (an Error in its place)."""
        name = type(message).__name__
        log.exception("could not send a %s to front-end %d", name, self.index)
        if isinstance(message, (Done, Error)):
            return Error(message.ident, InferenceError("inference failed for this request"))
        return None

    def close(self) -> None:
        """The front-end is gone: its queued work leaves the queue, its slots are released; work
        already running finishes and its reply is dropped."""
        self.alive = False
        for item, batcher in list(self.items.values()):
            batcher.cancel(item)
        self.items.clear()
        for batcher, sequences in self.held.values():
            batcher.release(sequences)
        self.held.clear()
        self._outbox.put(None)
        self._writer.join(5)
        with contextlib.suppress(OSError):
            self.sock.close()
        self.slab.close()


@dataclass(eq=False, kw_only=True)
class _Remote:
    """Mixin: queued on behalf of a front-end; resolving sends the reply over its channel."""

    conn: Connection
    ident: int
    out: tuple[int, int] | None = None  # the request's output region in the slab
    _done: bool = field(default=False, init=False)

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        if self._done:
            return
        self._done = True
        self.conn.items.pop(self.ident, None)
        if not self.conn.alive:  # its front-end is gone (and its slab may be unmapped)
            return
        try:
            if error is not None:
                self.conn.send(Error(self.ident, error))
            else:
                wire = result_to_wire(self.conn.slab, self.out, result)
                self.conn.send(Done(self.ident, wire, self.queue_s, self.infer_s))
        except Exception:  # a result that cannot be written: the request fails, not the batch
            log.exception("could not send a result to front-end %d", self.conn.index)
            failed = InferenceError("inference failed for this request")
            self.conn.send(Error(self.ident, failed))


@dataclass(eq=False, kw_only=True)
class RemoteWork(_Remote, Work):
    """A front-end's request in the shared queue."""


@dataclass(eq=False, kw_only=True)
class RemoteExclusive(_Remote, Exclusive):
    """A front-end's engine call (the debug routes) in the shared queue."""


class Engine:
    """The models, their batchers, and the front-ends' connections."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        self.entries: dict[Key, ModelEntry] = {(e.name, e.version): e for e in state.entries()}
        self.connections: set[Connection] = set()
        self.draining = False
        self._lock = threading.Lock()

    def welcome(self) -> list[EntryInfo]:
        return [
            EntryInfo(
                e.name,
                e.version,
                ModelView.of(e.model),
                e.limits,
                e.info,
                e.version_policy,
                e.batcher.max_batch_size,
                e.batcher.max_batch_delay_s,
                e.batcher.max_queue,
            )
            for e in self.entries.values()
        ]

    # -- one front-end ----------------------------------------------------------------------
    def accept(self, sock: socket.socket) -> None:
        """Handshake (the slab's fd rides on the hello message), then serve it on a thread."""
        sock.settimeout(10)
        message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
        sock.settimeout(None)
        hello = FrameBuffer().feed(message)
        if not hello or not isinstance(hello[0], Hello) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            sock.close()
            log.warning("a front-end connection sent no valid hello; closed")
            return
        index, slab_bytes = hello[0]
        conn = Connection(sock, Slab(slab_bytes, fd=fds[0]), index)
        with self._lock:
            self.connections.add(conn)
        conn.send(Welcome(self.welcome()))
        threading.Thread(target=self._serve, args=(conn,), name=f"front-end-{index}").start()

    def _serve(self, conn: Connection) -> None:
        buffer = FrameBuffer()
        try:
            while True:
                messages = recv_message(conn.sock, buffer)
                if messages is None:
                    break
                for message in messages:
                    try:
                        self._handle(conn, message)
                    except Exception:  # a bug, not the front-end's fault: fail that one request
                        name = type(message).__name__
                        log.exception("front-end %d: cannot handle %s", conn.index, name)
                        if isinstance(message, (Submit, RunAlone)):
                            failed = InferenceError("inference failed for this request")
                            conn.send(Error(message.ident, failed))
        except OSError:
            pass
        finally:
            conn.close()
            with self._lock:
                self.connections.discard(conn)
            log.info("front-end %d disconnected", conn.index)

    def _handle(self, conn: Connection, message: Any) -> None:
        match message:
            case Submit(ident, key, runner, deadline, wire, out):
                payload = payload_from_wire(wire, conn.slab)
                work = RemoteWork(
                    payload=payload, runner=runner, deadline=deadline, loop=None,
                    conn=conn, ident=ident, out=out,
                )  # fmt: skip
                self._queue(conn, self.entries[key].batcher, work)
            case RunAlone(ident, key, fn, args, sequences, deadline):
                entry = self.entries[key]
                item = RemoteExclusive(
                    fn=functools.partial(fn, entry.model, *args), slots=max(1, sequences),
                    deadline=deadline, loop=None, conn=conn, ident=ident,
                )  # fmt: skip
                self._queue(conn, entry.batcher, item)
            case Cancel(reply_to, ident):  # withdrawn (never run) is final: no Done follows
                found = conn.items.get(ident)
                withdrawn = found is not None and found[1].cancel(found[0])
                if withdrawn:
                    conn.items.pop(ident, None)
                conn.send(Cancelled(ident, withdrawn, reply_to))
            case Reserve(reply_to, key, sequences):
                batcher = self.entries[key].batcher
                try:
                    batcher.hold(sequences)
                except ServiceError as exc:
                    conn.send(Reply(reply_to, exc))
                    return
                conn.held[reply_to] = (batcher, sequences)
                conn.send(Reply(reply_to, None))
            case Release(reply_to):
                held = conn.held.pop(reply_to, None)
                if held is not None:
                    held[0].release(held[1])
            case Executed(key, timing):
                self.entries[key].stats.executed(timing)
            case Failed(key, seconds):
                self.entries[key].stats.failed(seconds)
            case StatsQuery(reply_to, key):
                conn.send(Reply(reply_to, self.entries[key].stats.as_dict()))
            case _:
                name = type(message).__name__
                log.warning("front-end %d sent an unknown message %s", conn.index, name)

    def _queue(self, conn: Connection, batcher: DynamicBatcher, item: QueueItem) -> None:
        conn.items[item.ident] = (item, batcher)
        try:
            batcher.submit(item)
        except ServiceError as exc:  # 429 / 503: answered now, never queued
            item.resolve(error=exc)

    # -- the process ------------------------------------------------------------------------
    def stop(self) -> None:
        for entry in self.entries.values():
            entry.batcher.stop(self.state.settings.drain_grace_s)


async def _load(settings: Settings) -> ServiceState:
    """Load, start and warm up every model version, as service.app does in one process."""
    metrics, versions = await load_entries(settings)
    state = ServiceState(settings, metrics, versions)
    for entry in state.entries():
        entry.batcher.start()
    for entry in state.entries():
        await warm_up_model(entry)
    return state


def run(settings: Settings, path: str) -> None:
    """Engine process main: load, warm up, listen on `path`; on SIGTERM drain (the grace, then
    503 for what has not started) and exit once every front-end has gone."""
    import torch

    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    supervisor = multiprocessing.parent_process()  # not os.getppid(): that is the fork server
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor forwards Ctrl-C as SIGTERM
    try:
        state = asyncio.run(_load(settings))
    except StartupError as exc:  # one line, as one process prints it; the supervisor stops
        log.debug("start-up failed", exc_info=exc)
        print(f"mha-serve: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.status) from None
    engine = Engine(state)
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):  # left by the engine this one replaces
        os.unlink(path)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(0.2)
    log.info("engine ready: %s", ", ".join(f"{n}/{v}" for n, v in engine.entries))
    grace: threading.Timer | None = None
    orphaned = False
    try:
        while True:
            if stopping.is_set() and grace is None:
                engine.draining = True
                state.flush_batches()
                grace = threading.Timer(settings.drain_grace_s, state.end_grace)
                grace.daemon = True
                grace.start()
            if grace is not None and not engine.connections:
                break  # every front-end has drained and gone
            if supervisor is not None and not supervisor.is_alive() and not orphaned:
                log.error("the supervisor is gone; draining, then removing its directory")
                orphaned = True
                stopping.set()  # the front-ends drain too (service.workers.frontend)
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            if engine.draining:
                sock.close()
                continue
            try:
                engine.accept(sock)
            except OSError:
                log.exception("a front-end handshake failed")
    finally:
        listener.close()
        if grace is not None:
            grace.cancel()
        state.end_grace()
        engine.stop()
        if orphaned:  # nobody else is left to remove the socket and metrics directory
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        log.info("engine stopped")
