"""System shared memory and gRPC streaming against the socket paths, on one server.

Run `flock /work/bench.lock python -m benchmarks.shared_memory [--seconds 4]` from the repository
root. One `mha-serve` serves an nn.MultiheadAttention(`--embed-dim`, 2) over HTTP and gRPC;
for each sequence length the modes run back to back in `--rounds` rounds (so load from other
processes hits them alike), each keeping `--concurrency` requests of shape [`--batch`, T,
embed_dim] in flight with the unmodified tritonclient (one client per thread over HTTP; one
gRPC client, or one stream). A small embed_dim makes the forward cheap next to moving the
tensors, which is where shared memory can matter:

- HTTP binary / HTTP shm: Triton's binary tensors, or input and output in system shared memory
- gRPC raw / gRPC shm: raw_input_contents, or shared memory (unary ModelInfer)
- gRPC stream: ModelStreamInfer, raw contents, `--concurrency` requests in flight on one stream

Prints req/s and the server's CPU ms per request (utime + stime from /proc) per mode, and the
ratios to the socket path of the same protocol per round.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import platform
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
import tritonclient.utils.shared_memory as shm
from torch import nn

import mha_engine
from benchmarks.server import HOST, Proc, free_port, running

NAME = "mha"


class Mode:
    """One way of sending a request: `setup(worker)` returns the call that sends one."""

    def __init__(self, name: str, setup: Callable[[int], Callable[[], None]]) -> None:
        self.name = name
        self.setup = setup


_RUNS = itertools.count()  # every setup makes objects of its own (sizes differ per length)


def _regions(client, worker: int, nbytes: int, tag: str) -> list:
    """An input and an output region for one worker, registered with the server."""
    handles = []
    run = next(_RUNS)
    for kind in ("in", "out"):
        name = f"{tag}-{kind}-{worker}"
        key = f"/mha-bench-{os.getpid()}-{run}-{name}"
        handles.append(shm.create_shared_memory_region(name, key, nbytes))
        client.register_system_shared_memory(name, key, nbytes)
    return handles


def modes(proc: Proc, grpc_address: str, x: np.ndarray, cleanup: list) -> list[Mode]:
    nbytes = x.nbytes
    shape = list(x.shape)

    def http_binary(worker: int) -> Callable[[], None]:
        client = thttp.InferenceServerClient(proc.address)
        item = thttp.InferInput("input", shape, "FP32")
        item.set_data_from_numpy(x, binary_data=True)
        output = thttp.InferRequestedOutput("output", binary_data=True)
        return lambda: client.infer(NAME, [item], outputs=[output]).as_numpy("output")

    def in_shm(lib, client, tag: str, worker: int) -> Callable[[], None]:
        """Input and output in regions of this worker's own, through `lib`'s client."""
        handle_in, handle_out = _regions(client, worker, nbytes, tag)
        cleanup.extend((handle_in, handle_out))
        shm.set_shared_memory_region(handle_in, [x])
        item = lib.InferInput("input", shape, "FP32")
        item.set_shared_memory(f"{tag}-in-{worker}", nbytes)
        output = lib.InferRequestedOutput("output")
        output.set_shared_memory(f"{tag}-out-{worker}", nbytes)

        def call() -> None:
            client.infer(NAME, [item], outputs=[output])
            shm.get_contents_as_numpy(handle_out, np.float32, shape)

        return call

    def http_shm(worker: int) -> Callable[[], None]:
        return in_shm(thttp, thttp.InferenceServerClient(proc.address), "http", worker)

    grpc_client = tgrpc.InferenceServerClient(grpc_address)

    def grpc_raw(worker: int) -> Callable[[], None]:
        item = tgrpc.InferInput("input", shape, "FP32")
        item.set_data_from_numpy(x)
        return lambda: grpc_client.infer(NAME, [item]).as_numpy("output")

    def grpc_shm(worker: int) -> Callable[[], None]:
        return in_shm(tgrpc, grpc_client, "grpc", worker)

    return [
        Mode("HTTP binary", http_binary),
        Mode("HTTP shm", http_shm),
        Mode("gRPC raw", grpc_raw),
        Mode("gRPC shm", grpc_shm),
    ]


def closed_loop(mode: Mode, concurrency: int, seconds: float) -> tuple[int, float]:
    """(requests completed in the measured window, its seconds), after a 1 s warm-up. Each
    thread sets its mode up itself (tritonclient.http's clients belong to their thread)."""
    ready = threading.Barrier(concurrency + 1, timeout=60)  # a failed setup breaks it
    counts = [0] * concurrency
    window: list[float] = []

    def worker(index: int) -> None:
        call = mode.setup(index)
        ready.wait()
        start, stop = window
        while (now := time.perf_counter()) < stop:
            call()
            if now >= start:
                counts[index] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    start = time.perf_counter() + 1.0
    window.extend((start, start + seconds))
    ready.wait()
    for thread in threads:
        thread.join()
    return sum(counts), seconds


def streaming(grpc_address: str, x: np.ndarray, concurrency: int, seconds: float):
    """ModelStreamInfer: `concurrency` requests in flight on one stream."""
    client = tgrpc.InferenceServerClient(grpc_address)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error))
    item = tgrpc.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    for _ in range(concurrency):
        client.async_stream_infer(NAME, [item])
    start = time.perf_counter() + 1.0
    stop = start + seconds
    done = 0
    while (now := time.perf_counter()) < stop:
        error = answers.get(timeout=60)
        if error is not None:
            raise error
        if now >= start:
            done += 1
        client.async_stream_infer(NAME, [item])
    for _ in range(concurrency):
        answers.get(timeout=60)
    client.stop_stream()
    return done, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--batch", type=int, default=128, help="sequences per request")
    parser.add_argument("--embed-dim", type=int, default=16)
    args = parser.parse_args()

    torch.manual_seed(0)
    module = nn.MultiheadAttention(args.embed_dim, 2, batch_first=True).eval()
    cleanup: list = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / NAME
        mha_engine.save_model(module, model_dir)
        grpc_port = free_port()
        grpc_address = f"{HOST}:{grpc_port}"
        serve = ("--model-dir", str(model_dir), "--grpc-port", str(grpc_port))
        tokens = args.batch * max(args.lengths)
        limits = (
            *("--max-batch-size", str(args.batch), "--max-queue", str(8 * args.batch)),
            *("--max-batch-tokens", str(tokens), "--max-seq-len", str(max(args.lengths))),
        )
        with running(*serve, *limits) as proc:
            print(
                f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
                f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                f"{torch.backends.cpu.get_cpu_capability()}; torch {torch.__version__}; "
                f"load average {os.getloadavg()[0]:.2f}"
            )
            print(
                f"# nn.MultiheadAttention({args.embed_dim}, 2), requests of {args.batch} "
                f"sequences; concurrency {args.concurrency}; "
                f"{args.seconds:g} s per run (after 1 s warm-up); {args.rounds} rounds"
            )
            print("| T | MB in + out | mode | req/s | server CPU ms/request |")
            print("|---|---|---|---|---|")
            admin = thttp.InferenceServerClient(proc.address)
            try:
                for length in args.lengths:
                    shape = (args.batch, length, args.embed_dim)
                    x = np.random.default_rng(length).standard_normal(shape, np.float32)
                    runs: dict[str, list[tuple[float, float]]] = {}
                    for _ in range(args.rounds):
                        for mode in modes(proc, grpc_address, x, cleanup):
                            load = functools.partial(
                                closed_loop, mode, args.concurrency, args.seconds
                            )
                            runs.setdefault(mode.name, []).append(_measure(proc, load))
                            admin.unregister_system_shared_memory()
                            while cleanup:
                                shm.destroy_shared_memory_region(cleanup.pop())
                        load = functools.partial(
                            streaming, grpc_address, x, args.concurrency, args.seconds
                        )
                        runs.setdefault("gRPC stream", []).append(_measure(proc, load))
                    megabytes = 2 * x.nbytes / 1e6
                    for name, figures in runs.items():
                        rps = statistics.mean(r[0] for r in figures)
                        cpu = statistics.mean(r[1] for r in figures)
                        print(f"| {length} | {megabytes:.2f} | {name} | {rps:.0f} | {cpu:.2f} |")
                    for over, base in (("HTTP shm", "HTTP binary"), ("gRPC shm", "gRPC raw"),
                                       ("gRPC stream", "gRPC raw")):  # fmt: skip
                        ratios = [o[0] / b[0] for o, b in zip(runs[over], runs[base], strict=True)]
                        cpus = [o[1] / b[1] for o, b in zip(runs[over], runs[base], strict=True)]
                        print(
                            f"| {length} | | {over} / {base} | "
                            f"{', '.join(f'{r:.2f}' for r in ratios)} | "
                            f"{', '.join(f'{r:.2f}' for r in cpus)} |"
                        )
            finally:
                while cleanup:
                    shm.destroy_shared_memory_region(cleanup.pop())


def _measure(proc: Proc, run: Callable[[], tuple[int, float]]) -> tuple[float, float]:
    """(req/s, server CPU ms per request) of one run."""
    cpu0 = proc.cpu_seconds()
    done, seconds = run()
    return done / seconds, 1000 * (proc.cpu_seconds() - cpu0) / max(done, 1)


if __name__ == "__main__":
    main()
