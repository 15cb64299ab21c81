"""`mha-serve` / `python -m service`: parse flags and env vars, then run uvicorn.

Nothing here imports torch at module level: `main` sets the CPU threading defaults first
(`cpu_defaults`), since OpenMP and the tokenizers read them once, when they start.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
from typing import Any, NoReturn

from pydantic import ValidationError
from pydantic_settings import CliApp, CliSettingsSource

from service import __version__
from service.runtime.logs import configure_logging
from service.runtime.repository import SETTINGS_FILE, RepositoryError, model_settings, model_sources
from service.runtime.settings import Settings
from service.runtime.startup import (
    EXIT_CONFIG,
    StartupError,
    bind_http,
    check_grpc_port,
    check_model_dirs,
)
from service.runtime.trace_export import exporter_class

PROG = "mha-serve"

# Set unless the environment already sets them. PASSIVE: the engine's OpenMP threads sleep
# between batches instead of spinning for the next one (measured in BENCHMARKS.md, "Serving
# overhead"); TOKENIZERS_PARALLELISM=false: the tokenizer does not start a thread per core
# beside the engine's threads (requests are tokenized on the event loop or a worker thread).
CPU_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}


def cpu_defaults() -> None:
    """Put CPU_DEFAULTS in the environment where it does not set them; call before torch loads."""
    for key, value in CPU_DEFAULTS.items():
        os.environ.setdefault(key, value)


def serve(settings: Settings) -> None:
    """Run the server until SIGTERM; accepted requests are answered before exit. With
    --workers N > 1: an engine process and N front-end processes (service.workers)."""
    configure_logging(settings.log_level, settings.log_format, settings.access_log_probes)
    try:
        start(settings)
    except RepositoryError as exc:  # a bad repository, name clash, device or dtype
        _fail(StartupError(str(exc), EXIT_CONFIG))
    except StartupError as exc:  # a port, a model directory, a model that fails to load
        _fail(exc)


def start(settings: Settings) -> None:
    """Check what can be checked before any model loads (the repository, devices, model
    directories, both ports), then serve; a failure raises RepositoryError or StartupError."""
    check_devices(settings)
    check_model_dirs(settings)
    check_grpc_port(settings)
    check_tracing(settings)
    if settings.workers > 1:
        # By its importable name: run as `python -m service` this module is `__main__`, which a
        # spawned child cannot import a function from.
        from service.__main__ import run_frontend as frontend
        from service.workers.supervisor import supervise

        raise SystemExit(supervise(settings, frontend))
    listener = bind_http(settings)  # before the model loads: a busy port costs nothing
    from service.app import create_app
    from service.http.server import run_uvicorn, set_interop_threads

    set_interop_threads()
    run_uvicorn(settings, create_app(settings), sock=listener)


def check_tracing(settings: Settings) -> None:
    """--otlp-endpoint without the OpenTelemetry SDK installed: say how to install it."""
    if settings.otlp_endpoint:
        try:
            exporter_class(settings.otlp_protocol)
        except RuntimeError as exc:
            raise StartupError(str(exc), EXIT_CONFIG) from None


def _fail(exc: StartupError) -> NoReturn:
    """One line on stderr (cause and fix) and the failure's exit status; the traceback only
    at --log-level debug."""
    logging.getLogger("service").debug("start-up failed", exc_info=exc)
    print(f"{PROG}: error: {exc}", file=sys.stderr)
    raise SystemExit(exc.status) from None


def check_devices(settings: Settings) -> None:
    """Every model's device and dtype checked before anything starts: a device this host lacks
    (cuda:7 on a one-GPU host, cudaX, CUDA on a CPU build) or a dtype it cannot run raises
    RepositoryError naming the flag or settings file. Imports torch only when there is a choice
    to check (--workers' supervisor stays torch-free by default)."""
    for source in model_sources(settings):
        chosen = model_settings(settings, source)
        if chosen.device is None and chosen.dtype == "float32":
            continue  # auto device in float32: runs wherever torch does
        from mha_engine import DeviceError, check_device

        try:
            check_device(chosen.device, chosen.dtype)
        except DeviceError as exc:
            own = sorted({"device", "dtype"} & set(source.overrides))
            where = (
                f"model '{source.name}' {SETTINGS_FILE} ({', '.join(own)})"
                if own
                else "--device / --dtype (MHA_DEVICE / MHA_DTYPE)"
            )
            raise RepositoryError(f"{where}: {exc}") from None


def run_frontend(settings: Settings, listener: socket.socket, path: str, index: int) -> None:
    """A --workers front-end process: the app, its models in the engine process at `path`,
    served on the listening socket the supervisor bound."""
    configure_logging(settings.log_level, settings.log_format, settings.access_log_probes)
    import torch

    torch.set_num_threads(1)  # a front-end never computes: no OpenMP pool per front-end
    from service.app import create_app
    from service.http.server import run_uvicorn
    from service.workers.link import EngineLink

    link = EngineLink(path, index, settings.worker_slab_bytes)
    run_uvicorn(settings, create_app(settings, engine=link), sock=listener)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) and plain metavars (PATH, not {Path,null})."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see {PROG} --help)\n")


def _add_argument(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> Any:
    metavar = kwargs.get("metavar")
    if isinstance(metavar, str) and not kwargs.get("choices"):
        kinds = re.sub(r"[{}]|^list\[|\]$", "", metavar).split(",")  # list[Path]: a repeated PATH
        plain = [k for k in kinds if k != "null"]
        if len(plain) == 1:  # "{Path,null}" -> PATH; a choice list stays as it is
            kwargs["metavar"] = {"SecretStr": "TEXT", "str": "TEXT"}.get(plain[0], plain[0]).upper()
        elif metavar.startswith("{{") and metavar.endswith("},null}"):  # an optional choice
            kwargs["metavar"] = metavar[1 : -len(",null}")]  # "{{A,B},null}" -> "{A,B}"
    if isinstance(kwargs.get("help"), str):  # pydantic's "null" is JSON, not what a user types
        kwargs["help"] = (
            kwargs["help"]
            .replace("(default: null)", "(default: unset)")
            .replace("(default factory: list)", "(default: unset)")
        )
    return parser.add_argument(*names, **kwargs)


def _explain(exc: ValidationError) -> str:
    """One line per bad value: the flag, its env var, what was given and what is wanted."""
    lines = []
    for error in exc.errors():
        if not error["loc"]:  # a check across fields: its message names the flags already
            lines.append(f"{PROG}: error: {error['msg'].removeprefix('Value error, ')}")
            continue
        field = str(error["loc"][0])
        flag, env = "--" + field.replace("_", "-"), "MHA_" + field.upper()
        lines.append(
            f"{PROG}: error: {flag} / {env}: {error['input']!r} is not valid: "
            f"{error['msg'].lower()} (see {PROG} --help)"
        )
    return "\n".join(lines)


def parse_settings(argv: list[str] | None = None) -> Settings:
    """Settings from flags and MHA_* env vars; a bad value exits 2 with one line, no traceback."""
    parser = _Parser(prog=PROG, description=Settings.__doc__)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    source = CliSettingsSource(Settings, root_parser=parser, add_argument_method=_add_argument)
    try:
        return CliApp.run(Settings, cli_args=argv, cli_settings_source=source)
    except ValidationError as exc:
        print(_explain(exc), file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    cpu_defaults()
    serve(parse_settings(argv))


if __name__ == "__main__":
    main()
