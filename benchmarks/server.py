"""Start `python -m service` on a free loopback port: for benchmarks, the sweep and the tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[1]


_handed_out: set[int] = set()
TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int | str, thread: int | None = None) -> tuple[float, float]:
    """(user, sys) CPU seconds of process `pid` (all its threads; "self" for this one), or of
    one of its threads, from /proc."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def tree_cpu(root: int) -> dict[int, float]:
    """pid -> CPU seconds of `root` and every live descendant (a scan of /proc by parent pid,
    so no psutil is needed and nothing depends on CONFIG_PROC_CHILDREN)."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
                stats[int(name)] = int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    out, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in stats:
            out[pid] = stats[pid][1]
            frontier += children.get(pid, [])
    return out


def free_port() -> int:
    """A loopback port nothing listens on now, never the same one twice in this process: two
    sockets bound to port 0 one after the other can get the same number (a test once got its
    gRPC and HTTP ports equal, and the server could not bind both)."""
    while True:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


# (argv after `python -m service`, environment, log file) -> a Popen-like process, or None
Launcher = Callable[[list[str], dict[str, str], Path], "subprocess.Popen | None"]


@dataclass
class Proc:
    """A running server: its port, process and (when asked for) log file."""

    port: int
    process: subprocess.Popen
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def cpu_seconds(self) -> float:
        """utime + stime of the process (all threads), from /proc."""
        return sum(proc_cpu(self.process.pid))

    def tree_cpu_seconds(self) -> float:
        """utime + stime of the process and every process below it (`--workers`: the engine
        and the front-ends, which the supervisor's own figure leaves out)."""
        return sum(tree_cpu(self.process.pid).values())

    def main_thread_cpu_seconds(self) -> float:
        """utime + stime of the main thread alone (the event loop of `python -m service`)."""
        return sum(proc_cpu(self.process.pid, self.process.pid))

    def status(self, key: str) -> int:
        """A numeric field of /proc/<pid>/status, e.g. VmRSS (kB) or Threads."""
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        raise KeyError(key)

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def wait_ready(self, probe: str = "/v2/health/ready", timeout: float = 120) -> None:
        """Poll `probe` until it answers 200; raise with the log if the process dies first."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}{probe}", timeout=2).status_code == 200:
                    return
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")
            time.sleep(0.2)


@contextlib.contextmanager
def running(
    *args: str,
    naive: bool = False,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    wait: bool = True,
    root: Path = ROOT,
    launch: Launcher | None = None,
) -> Iterator[Proc]:
    """`python -m service ARGS` (or the naive baseline) until ready; SIGTERM, then SIGKILL, after.

    Output goes to `log_path` when given (else it is discarded). `root` is the source tree to
    run (another checkout, e.g. to measure the code before a fix). `launch(argv, env,
    log_path)` may start the server another way (the tests' fork server) or return None.
    """
    port = free_port()
    if naive:
        cmd = [sys.executable, "-m", "benchmarks.naive_server", "--port", str(port)]
    else:
        argv = ["--host", HOST, "--port", str(port), *args]
        cmd = [sys.executable, "-m", "service", *argv]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    # No gRPC listener on the default 8001 unless asked (--grpc-port wins over the variable):
    # two servers at once (benchmarks.text_models) would otherwise collide there.
    full_env.setdefault("MHA_GRPC_PORT", "0")
    if root != ROOT:
        full_env["PYTHONPATH"] = str(root)
    process = None
    if launch and not naive and root == ROOT and log_path:
        process = launch(argv, full_env, log_path)
    if process is None:
        with open(log_path, "wb") if log_path else open(os.devnull, "wb") as log_file:
            process = subprocess.Popen(
                cmd, cwd=root, env=full_env, stdout=log_file, stderr=subprocess.STDOUT
            )
    server = Proc(port, process, log_path)
    try:
        if wait:
            server.wait_ready("/docs" if naive else "/v2/health/ready")
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
