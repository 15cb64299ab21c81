"""Waiting for queued work, for every front: the result, the deadline, or the client going.

A front passes what tells it the client has gone (HTTP: the connection's disconnect signal; gRPC:
None, since a cancelled call cancels the awaiting task). Either way the items not yet started
leave the queue and are never computed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from service.pipeline.errors import ClientDisconnected, DeadlineExceeded


class Gone(Protocol):
    """Fires once when the client goes away (service.http.connections.Disconnect is one)."""

    happened: bool

    def add(self, callback: Callable[[], None]) -> None: ...
    def discard(self, callback: Callable[[], None]) -> None: ...


class Stays:
    """A client that is never seen to go: a gRPC call's (a cancelled call cancels the task
    awaiting its work instead)."""

    happened = False

    def add(self, callback: Callable[[], None]) -> None:
        pass

    def discard(self, callback: Callable[[], None]) -> None:
        pass


class Queue(Protocol):
    """What waiting needs of a batcher (local or remote)."""

    def cancel(self, item: Any) -> bool: ...
    async def withdraw(self, items: list[Any]) -> bool: ...


async def await_queued(
    batcher: Queue, result: asyncio.Future, items: list, timeout: float, gone: Gone | None = None
) -> Any:
    """Await `result` of `items` queued on `batcher`: ClientDisconnected (499) if the client
    leaves, DeadlineExceeded (504) if `timeout` passes before they ran; either way, and when the
    awaiting task is cancelled, the items not yet started leave the queue. One future, one
    timer and a callback: no task per request."""
    loop = asyncio.get_running_loop()
    wake = loop.create_future()

    def wake_up(*_: object) -> None:
        if not wake.done():
            wake.set_result(None)

    result.add_done_callback(wake_up)
    timer = loop.call_later(timeout, wake_up)
    if gone is not None:
        gone.add(wake_up)
    try:
        await wake
    except BaseException:  # cancelled (call cancelled, server shutting down): never compute it
        _cancel(batcher, items)
        raise
    finally:
        timer.cancel()
        if gone is not None:
            gone.discard(wake_up)
        result.remove_done_callback(wake_up)
    if result.done():
        return result.result()
    if gone is not None and gone.happened:
        _cancel(batcher, items)
        raise ClientDisconnected("client disconnected")
    if await batcher.withdraw(items):
        raise DeadlineExceeded(f"request timed out after {timeout:.3f} s in the queue")
    try:
        return await result  # everything already running: it finishes within one forward
    except asyncio.CancelledError:
        _cancel(batcher, items)
        raise


def _cancel(batcher: Queue, items: list) -> None:
    for item in items:
        batcher.cancel(item)
