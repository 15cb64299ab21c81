"""A fork server for the suite's `python -m service` processes: torch and the service imported
once, each server a fork of that process running `service.__main__.main(argv)`.

A fresh interpreter spends ~3.5 of a test server's ~5 s start importing torch, FastAPI and grpc
(on a 2-core CI machine, ~85 starts). A forked server is still a real process: its own pid,
uvicorn on a loopback socket, signals, exit status, log file. Servers whose interpreter start
matters are launched fresh: `--workers`, another source tree, or an environment that differs
from the fork server's in a variable outside LATE_KEYS. MHA_TEST_FRESH_SERVERS=1 launches
every server fresh.

Run as `python -m tests.zygote` by `Zygote`: requests are JSON lines on stdin ({"argv", "env",
"log"}), answers JSON lines on stdout ({"pid"} per fork, {"exited", "code"} per child reaped).
When stdin closes (the test process ended, however), it stops its children and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from service.workers.supervisor import PRELOAD as WORKER_PRELOAD

PRELOAD = [*WORKER_PRELOAD, "grpc", "service.app"]  # what --workers' fork server imports, and more
# Environment variables a fork may set differently from the fork server: read when the server
# parses its settings, by packages the fork server has not imported (tests/test_zygote.py), or
# (TMPDIR) found again in the fork.
LATE_KEYS = (
    "MHA_", "OTEL_", "PYTEST_", "HF_", "TRANSFORMERS_", "TORCHINDUCTOR_", "_TORCHINDUCTOR_",
    "TMPDIR",
)  # fmt: skip
NOT_PRELOADED = ["huggingface_hub", "transformers", "tokenizers", "torch._inductor"]
LOST = -255  # the exit status of a child whose fork server died before reporting it


# -- the fork server (its own process) ---------------------------------------------------------
def _serve_child(request: dict) -> None:
    """In the forked child: the request's log on stdout/stderr, its environment, then the
    server's own entry point; never returns."""
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # found again, from this TMPDIR
        from service import __main__ as entry

        sys.argv = [entry.__file__, *request["argv"]]  # as `python -m service` sets it
        entry.main(request["argv"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # as an interpreter's exit would
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The fork server's loop: fork per request, report every child's exit."""
    from service.__main__ import cpu_defaults

    cpu_defaults()  # before torch loads, as `python -m service` does
    for name in PRELOAD:
        importlib.import_module(name)
    children: set[int] = set()
    out = sys.stdout.buffer

    def answer(message: dict) -> None:
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()

    answer({"ready": True, "loaded": [name for name in NOT_PRELOADED if name in sys.modules]})
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            children.discard(pid)
            answer({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the test process is gone: so are its servers
            _stop(children)
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                _serve_child(json.loads(line))
            children.add(pid)
            answer({"pid": pid})


def _stop(children: set[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while children and time.monotonic() < deadline:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid:
                children.discard(pid)
            else:
                time.sleep(0.05)


# -- the test process's side -------------------------------------------------------------------
class ForkedProcess:
    """A forked server, read and signalled like a subprocess.Popen (pid, poll, wait,
    send_signal, terminate, kill, returncode); signals go through a pidfd, so a recycled pid
    is never signalled."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, self._pidfd, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, self._pidfd, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            os.close(self._pidfd)


class Zygote:
    """The test process's handle on one fork server, started on first use."""

    def __init__(self, root: Path) -> None:
        launched = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"],
            cwd=root,
            env=launched,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.env = _with_defaults(launched)  # what its forks' environments are compared with
        self._lock = threading.Lock()  # one fork request at a time
        self._changed = threading.Condition()
        self._forked: list[int] = []
        self._exits: dict[int, int] = {}
        self.dead = False  # its stdout ended: it reports no more exits
        first = json.loads(self.process.stdout.readline() or b"{}")
        if first.get("ready") is not True:
            raise RuntimeError(f"the test fork server did not start (exit {self.process.wait()})")
        self.loaded: list[str] = first["loaded"]  # of NOT_PRELOADED: should stay empty
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()
        atexit.register(self.close)

    def can_fork(self, env: dict[str, str]) -> bool:
        """Whether a server with this environment starts the same forked as fresh."""
        env = _with_defaults(env)
        keys = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return all(k.startswith(LATE_KEYS) for k in keys)

    def fork(self, argv: list[str], env: dict[str, str], log_path: str) -> ForkedProcess:
        request = json.dumps({"argv": argv, "env": env, "log": log_path}).encode() + b"\n"
        with self._lock, self._changed:
            self.process.stdin.write(request)
            self.process.stdin.flush()
            if not self._changed.wait_for(lambda: self._forked, timeout=30):
                raise RuntimeError("the test fork server did not answer a fork request")
            pid = self._forked.pop()
        return ForkedProcess(self, pid, ["python", "-m", "service", *argv])

    def exit_code(self, pid: int, pidfd: int, timeout: float | None) -> int | None:
        """The child's exit status as the fork server reported it; None while it runs. Should
        the fork server die first, the child's pidfd still says when it ends: LOST then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self.dead, timeout=timeout)
            if pid in self._exits or not self.dead:
                return self._exits.get(pid)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ended, _, _ = select.select([pidfd], [], [], left)
        return LOST if ended else None

    def close(self) -> None:
        """Close its stdin: it stops what still runs and exits."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)

    def _read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            with self._changed:
                if "pid" in message:
                    self._forked.append(message["pid"])
                else:
                    self._exits[message["exited"]] = message["code"]
                self._changed.notify_all()
        with self._changed:
            self.dead = True
            self._changed.notify_all()


def _with_defaults(env: dict[str, str]) -> dict[str, str]:
    """`env` as the server sees it once `cpu_defaults` has run."""
    from service.__main__ import CPU_DEFAULTS

    return {**CPU_DEFAULTS, **env}


_zygote: Zygote | None = None
_start_lock = threading.Lock()


def zygote(root: Path) -> Zygote | None:
    """The suite's fork server (started on first use), or None where servers start fresh."""
    global _zygote
    if os.environ.get("MHA_TEST_FRESH_SERVERS") == "1":
        return None
    with _start_lock:
        if _zygote is None or _zygote.dead:
            _zygote = Zygote(root)
        return _zygote


if __name__ == "__main__":
    serve()
