"""What a request's bytes cost any Python front-end on this machine, beside what ours costs.

`python -m benchmarks.frontend_floor [--rounds 3] [--seconds 4]` (under `flock
/work/bench.lock`): for request/response bodies of the sizes issue 25 measures (MHA(16, 2) at
T=1, MHA(512, 8) at T=16 and T=128, Triton binary tensors), three servers in turn, a fresh
process each, the order rotated every round, 32 closed-loop keep-alive clients:

- `raw`: an asyncio protocol on uvloop that finds the body by Content-Length and answers with
  a body of the output's size in one write: sockets, the event loop and a minimal HTTP parse,
  no framework (the floor for a Python process);
- `uvicorn`: uvicorn (httptools, uvloop, no access log) with a bare ASGI app that reads the
  body and sends a response of that size: the floor for an ASGI front-end;
- `mha-serve`: `python -m service` serving the model (fast path, defaults).

Reported per request, medians over rounds: server CPU split into user and kernel (sys) time
from /proc (the client's CPU is not counted), and requests/s. The difference between rows is
what each layer costs; for `mha-serve` it includes the engine's forward (its batches).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.client import run_load
from benchmarks.server import HOST, ROOT, free_port, running
from benchmarks.serving import MHA_PATH, request, save_mha

SIZES = (  # name, embed_dim, num_heads, tokens
    ("MHA(16, 2) T=1", 16, 2, 1),
    ("MHA(512, 8) T=16", 512, 8, 16),
    ("MHA(512, 8) T=128", 512, 8, 128),
)
SERVERS = ("raw", "uvicorn", "mha-serve")
TICK = os.sysconf("SC_CLK_TCK")


class RawProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, Content-Length bodies only; answers `reply` bytes per request."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.buffer = bytearray()
        self.need: int | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            if self.need is None:
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buffer[:end]).lower()
                at = head.find(b"content-length:")
                size = int(head[at + 15 : head.find(b"\r\n", at)]) if at >= 0 else 0
                self.need = end + 4 + size
            if len(self.buffer) < self.need:
                return
            del self.buffer[: self.need]
            self.need = None
            self.transport.write(self.reply)


def serve_raw(port: int, reply_bytes: int) -> None:
    import uvloop

    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
    reply = head + b"content-length: %d\r\n\r\n" % reply_bytes + bytes(reply_bytes)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        await loop.create_server(lambda: RawProtocol(reply), HOST, port)
        await asyncio.Event().wait()

    uvloop.run(main())


def serve_uvicorn(port: int, reply_bytes: int) -> None:
    import uvicorn

    body = bytes(reply_bytes)
    headers = [(b"content-type", b"application/octet-stream"),
               (b"content-length", str(reply_bytes).encode())]  # fmt: skip

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    uvicorn.run(app, host=HOST, port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False)  # fmt: skip


def cpu(pid: int) -> tuple[float, float]:
    """(user, sys) seconds of a process, all threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def measure(pid: int, port: int, body: bytes, headers: dict, args) -> dict:
    asyncio.run(run_load(HOST, port, MHA_PATH, body, headers, args.clients, 1.0, 0.0))  # warm
    before = cpu(pid)
    result = asyncio.run(run_load(HOST, port, MHA_PATH, body, headers, args.clients,
                                  args.seconds, 0.0))  # fmt: skip
    after = cpu(pid)
    n = max(result.completed, 1)
    return {
        "req_s": result.rps,
        "user_ms": (after[0] - before[0]) / n * 1e3,
        "sys_ms": (after[1] - before[1]) / n * 1e3,
    }


def floor_server(kind: str, reply_bytes: int, body: bytes, headers: dict, args) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.frontend_floor", "--serve", kind,
           "--port", str(port), "--reply-bytes", str(reply_bytes)]  # fmt: skip
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:  # until it accepts connections
            try:
                asyncio.run(asyncio.wait_for(asyncio.open_connection(HOST, port), 1))
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{kind} server did not start") from None
                time.sleep(0.1)
        return measure(process.pid, port, body, headers, args)
    finally:
        process.kill()
        process.wait()


def run(args) -> list[dict]:
    rows: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name, embed_dim, num_heads, _ in SIZES:
            where = Path(tmp) / f"{embed_dim}-{num_heads}"
            where.mkdir(exist_ok=True)
            models[name] = save_mha(where, embed_dim, num_heads)
        for round_ in range(args.rounds):
            order = SERVERS[round_ % 3 :] + SERVERS[: round_ % 3]
            for name, embed_dim, _, tokens in SIZES:
                body, headers = request("binary", tokens, embed_dim)
                out_bytes = tokens * embed_dim * 4
                for kind in order:
                    if kind == "mha-serve":
                        with running("--model-dir", str(models[name])) as server:
                            got = measure(server.process.pid, server.port, body, headers, args)
                    else:
                        got = floor_server(kind, out_bytes, body, headers, args)
                    rows.setdefault((name, kind), []).append(got)
                    print(name, kind, {k: round(v, 4) for k, v in got.items()}, flush=True)
    return [
        {"case": name, "server": kind, "rounds": len(found),
         **{k: statistics.median(r[k] for r in found) for k in ("req_s", "user_ms", "sys_ms")}}
        for (name, kind), found in rows.items()
    ]  # fmt: skip


def print_table(rows: list[dict]) -> None:
    print(f"\ndate: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
          f"{os.cpu_count()} cores, load avg {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("\n| case | server | req/s | server CPU ms/req | user | sys |")
    print("|---|---|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: ([s[0] for s in SIZES].index(r["case"]),
                                         SERVERS.index(r["server"]))):  # fmt: skip
        total = r["user_ms"] + r["sys_ms"]
        print(f"| {r['case']} | {r['server']} | {r['req_s']:,.0f} | {total:.3f} | "
              f"{r['user_ms']:.3f} | {r['sys_ms']:.3f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--serve", choices=("raw", "uvicorn"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--reply-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "raw":
        serve_raw(args.port, args.reply_bytes)
    elif args.serve == "uvicorn":
        serve_uvicorn(args.port, args.reply_bytes)
    else:
        print_table(run(args))


if __name__ == "__main__":
    main()
