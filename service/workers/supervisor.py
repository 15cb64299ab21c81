"""`--workers N > 1`: the supervisor starts one engine process and N front-end processes,
restarts whichever dies, and on SIGTERM drains them all.

    supervisor (this process: no torch, no model)
      |-- fork server   multiprocessing's; imports PRELOAD (torch...) once, forks the others
            |-- engine      models, batchers, engine threads; Unix socket in a private 0700 dir
            |-- front-end 0 ┐ uvicorn (+ gRPC) on the one listening socket the supervisor
            |-- ...         ┘ bound; decode, validate, tokenize, encode; tensors via memfd slab

The supervisor still starts, watches and stops each child (multiprocessing routes it through the
fork server); `--worker-start spawn` makes each a fresh interpreter, the supervisor's child.

The listening socket is bound here once (so port 0 resolves once) and inherited: the kernel
hands each new connection to whichever front-end accepts first. Metrics go through
prometheus_client's multiprocess directory (PROMETHEUS_MULTIPROC_DIR, private to this run), so
any front-end's /metrics shows the whole server.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.runtime.logs import configure_logging
from service.runtime.settings import Settings
from service.runtime.startup import EXIT_STARTUP, STARTUP_STATUSES, StartupError, bind_http

log = logging.getLogger("service.workers")

QUICK_EXIT_S = 10.0  # a process that dies sooner than this after starting is crash-looping
MAX_BACKOFF_S = 10.0
# Imported once, in the fork server. Nothing here may create a prometheus_client metric (its
# value files would carry the fork server's pid) or touch CUDA (a forked CUDA runtime is unusable).
PRELOAD = ["torch", "mha_engine", "numpy", "fastapi", "uvicorn"]


def engine_main(settings: Settings, path: str) -> None:
    """Target of the engine process; it creates its socket at `path` once it serves."""
    configure_logging(settings.log_level, settings.log_format, settings.access_log_probes)
    from service.workers import engine

    engine.run(settings, path)


@dataclass
class Child:
    """One supervised process slot: what to start, the running process, its restart pace."""

    name: str
    target: Any
    args: tuple
    process: Any = None
    started_at: float = 0.0
    backoff_s: float = 0.5
    restart_at: float | None = None
    restarts: int = field(default=0)

    def start(self, context: Any) -> None:
        self.process = context.Process(target=self.target, args=self.args, name=self.name)
        self.process.start()
        self.started_at = time.monotonic()
        self.restart_at = None
        log.info("started %s (pid %d)", self.name, self.process.pid)


def _context(settings: Settings) -> Any:
    """With --worker-start forkserver, children fork from a process that imported PRELOAD once
    (torch is most of a process's start) rather than each importing it again."""
    context = multiprocessing.get_context(settings.worker_start)
    if settings.worker_start == "forkserver":
        context.set_forkserver_preload(PRELOAD)
    return context


def _bind(settings: Settings) -> socket.socket:
    sock = bind_http(settings)  # StartupError, in one line, if the port is taken
    sock.set_inheritable(True)
    return sock


def supervise(settings: Settings, frontend_main: Callable[..., None]) -> int:
    """Run the engine and the front-ends until SIGTERM/SIGINT; the exit status.
    `frontend_main(settings, listener, engine_path, index)` runs a front-end process (the
    composition root's, service.__main__.run_frontend: it builds the app)."""
    if not sys.platform.startswith("linux"):
        log.error("--workers > 1 needs Linux (memfd shared memory); use --workers 1")
        return 2
    workdir = tempfile.mkdtemp(prefix="mha-serve-")  # 0700: the engine socket and metrics
    metrics_dir = os.path.join(workdir, "metrics")
    os.mkdir(metrics_dir)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before any child imports the client
    from service.runtime.exposition import mark_process_dead  # after the env var: multiprocess

    path = os.path.join(workdir, "engine.sock")
    try:
        listener = _bind(settings)
    except StartupError:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    host, port = listener.getsockname()[:2]
    context = _context(settings)
    # Whether an engine ever served: its socket exists. (Not a multiprocessing.Event: that is
    # named semaphores in /dev/shm, which a killed supervisor would leave behind.)
    engine_served = False
    engine = Child("mha-engine", engine_main, (settings, path))
    frontends = [
        Child(f"mha-frontend-{i}", frontend_main, (settings, listener, path, i))
        for i in range(settings.workers)
    ]
    children = [engine, *frontends]
    stop: list[int] = []

    def on_signal(sig: int, _frame: Any) -> None:
        stop.append(sig)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    log.info(
        "mha-serve on http://%s:%d: 1 engine process and %d front-ends (supervisor pid %d)",
        host, port, settings.workers, os.getpid(),
    )  # fmt: skip
    try:
        for child in children:
            child.start(context)
        while not stop:
            _watch(children, context, mark_process_dead, stop)
            engine_served = engine_served or os.path.exists(path)
            if engine.restart_at is not None and not engine_served:
                # It never came up (a model that does not load, no memory): restarting would
                # only repeat it. Stop, as one process would.
                log.error("the engine process failed before it could serve; stopping")
                _drain(settings, engine, frontends, mark_process_dead)
                # Its own status when it said why (a model that fails to load: 6), else 3.
                code = engine.process.exitcode if engine.process is not None else None
                return code if code in STARTUP_STATUSES else EXIT_STARTUP
        log.info("stopping: draining %d front-ends and the engine", len(frontends))
        # Nothing restarts now: let go of the listening socket, so that once the front-ends
        # close theirs new connections are refused (as by one process), not left in the backlog.
        listener.close()
        _drain(settings, engine, frontends, mark_process_dead)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in children:  # only on an error above: _drain leaves none alive
            if child.process is not None and child.process.is_alive():
                child.process.kill()
                child.process.join(5)
        listener.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _watch(children: list[Child], context: Any, mark_dead: Any, stop: list[int]) -> None:
    """Wait a little for a child to exit; restart the dead ones (backing off when they die
    right after starting)."""
    now = time.monotonic()
    due = [c.restart_at for c in children if c.restart_at is not None]
    timeout = max(0.0, min([*due, now + 0.5]) - now)
    sentinels = [c.process.sentinel for c in children if c.restart_at is None]
    multiprocessing.connection.wait(sentinels, timeout)
    if stop:  # a signal to the whole group stops the children too: that is no crash
        return
    now = time.monotonic()
    for child in children:
        if child.restart_at is None and not child.process.is_alive():
            code = child.process.exitcode
            mark_dead(child.process.pid)
            quick = now - child.started_at < QUICK_EXIT_S
            child.backoff_s = min(MAX_BACKOFF_S, child.backoff_s * 2) if quick else 0.5
            child.restart_at = now + child.backoff_s
            child.restarts += 1
            log.error(
                "%s (pid %d) exited with %s; restarting in %.1f s",
                child.name, child.process.pid, code, child.backoff_s,
            )  # fmt: skip
        elif child.restart_at is not None and now >= child.restart_at:
            child.start(context)


def _drain(settings: Settings, engine: Child, frontends: list[Child], mark_dead: Any) -> None:
    """SIGTERM to all: front-ends stop accepting and finish their requests (the engine serves
    them until they disconnect, shedding its queue with 503 when the grace ends), then the
    engine exits. Past grace + request timeout + 10 s, whatever is left is killed."""
    for child in [*frontends, engine]:
        if child.process.is_alive():
            child.process.terminate()
    deadline = time.monotonic() + settings.drain_grace_s + settings.request_timeout_s + 10
    for child in [*frontends, engine]:
        child.process.join(max(0.0, deadline - time.monotonic()))
        if child.process.is_alive():
            log.error("%s did not stop in time; killing it", child.name)
            child.process.kill()
            child.process.join(5)
        mark_dead(child.process.pid)
