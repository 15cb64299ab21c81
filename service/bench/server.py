"""Start a server process on a free loopback port for benchmarks and reliability runs."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@dataclass
class Proc:
    """A running server: its port and process."""

    port: int
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def cpu_seconds(self) -> float:
        """utime + stime of the process (all threads), from /proc."""
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def status(self, key: str) -> int:
        """A numeric field of /proc/<pid>/status, e.g. VmRSS (kB) or Threads."""
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        raise KeyError(key)

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))


@contextlib.contextmanager
def running(*args: str, naive: bool = False, timeout: float = 120) -> Iterator[Proc]:
    """`python -m service ARGS` (or the naive baseline) until ready; SIGTERM and wait after."""
    port = free_port()
    if naive:
        cmd = [sys.executable, "-m", "service.bench.naive_server", "--port", str(port)]
        probe = f"http://{HOST}:{port}/docs"
    else:
        cmd = [sys.executable, "-m", "service", "--port", str(port), "--log-level", "warning"]
        cmd += args
        probe = f"http://{HOST}:{port}/v2/health/ready"
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(probe, timeout=2).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server {cmd} did not become ready ({process.returncode})")
            time.sleep(0.2)
        yield Proc(port, process)
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=60)
