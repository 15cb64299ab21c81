"""Which served copy of a model takes a request, and whether it may: the model is looked up
when the request is ready to queue (after its body is read), so a reload never fails it (the new
copy takes it; the old one finishes what it accepted) and an unload answers 404 naming the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.pipeline.errors import ModelNotFound, NotReady

if TYPE_CHECKING:
    from service.runtime.state import ModelEntry, ServiceState
    from service.runtime.work import QueueItem

RETRIES = 3  # a model replaced again and again while one request is queued: give up after this


def ensure_serving(state: ServiceState, entry: ModelEntry | None = None) -> None:
    """503 while warming up or draining: work is accepted only by a ready server, or (given
    `entry`) by a ready model version. An entry being unloaded is gone: 404 naming it."""
    if state.serving if entry is None else state.model_ready(entry):
        return
    if state.draining:
        message = "server is draining; retry on another replica"
    elif entry is not None and entry.unloading:
        raise ModelNotFound(f"model '{entry.name}' version {entry.version} is not loaded")
    else:
        if entry is not None:
            entry.batcher.check_open()  # a closed batcher, or (--workers) the engine restarting
        message = "model is warming up"
    raise NotReady(message, headers={"Retry-After": "1"})


def admit(state: ServiceState, name: str, version: str | None) -> ModelEntry:
    """Before any work (before the body is read): 404 for a model not served, 503 while it warms
    up or the server drains. A request admitted here is served, or shed at the drain grace's
    end, even if the server starts draining while its body arrives."""
    entry = state.find(name, version)
    ensure_serving(state, entry)
    return entry


def submit(state: ServiceState, name: str, version: str | None, item: QueueItem) -> ModelEntry:
    """Queue `item` on the current copy of the model; a copy replaced between the look-up and
    the queue (a reload) passes it to its successor. Returns the entry that took it."""
    for _ in range(RETRIES):
        entry = state.find(name, version)  # the current copy; unloaded: 404 naming the model
        try:
            entry.batcher.submit(item)
        except NotReady:
            if not entry.unloading or state.draining:
                raise
            continue  # replaced meanwhile: look again (the successor, or 404 if unloaded)
        return entry
    raise NotReady(f"model '{name}' is being reloaded; retry", headers={"Retry-After": "1"})
