"""Running an app under uvicorn with the service's connection limits and graceful drain (the
single process, and each `--workers` front-end)."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from types import FrameType

import uvicorn

from service.http.connections import connection_cap, protocol_class
from service.runtime.settings import Settings
from service.runtime.startup import StartupError, unexpected


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT, fail readiness and refuse new work before uvicorn's graceful stop."""

    def __init__(self, config: uvicorn.Config, app) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = getattr(self._app.state, "service", None)
        if state is not None and sig in (signal.SIGTERM, signal.SIGINT):
            state.start_draining()
        super().handle_exit(sig, frame)


def set_interop_threads() -> None:
    """The engine makes no inter-op parallel calls: no second pool competing for the cores."""
    import torch

    with contextlib.suppress(RuntimeError):  # already started (serve twice in one process)
        torch.set_num_interop_threads(1)


class StartupFailures:
    """The app as uvicorn sees it, but a lifespan start-up failure is kept here instead of
    handed to uvicorn's log as Starlette's traceback: run_uvicorn raises it as one line."""

    def __init__(self, app) -> None:
        self.app = app
        self.error: BaseException | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def quiet(message) -> None:
            if message["type"] == "lifespan.startup.failed":
                message = {**message, "message": ""}  # the traceback: logged at debug instead
            await send(message)

        try:
            await self.app(scope, receive, quiet)
        except BaseException as exc:
            self.error = exc  # its traceback: service.__main__ logs it at debug level
            logging.getLogger("uvicorn.error").addFilter(_NoStartupFailedLine())
            raise


class _NoStartupFailedLine(logging.Filter):
    """uvicorn's own "Application startup failed. Exiting.": the one line we print says why."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Application startup failed. Exiting."


def run_uvicorn(settings: Settings, app, sock: socket.socket | None = None) -> None:
    """Serve `app` until SIGTERM, on (host, port) or on an already bound listening `sock`.
    A failed start raises StartupError (one line, its exit status) rather than uvicorn's
    SystemExit(3) after a traceback."""
    guarded = StartupFailures(app)
    config = uvicorn.Config(
        guarded,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # At the end of the grace, queued work is answered 503 (ServiceState.end_grace) and the
        # running forward finishes, so connections close by grace + one forward; uvicorn's own
        # cut-off (which would answer 500) is only a backstop for clients still sending bodies.
        timeout_graceful_shutdown=settings.drain_grace_s + settings.request_timeout_s,
        timeout_keep_alive=settings.keep_alive_timeout_s,
        http=protocol_class(
            settings.header_timeout_s,
            settings.write_timeout_s,
            connection_cap(settings.max_connections),
        ),
        access_log=False,  # service.http.middleware.RequestContext logs each request, with its id
        log_config=None,  # keep the root handlers configure_logging set up (text or JSON)
    )
    try:
        DrainingServer(config, app).run(sockets=None if sock is None else [sock])
    except SystemExit:
        if guarded.error is None:
            raise
        error = guarded.error
        if isinstance(error, StartupError):
            raise error from error.__cause__  # what it wraps stays for the debug traceback
        raise unexpected(error) from error
