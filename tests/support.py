"""Test support: real `mha-serve` processes on loopback, metric reading, OIP schema checks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import yaml

from benchmarks import scrape
from benchmarks.client import binary_infer_body
from benchmarks.server import ROOT, Proc, free_port, running, tree_cpu
from tests.zygote import zygote

__all__ = [
    "FP32_TOL", "ROOT", "Server", "binary_output", "free_port", "output_of", "run_server",
    "wait_for",
]  # fmt: skip
FP32_TOL = {"atol": 1e-5, "rtol": 1.3e-6}  # PyTorch's own fp32 tolerances
OIP_SPEC = ROOT.parent / "shared" / "oip" / "open_inference_rest.yaml"


class Server(Proc):
    """A running `python -m service` process, with its /metrics readable by name."""

    def metrics(self) -> str:
        return scrape.scrape(self.url)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (KeyError if none)."""
        return scrape.value(self.metrics(), name, **labels)


@contextlib.contextmanager
def run_server(
    tmp_dir: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True
) -> Iterator[Server]:
    """`python -m service ARGS` on a free loopback port, logging to `tmp_dir`; stopped after."""
    log_path = tmp_dir / f"server-{time.monotonic_ns()}.log"
    with running(*args, log_path=log_path, env=env, wait=wait, launch=forked) as proc:
        yield Server(proc.port, proc.process, proc.log_path)


def forked(argv: list[str], env: dict[str, str], log_path: Path) -> Any:
    """A fork of the suite's fork server (tests/zygote.py) where that starts the same server as
    a fresh `python -m service` would; None (start it fresh) otherwise, and for --workers."""
    workers = any(a.startswith("--workers") for a in argv) or "MHA_WORKERS" in env
    fork_server = None if workers else zygote(ROOT)
    if fork_server is None or not fork_server.can_fork(env):
        return None
    return fork_server.fork(argv, env, str(log_path))


def oip_schemas() -> dict:
    """The Open Inference Protocol's component schemas (../shared beside the repo)."""
    if not OIP_SPEC.exists():
        raise FileNotFoundError(f"OIP spec missing at {OIP_SPEC}; shared/ must sit beside the repo")
    return yaml.safe_load(OIP_SPEC.read_text())["components"]["schemas"]


def validate_oip(name: str, instance: object) -> None:
    """Validate `instance` against components.schemas[name] of the OIP REST document."""
    schemas = oip_schemas()
    root = {"components": {"schemas": schemas}, "$ref": f"#/components/schemas/{name}"}
    jsonschema.validate(instance, root)


def binary_request(header: dict, *chunks: bytes) -> tuple[bytes, dict[str, str]]:
    """A Triton binary-extension body: JSON header then raw tensor bytes."""
    import json

    head = json.dumps(header).encode()
    return head + b"".join(chunks), {
        "Inference-Header-Content-Length": str(len(head)),
        "Content-Type": "application/octet-stream",
    }


fp32_request = binary_infer_body  # the binary OIP request the tests send


# -- `--workers N` servers: their processes, shared memory and sockets, from /proc ------------
def child_pids(pid: int) -> set[int]:
    """The live direct children of `pid` (/proc/<pid>/task/*/children)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found.update(int(p) for p in (task / "children").read_text().split())
    return found


def descendant_pids(pid: int) -> set[int]:
    """The live descendants of `pid`: a --workers server's fork server, resource tracker, engine
    and front-ends (the last two are the fork server's children)."""
    return set(tree_cpu(pid)) - {pid}


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def worker_pids(server: Server) -> dict[str, int]:
    """The supervisor's latest 'started NAME (pid N)' per child: mha-engine, mha-frontend-I."""
    started = re.findall(r"started (mha-[\w-]+) \(pid (\d+)\)", server.log())
    return {name: int(pid) for name, pid in started}


def slab_inodes(pid: int) -> set[int]:
    """Inodes of the memfd slabs (`memfd:mha-serve-slab`) mapped into process `pid`."""
    inodes = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if "memfd:mha-serve-slab" in line:
                inodes.add(int(line.split()[4]))
    return inodes


def _tcp_sockets() -> list[tuple[int, int, str, int, int]]:
    """(local port, remote port, state, rx_queue, inode) of every TCP socket (IPv4 and IPv6)."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            local, remote = (int(a.rsplit(":", 1)[1], 16) for a in f[1:3])
            rows.append((local, remote, f[3], int(f[4].split(":")[1], 16), int(f[9])))
    return rows


def listening_inodes(port: int) -> set[int]:
    """Inodes of the sockets listening on TCP `port`."""
    sockets = _tcp_sockets()
    return {inode for local, _, state, _, inode in sockets if local == port and state == "0A"}


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds open."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def serving_pid(server_port: int, client_port: int, pids: Iterable[int]) -> int | None:
    """Which of `pids` accepted the client connection from `client_port`, and has read all it
    was sent (None: not accepted by any, or bytes still unread in its receive queue)."""
    for local, remote, _, rx, inode in _tcp_sockets():
        if local == server_port and remote == client_port and inode and rx == 0:
            for pid in pids:
                if inode in socket_inodes(pid):
                    return pid
    return None


def binary_output(content: bytes, headers: Mapping[str, Any]) -> np.ndarray:
    """The float32 'output' tensor of a binary OIP response body (a copy: writable)."""
    length = int(headers["Inference-Header-Content-Length"])
    (out,) = json.loads(content[:length])["outputs"]
    return np.frombuffer(content[length:], np.float32).reshape(out["shape"]).copy()


def output_of(response: Any) -> np.ndarray:
    """The float32 'output' of a binary httpx response, which must be a 200."""
    assert response.status_code == 200, response.text
    return binary_output(response.content, response.headers)


def wait_for(
    check: Callable[[], object], what: str = "the condition", timeout: float = 20
) -> object:
    """Poll `check()` until truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.01)
    return result
