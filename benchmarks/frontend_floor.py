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
- `mha-serve`: `python -m service` serving the model (fast path, defaults);
- `in process`: the same app called through ASGI inside one process (lifespan, batcher and
  engine thread as served; no sockets, no uvicorn, no client beside it), 32 requests in
  flight: what the request path's own Python costs.

Reported per request, medians over rounds: CPU split into user and kernel (sys) time from
/proc, and the event loop's thread alone (the client's CPU is not counted; in process, the
callers' own Python is in the event loop's figure), and requests/s. The difference between
rows is what each layer costs; `mha-serve` and `in process` include the engine's forward. For
those two, the mean batch the engine formed and its mean wall time
(`mha_batch_compute_seconds`), and the same batch through `run_batch` in a process where no
other thread is busy: the engine thread shares the GIL with the event loop, and every torch
call hands it over (`benchmarks.gil_handoff`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import scrape
from benchmarks.client import run_load
from benchmarks.server import HOST, ROOT, free_port, proc_cpu, running
from benchmarks.serving import MHA_PATH, request, save_mha

SIZES = (  # name, embed_dim, num_heads, tokens
    ("MHA(16, 2) T=1", 16, 2, 1),
    ("MHA(512, 8) T=16", 512, 8, 16),
    ("MHA(512, 8) T=128", 512, 8, 128),
)
SERVERS = ("raw", "uvicorn", "mha-serve", "in process")


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


def batches(before: str, after: str) -> dict:
    """Mean batch (sequences) and mean batch wall time (ms) between two /metrics texts."""

    def delta(name: str) -> float:
        return scrape.value(after, name, default=0.0) - scrape.value(before, name, default=0.0)

    count = max(delta("mha_batch_compute_seconds_count"), 1)
    return {
        "batch": delta("mha_batch_size_sequences_sum") / count,
        "batch_ms": delta("mha_batch_compute_seconds_sum") / count * 1e3,
    }


def measure(pid: int, port: int, body: bytes, headers: dict, args, metrics: bool = False) -> dict:
    """Load a running server; its CPU per request (process, and the main thread: the loop)."""
    url = f"http://{HOST}:{port}"
    asyncio.run(run_load(HOST, port, MHA_PATH, body, headers, args.clients, 1.0, 0.0))  # warm
    text = scrape.scrape(url) if metrics else ""
    before, loop = proc_cpu(pid), sum(proc_cpu(pid, pid))
    result = asyncio.run(run_load(HOST, port, MHA_PATH, body, headers, args.clients,
                                  args.seconds, 0.0))  # fmt: skip
    after, loop = proc_cpu(pid), sum(proc_cpu(pid, pid)) - loop
    n = max(result.completed, 1)
    got = {
        "req_s": result.rps,
        "user_ms": (after[0] - before[0]) / n * 1e3,
        "sys_ms": (after[1] - before[1]) / n * 1e3,
        "loop_ms": loop / n * 1e3,
    }
    return {**got, **batches(text, scrape.scrape(url))} if metrics else got


def in_process(model_dir: str, tokens: int, embed_dim: int, clients: int, seconds: float) -> None:
    """The app in this process, called through ASGI by `clients` concurrent callers for
    `seconds`; then the mean batch it formed through `run_batch` with no other thread busy.
    Prints the figures as JSON."""
    import numpy as np
    import uvloop

    from service.app import create_app
    from service.http.connections import DISCONNECT, Disconnect
    from service.oip.inputs import Payload
    from service.runtime.forward import hidden_states, run_batch
    from service.runtime.settings import Settings
    from service.runtime.work import Work

    app = create_app(Settings(model_dir=model_dir))
    body, headers = request("binary", tokens, embed_dim)
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    raw += [(b"content-length", str(len(body)).encode()), (b"host", b"bench")]

    async def call() -> int:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "server": (HOST, 1), "client": (HOST, 2), "scheme": "http", "method": "POST",
            "root_path": "", "path": MHA_PATH, "raw_path": MHA_PATH.encode(),
            "query_string": b"", "headers": raw, "state": {},
            "extensions": {DISCONNECT: Disconnect()},
        }  # fmt: skip
        sent, status = False, 0

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays: no disconnect message
            return {}

        async def send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await app(scope, receive, send)
        return status

    async def caller(end: float) -> int:
        done = 0
        while time.perf_counter() < end:
            if await call() != 200:
                raise RuntimeError("an in-process request failed")
            done += 1
        return done

    async def load() -> dict:
        async with app.router.lifespan_context(app):
            while not app.state.service.ready:
                await asyncio.sleep(0.01)
            warm = time.perf_counter() + 1.0
            await asyncio.gather(*(caller(warm) for _ in range(clients)))
            metrics = app.state.service.metrics
            text, loop_id = metrics.exposition()[0].decode(), threading.get_native_id()
            process, loop = proc_cpu("self"), sum(proc_cpu("self", loop_id))
            started = time.perf_counter()
            end = started + seconds
            done = sum(await asyncio.gather(*(caller(end) for _ in range(clients))))
            elapsed = time.perf_counter() - started
            process2, loop2 = proc_cpu("self"), sum(proc_cpu("self", loop_id))
            got = {
                "req_s": done / elapsed,
                "user_ms": (process2[0] - process[0]) / done * 1e3,
                "sys_ms": (process2[1] - process[1]) / done * 1e3,
                "loop_ms": (loop2 - loop) / done * 1e3,
                **batches(text, metrics.exposition()[0].decode()),
            }
            model = app.state.service.entries()[0].model
        # the same batch with nothing else running (the service has stopped)
        x = np.random.default_rng(0).standard_normal((tokens, embed_dim)).astype(np.float32)
        works = [Work(payload=Payload(query=x, lengths=[tokens]), runner=hidden_states,
                      deadline=float("inf"), loop=None)
                 for _ in range(max(1, round(got["batch"])))]  # fmt: skip
        times = []
        for i in range(35):
            started = time.perf_counter()
            run_batch(model, works)
            if i >= 5:
                times.append(time.perf_counter() - started)
        return {**got, "alone_ms": statistics.median(times) * 1e3}

    print(json.dumps(uvloop.run(load())))


def in_process_child(model_dir: Path, tokens: int, embed_dim: int, args) -> dict:
    """in_process() in a fresh interpreter (its own threads, nothing left behind), with the
    environment `python -m service` sets before torch loads (OpenMP threads that sleep)."""
    from service.__main__ import CPU_DEFAULTS

    spec = [str(model_dir), str(tokens), str(embed_dim), str(args.clients), str(args.seconds)]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.frontend_floor", "--in-process", *spec],
        cwd=ROOT, capture_output=True, text=True, check=True, env={**CPU_DEFAULTS, **os.environ},
    )  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])


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
            shift = round_ % len(SERVERS)
            order = SERVERS[shift:] + SERVERS[:shift]
            for name, embed_dim, _, tokens in SIZES:
                body, headers = request("binary", tokens, embed_dim)
                for kind in order:
                    if kind == "mha-serve":
                        with running("--model-dir", str(models[name])) as server:
                            pid, port = server.process.pid, server.port
                            got = measure(pid, port, body, headers, args, metrics=True)
                    elif kind == "in process":
                        got = in_process_child(models[name], tokens, embed_dim, args)
                    else:
                        got = floor_server(kind, tokens * embed_dim * 4, body, headers, args)
                    rows.setdefault((name, kind), []).append(got)
                    print(name, kind, {k: round(v, 4) for k, v in got.items()}, flush=True)
    return [
        {"case": name, "server": kind, "rounds": len(found),
         **{k: statistics.median(r[k] for r in found) for k in found[0]}}
        for (name, kind), found in rows.items()
    ]  # fmt: skip


def print_table(rows: list[dict]) -> None:
    print(f"\ndate: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
          f"{os.cpu_count()} cores, load avg {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("\n| case | server | req/s | CPU ms/req | user | sys | event loop | mean batch | "
          "batch ms | same batch alone ms |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: ([s[0] for s in SIZES].index(r["case"]),
                                         SERVERS.index(r["server"]))):  # fmt: skip
        total = r["user_ms"] + r["sys_ms"]
        batch = f"{r['batch']:.1f} | {r['batch_ms']:.2f}" if "batch" in r else " | "
        alone = f"{r['alone_ms']:.2f}" if "alone_ms" in r else ""
        print(f"| {r['case']} | {r['server']} | {r['req_s']:,.0f} | {total:.3f} | "
              f"{r['user_ms']:.3f} | {r['sys_ms']:.3f} | {r['loop_ms']:.3f} | {batch} | "
              f"{alone} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--serve", choices=("raw", "uvicorn"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--reply-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--in-process", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process:
        model_dir, tokens, embed_dim, clients, seconds = args.in_process
        in_process(model_dir, int(tokens), int(embed_dim), int(clients), float(seconds))
    elif args.serve == "raw":
        serve_raw(args.port, args.reply_bytes)
    elif args.serve == "uvicorn":
        serve_uvicorn(args.port, args.reply_bytes)
    else:
        print_table(run(args))


if __name__ == "__main__":
    main()
