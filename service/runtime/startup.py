"""Start-up failures an operator fixes: one line naming the cause and the fix, and an exit
status per kind of failure, so scripts and orchestrators can tell them apart. The traceback is
logged at debug level only (--log-level debug).

Exit statuses (docs/deployment.md lists them too):
  2  invalid configuration: a flag or MHA_* value, the model repository's layout, --device/--dtype
  3  any other start-up failure (uvicorn's own status for a failed start)
  4  a port cannot be listened on: in use (HTTP --port, gRPC --grpc-port), privileged, foreign host
  5  a model directory is missing, or is not one (no config.json, or not valid JSON)
  6  a model fails to load: a weights or tokenizer file missing or invalid, weights that do not
     fit the config (mha_engine's message names the file), or any other error while loading
"""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.runtime.repository import ModelSource
    from service.runtime.settings import Settings

EXIT_CONFIG = 2
EXIT_STARTUP = 3
EXIT_PORT = 4
EXIT_MODEL_DIR = 5
EXIT_MODEL_LOAD = 6
STARTUP_STATUSES = frozenset(range(EXIT_CONFIG, EXIT_MODEL_LOAD + 1))  # 2 to 6

DEBUG_HINT = "--log-level debug shows the traceback"


class StartupError(Exception):
    """Why the server cannot start, in one line (cause and fix), with its exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def port_error(what: str, host: str, port: int, flags: str, exc: OSError) -> StartupError:
    """`what` ("HTTP", "gRPC") could not listen on host:port; `flags` names where it is set."""
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        message = (
            f"the {what} port {port} is already in use ({where}, {flags}): stop what listens "
            f"there (`ss -ltnp 'sport = :{port}'` shows it) or choose another port with {flags}"
        )
    elif exc.errno == errno.EACCES:
        message = (
            f"the {what} port {port} needs privileges ({where}, {flags}): choose a port above "
            f"1023 with {flags}"
        )
    elif exc.errno == errno.EADDRNOTAVAIL:
        message = (
            f"cannot listen for {what} on {host}: not an address of this machine "
            f"(--host / MHA_HOST{', --grpc-host' if what == 'gRPC' else ''}); use 0.0.0.0 or "
            f"127.0.0.1"
        )
    else:
        message = f"cannot listen for {what} on {where} ({flags}): {exc.strerror or exc}"
    return StartupError(message, EXIT_PORT)


HTTP_FLAGS = "--port / MHA_PORT"
GRPC_FLAGS = "--grpc-port / MHA_GRPC_PORT"


def _socket(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is fine
    return sock


def bind_http(settings: Settings) -> socket.socket:
    """The HTTP listening socket, bound before any model loads (so a busy port costs nothing
    and says so); StartupError naming the port and flag if it cannot be."""
    sock = _socket(settings.host)
    try:
        sock.bind((settings.host, settings.port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise port_error("HTTP", settings.host, settings.port, HTTP_FLAGS, exc) from None
    return sock


def check_grpc_port(settings: Settings) -> None:
    """Fail fast, before any model loads, if the gRPC port cannot be listened on. (The gRPC
    server binds it later, in the lifespan; a port taken in between fails there the same way.)"""
    if not settings.grpc_port:
        return
    host = settings.grpc_host or settings.host
    sock = _socket(host)
    try:
        sock.bind((host, settings.grpc_port))
    except OSError as exc:
        raise port_error("gRPC", host, settings.grpc_port, GRPC_FLAGS, exc) from None
    finally:
        sock.close()


def check_model_dirs(settings: Settings) -> None:
    """Each --model-dir exists, is a directory and has a readable config.json (every model
    directory has one); checked before anything loads."""
    for path in settings.model_dir:
        where = f"--model-dir / MHA_MODEL_DIR {path}"
        config = Path(path) / "config.json"
        if not Path(path).exists():
            problem = "does not exist"
        elif not Path(path).is_dir():
            problem = "is a file, not a model directory"
        elif not config.is_file():
            problem = "has no config.json, so it is not a model directory"
        else:
            try:
                json.loads(config.read_text())
                continue
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                problem = f"has a config.json that is not valid JSON ({exc})"
        raise StartupError(
            f"{where} {problem}: point it at a model directory (config.json and weights, as "
            f"mha_engine.save_model or transformers' save_pretrained write them)",
            EXIT_MODEL_DIR,
        )


def load_failure(source: ModelSource, exc: BaseException) -> StartupError:
    """A model that failed to load at start-up, in one line naming the model, its directory
    and what failed (mha_engine's CheckpointError names the file)."""
    from mha_engine import CheckpointError

    if isinstance(exc, StartupError):
        return exc
    where = f"model '{source.name}'" + (f" at {source.path}" if source.path else "")
    if isinstance(exc, CheckpointError):
        fix = f"fix the files in {source.path}" if source.path else "fix the model's files"
        return StartupError(f"{where} failed to load: {exc} ({fix})", EXIT_MODEL_LOAD)
    return StartupError(
        f"{where} failed to load: {type(exc).__name__}: {exc} ({DEBUG_HINT})", EXIT_MODEL_LOAD
    )


def unexpected(exc: BaseException) -> StartupError:
    """Any other failure while starting, still in one line."""
    return StartupError(
        f"start-up failed: {type(exc).__name__}: {exc} ({DEBUG_HINT})", EXIT_STARTUP
    )
