"""`mha-serve` / `python -m service`: parse flags and env vars, then run uvicorn."""

from __future__ import annotations

import signal
from types import FrameType

import uvicorn
from pydantic_settings import CliApp

from service.app import create_app
from service.logs import configure_logging
from service.settings import Settings


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


def serve(settings: Settings) -> None:
    """Run the server until SIGTERM; accepted requests are answered before exit."""
    configure_logging(settings.log_level, settings.log_format)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # At the end of the grace, queued work is answered 503 (ServiceState.end_grace) and the
        # running forward finishes, so connections close by grace + one forward; uvicorn's own
        # cut-off (which would answer 500) is only a backstop for clients still sending bodies.
        timeout_graceful_shutdown=settings.drain_grace_s + settings.request_timeout_s,
        access_log=False,  # service.middleware.RequestContext logs each request, with its id
        log_config=None,  # keep the root handlers configure_logging set up (text or JSON)
    )
    DrainingServer(config, app).run()


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    serve(CliApp.run(Settings, cli_args=argv))


if __name__ == "__main__":
    main()
