"""A front-end process's lifespan (`--workers N > 1`): no model is loaded here. The engine
process's hello describes the served models; each becomes a ModelEntry whose batcher and
statistics forward to the engine (service.workers.remote, over service.workers.link), with
the tokenizer loaded locally, so tokenizing, decoding and encoding run on the front-ends'
cores.

Ready only while connected to a warmed-up engine: when the engine process dies, readiness
drops and requests get 503 until the supervisor's new engine says hello again.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from service.grpc.server import GrpcListener
from service.runtime.loading import add_text_parts, cache_token, renew_cache_tokens
from service.runtime.metrics import Metrics
from service.runtime.model_control import ModelControl
from service.runtime.repository import model_settings, model_sources
from service.runtime.settings import Settings
from service.runtime.state import ModelEntry, ServiceState
from service.workers.link import EngineLink
from service.workers.remote import RemoteBatcher, RemoteStats
from service.workers.wire import EntryInfo

FIRST_HELLO_WAIT_S = 5.0  # how long a starting front-end waits for the engine before accepting
log = logging.getLogger("service.workers")

PARENT_CHECK_S = 1.0


def build_state(settings: Settings, link: EngineLink, welcome: list[EntryInfo]) -> ServiceState:
    """The served models as the engine described them, with this process's text parts."""
    sources = {(s.name, s.version): s for s in model_sources(settings)}
    first = [e for e in welcome if e.name == welcome[0].name][-1]  # as service.app picks it
    metrics = Metrics(first.name, first.version)
    versions: dict[str, dict[str, ModelEntry]] = {}
    for info in welcome:
        source = sources[(info.name, info.version)]
        entry = ModelEntry(
            info.name,
            info.view,  # type: ignore[arg-type]  # the model's facts, not its weights
            RemoteBatcher(link, info),  # type: ignore[arg-type]
            info.limits,
            info.info,
            RemoteStats(link, info),
        )
        entry.metrics = metrics.for_model(info.name, info.version)
        entry.version = info.version
        entry.version_policy = info.version_policy
        own = model_settings(settings, source)
        entry.cache_token = cache_token(own)
        add_text_parts(entry, own, source)
        entry.warm = True
        versions.setdefault(info.name, {})[info.version] = entry
    state = ServiceState(settings, metrics, versions)
    state.open_response_cache()
    return state


def frontend_lifespan(
    settings: Settings, link: EngineLink
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The lifespan create_app uses in a front-end process."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        grpc_listener: GrpcListener | None = None

        async def on_change(welcome: list[EntryInfo] | None) -> None:
            nonlocal grpc_listener
            state: ServiceState | None = getattr(app.state, "service", None)
            if welcome is None:  # the engine went
                if state is not None:
                    for entry in state.entries():
                        entry.warm = False
                    state.set_ready(False)
                return
            if state is None:
                state = await asyncio.to_thread(build_state, settings, link, welcome)
                state.loop = asyncio.get_running_loop()
                state.log_control = app.state.log_control
                state.trace_control = app.state.trace_control
                app.state.service = state
                app.state.model_control = control = ModelControl(state)
                if settings.grpc_port:
                    grpc_listener = GrpcListener(state, control, reuse_port=True)
                    await grpc_listener.start()
                    app.state.grpc = grpc_listener
                gc.collect()
                gc.freeze()
            elif state.response_cache is not None:  # a new engine process: its own outputs
                state.response_cache.drop(renew_cache_tokens(state.entries()))
            for entry in state.entries():
                entry.warm = True
            state.set_ready(not state.draining)
            log.info("front-end %d ready", link.index)
            hello.set()

        hello = asyncio.Event()
        link.on_change = on_change
        app.state.grpc = None
        connecting = asyncio.create_task(link.run())
        watching = asyncio.create_task(_exit_with_parent())
        # a restarted front-end shares the listening socket with live ones: it starts accepting
        # once the engine has said hello, so it answers no 503s beside a ready one; bounded, so
        # during a slow first start the front-ends still answer liveness probes
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hello.wait(), FIRST_HELLO_WAIT_S)
        try:
            yield
        finally:
            state = getattr(app.state, "service", None)
            if state is not None:
                await state.drain(grpc_listener.stop if grpc_listener is not None else None)
            await asyncio.to_thread(app.state.trace_control.shutdown)
            watching.cancel()
            link.stop()
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connecting

    return lifespan


async def _exit_with_parent() -> None:
    """Drain and exit if the supervisor is gone (killed without a chance to stop us). It is
    multiprocessing's parent_process(), not our parent: that is the fork server, which lives on
    while any child does."""
    supervisor = multiprocessing.parent_process()
    if supervisor is None:  # not started by a supervisor: nothing to watch
        return
    while supervisor.is_alive():
        await asyncio.sleep(PARENT_CHECK_S)
    log.error("the supervisor is gone; draining")
    os.kill(os.getpid(), signal.SIGTERM)
