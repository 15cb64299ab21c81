"""Every message on the `--workers` engine channel, as a type (pickled as a class and its fields:
as small and fast as a tuple). Front-end -> engine first, then engine -> front-end.

`ident` numbers a queued request, `reply_to` a question awaiting its Reply; `key` is a model
version, (name, version).
"""

from __future__ import annotations

from typing import Any, NamedTuple

Key = tuple[str, str]  # (model name, version)


# -- front-end -> engine ----------------------------------------------------------------------
class Hello(NamedTuple):
    """The first message; the front-end's slab fd rides on it (SCM_RIGHTS)."""

    index: int
    slab_bytes: int


class Submit(NamedTuple):
    """Queue a request's payload (slab regions, else inline arrays) for `runner`."""

    ident: int
    key: Key
    runner: Any  # a module-level function, pickled by name
    deadline: float  # time.monotonic(): the same clock in both processes
    wire: Any  # service.workers.wire.payload_to_wire
    out: tuple[int, int] | None  # the result's slab region (offset, bytes), if reserved


class RunAlone(NamedTuple):
    """Queue `fn(model, *args)` to run on the engine thread alone (the debug routes)."""

    ident: int
    key: Key
    fn: Any
    args: tuple
    sequences: int
    deadline: float


class Cancel(NamedTuple):
    """Drop request `ident` if it is still queued; `reply_to` 0: no one awaits Cancelled."""

    reply_to: int
    ident: int


class Reserve(NamedTuple):
    """Hold `sequences` queue slots while the front-end tokenizes; Reply(None or the error)."""

    reply_to: int
    key: Key
    sequences: int


class Release(NamedTuple):
    """Give back the slots Reserve `reply_to` held."""

    reply_to: int


class Executed(NamedTuple):
    """One executed request's statistics (service.runtime.statistics.Timing)."""

    key: Key
    timing: Any


class Failed(NamedTuple):
    """One failed request's statistics."""

    key: Key
    seconds: float


class StatsQuery(NamedTuple):
    """Ask for a model version's statistics; Reply(its dict)."""

    reply_to: int
    key: Key


# -- engine -> front-end ----------------------------------------------------------------------
class Welcome(NamedTuple):
    """The served models (service.workers.wire.EntryInfo), after Hello."""

    entries: list


class Done(NamedTuple):
    """Request `ident`'s result (service.workers.wire.result_to_wire) and its engine times."""

    ident: int
    result: tuple
    queue_s: float
    infer_s: float


class Error(NamedTuple):
    """Request `ident` failed with `error` (a ServiceError)."""

    ident: int
    error: BaseException


class Cancelled(NamedTuple):
    """Answer to Cancel: whether request `ident` was withdrawn (never run; no Done follows)."""

    ident: int
    withdrawn: bool
    reply_to: int


class Reply(NamedTuple):
    """Answer to a question (Reserve, StatsQuery)."""

    reply_to: int
    value: Any
