"""Connection attacks with figures (RELIABILITY.md, "Hardening round 2 — connections"):

- idle: 200 sockets (idle, half-sent headers, half-sent bodies, idle keep-alive) — how many are
  still open after `--wait` seconds, and what `mha_requests_in_flight` says;
- cap: the server under a 256 open-file limit while 250 idle sockets are held — health-probe
  statuses and latency, and one inference request;
- stalled: 12 clients send 33 MB binary requests asking for JSON output and never read — the
  server's RSS before, at its peak and at the end, and health latency meanwhile.

`python -m benchmarks.attacks_connections [--only idle,cap,stalled]` prints one JSON object per
scenario. It uses only flags every version has, so it also measures an older checkout (copy this
file into it and run it from there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import numpy as np
import orjson

from benchmarks import scrape
from benchmarks.server import HOST, Proc, running

PATH = "/v2/models/mha/infer"
QUIET = ("--log-level", "warning")


def _connect(port: int, data: bytes = b"", rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((HOST, port))
    if data:
        sock.sendall(data)
    return sock


def _still_open(sock: socket.socket) -> bool:
    """False once the server has closed (or reset) the connection; drains what it sent."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(65536):
                return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def _metric(url: str, name: str) -> float | None:
    with contextlib.suppress(httpx.HTTPError, KeyError):
        return scrape.value(scrape.scrape(url, timeout=5), name)
    return None


def _probe(url: str, count: int, every: float = 0.0) -> dict:
    """`count` health probes on fresh connections: statuses (or error names) and latency."""
    statuses: Counter = Counter()
    latencies = []
    for _ in range(count):
        started = time.monotonic()
        try:
            statuses[str(httpx.get(f"{url}/v2/health/ready", timeout=2).status_code)] += 1
        except httpx.HTTPError as exc:
            statuses[type(exc).__name__] += 1
        latencies.append(time.monotonic() - started)
        time.sleep(every)
    return {
        "statuses": dict(statuses),
        "p50_ms": round(statistics.median(latencies) * 1000, 1),
        "max_ms": round(max(latencies) * 1000, 1),
    }


def scenario_idle(wait: float, args: tuple[str, ...]) -> dict:
    """200 held sockets: 50 each of idle, half headers, half body, idle keep-alive."""
    with running(*QUIET, *args) as server:
        socks = {
            "idle": [_connect(server.port) for _ in range(50)],
            "half_headers": [_connect(server.port, b"GET /v2/health/live HTTP/1.1\r\nHo")
                             for _ in range(50)],
            "half_body": [_connect(server.port, f"POST {PATH} HTTP/1.1\r\nHost: x\r\n"
                                   "Content-Length: 1000000\r\n\r\n{".encode())
                          for _ in range(50)],
            "keep_alive": [_connect(server.port, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                           for _ in range(50)],
        }  # fmt: skip
        time.sleep(1)
        in_flight_before = _metric(server.url, "mha_requests_in_flight")
        time.sleep(max(wait - 1, 0))
        result = {
            "scenario": "idle",
            "wait_s": wait,
            "open_after_wait": {k: sum(map(_still_open, v)) for k, v in socks.items()},
            "in_flight_at_1s": in_flight_before,
            "in_flight_after_wait": _metric(server.url, "mha_requests_in_flight"),
            "server_fds_after_wait": server.open_fds(),
        }
        for group in socks.values():
            for sock in group:
                sock.close()
    result["open_after_wait"]["total"] = sum(result["open_after_wait"].values())
    return result


@contextlib.contextmanager
def _fd_limit(soft: int) -> Iterator[None]:
    """Processes started inside inherit an open-file soft limit of `soft`."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def scenario_cap(args: tuple[str, ...], held: int = 250, fd_limit: int = 256) -> dict:
    """Health and inference while `held` idle sockets sit on a server limited to `fd_limit` fds."""
    stack = contextlib.ExitStack()
    with stack:
        with _fd_limit(fd_limit):
            server: Proc = stack.enter_context(running(*QUIET, *args, wait=False))
        server.wait_ready()
        socks = []
        for _ in range(held):
            try:
                socks.append(_connect(server.port))
            except OSError:
                break
        time.sleep(0.5)
        probes = _probe(server.url, 20, every=0.1)
        x = np.ones((1, 16, 512), np.float32)
        try:
            status = str(httpx.post(f"{server.url}{PATH}", timeout=5, json={
                "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                            "data": x.ravel().tolist()}]}).status_code)  # fmt: skip
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        result = {
            "scenario": "cap",
            "fd_limit": fd_limit,
            "sockets_held": len(socks),
            "still_open_after_probes": sum(map(_still_open, socks)),
            "health": probes,
            "inference": status,
        }
        for sock in socks:
            sock.close()
    return result


def _json_output_request(batch: int, seq_len: int) -> bytes:
    """A 33 MB binary request ((8, 2048, 512) float32) asking for its output as JSON."""
    x = np.random.default_rng(0).standard_normal((batch, seq_len, 512), np.float32)
    header = orjson.dumps({
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes}}],
        "outputs": [{"name": "output", "parameters": {"binary_data": False}}],
    })  # fmt: skip
    body = header + x.tobytes()
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\n"
        "Content-Type: application/octet-stream\r\n\r\n"
    )
    return head.encode() + body


def scenario_stalled(hold: float, args: tuple[str, ...], clients: int = 12) -> dict:
    """`clients` send 33 MB requests for JSON output and never read; RSS over `hold` seconds."""
    request = _json_output_request(8, 2048)
    with running(*QUIET, *args) as server:
        before = server.status("VmRSS")
        socks: list[socket.socket] = []

        def send() -> None:
            with contextlib.suppress(OSError):
                socks.append(_connect(server.port, request, rcvbuf=4096))

        senders = [threading.Thread(target=send) for _ in range(clients)]
        for thread in senders:
            thread.start()
        samples, health = [], []
        started = time.monotonic()
        while time.monotonic() - started < hold:
            samples.append(server.status("VmRSS"))
            health.append(_probe(server.url, 1)["max_ms"])
            time.sleep(0.5)
        for thread in senders:
            thread.join()
        result = {
            "scenario": "stalled",
            "clients": clients,
            "request_mb": round(len(request) / 1e6, 1),
            "hold_s": hold,
            "rss_mb_before": round(before / 1024),
            "rss_mb_peak": round(max(samples) / 1024),
            "rss_mb_end": round(samples[-1] / 1024),
            "rss_mb_every_10s": [round(r / 1024) for r in samples[::20]],
            "health_ms_p50": statistics.median(health),
            "health_ms_max": max(health),
            "clients_still_connected": sum(map(_still_open, socks)),
        }
        for sock in socks:
            sock.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="idle,cap,stalled")
    parser.add_argument("--wait", type=float, default=15.0, help="idle: seconds before counting")
    parser.add_argument("--hold", type=float, default=75.0, help="stalled: seconds to watch RSS")
    parser.add_argument("--held", type=int, default=250, help="cap: idle sockets to hold")
    parser.add_argument("--server-args", default="", help="extra flags for the server")
    opts = parser.parse_args()
    extra = tuple(opts.server_args.split())
    for name in opts.only.split(","):
        if name == "idle":
            result = scenario_idle(opts.wait, extra)
        elif name == "cap":
            result = scenario_cap(extra, opts.held)
        elif name == "stalled":
            result = scenario_stalled(opts.hold, extra)
        else:
            raise SystemExit(f"unknown scenario {name!r}; use idle, cap, stalled")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
