"""gRPC (raw contents) against HTTP (Triton binary tensors) on one server: req/s and server CPU.

Run `flock /tmp/mha-bench.lock python -m benchmarks.grpc_vs_http [--seconds 8]` from the
repository root. One `mha-serve` process serves an nn.MultiheadAttention(512, 8) on both
listeners; for each sequence length the two protocols run back to back, alternating, in
`--rounds` rounds, so load from other processes hits both alike. Each round keeps
`--concurrency` requests of shape [1, T, 512] in flight (closed loop) and reads the server's
utime + stime from /proc/<pid>/stat before and after. Clients are lean on both sides (a
hand-built HTTP/1.1 client; grpc.aio with the generated stub) and share the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import torch
from torch import nn

import mha_engine
from benchmarks.client import binary_infer_body, run_load
from benchmarks.server import HOST, Proc, free_port, running
from service.grpc import grpc_service_pb2 as pb
from service.grpc import grpc_service_pb2_grpc as pb_grpc

NAME = "mha512"


async def grpc_load(
    address: str,
    request: pb.ModelInferRequest,
    concurrency: int,
    seconds: float,
    warmup_s: float = 1.0,
) -> tuple[int, int]:
    """(completed, failed) calls in the measured `seconds` after `warmup_s`."""
    completed = failed = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        start = time.perf_counter() + warmup_s
        stop = start + seconds

        async def worker() -> None:
            nonlocal completed, failed
            while (now := time.perf_counter()) < stop:
                try:
                    await stub.ModelInfer(request, timeout=30)
                    ok = True
                except grpc.aio.AioRpcError:
                    ok = False
                if now >= start:
                    completed += ok
                    failed += not ok

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return completed, failed


def infer_request(x: np.ndarray, model_name: str) -> pb.ModelInferRequest:
    """A ModelInferRequest of `x` (FP32) as raw contents."""
    request = pb.ModelInferRequest(model_name=model_name)
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


def measure(proc: Proc, run) -> tuple[float, float, int]:
    """(req/s, server CPU ms per request, failures) of one load run."""
    cpu0, t0 = proc.cpu_seconds(), time.perf_counter()
    completed, failed, seconds = run()
    cpu = proc.cpu_seconds() - cpu0
    del t0
    return completed / seconds, 1000 * cpu / max(completed, 1), failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 128])
    args = parser.parse_args()

    torch.manual_seed(0)
    module = nn.MultiheadAttention(512, 8, batch_first=True).eval()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / NAME
        mha_engine.save_model(module, model_dir)
        grpc_port = free_port()
        with running("--model-dir", str(model_dir), "--grpc-port", str(grpc_port)) as proc:
            print(
                f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
                f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
                f"torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}"
            )
            print(
                f"# nn.MultiheadAttention(512, 8); concurrency {args.concurrency}; "
                f"{args.seconds:g} s per run (after 1 s warm-up); {args.rounds} rounds"
            )
            print("| T | protocol | req/s | server CPU ms/request | failures |")
            print("|---|---|---|---|---|")
            for length in args.lengths:
                x = np.random.default_rng(length).standard_normal((1, length, 512), np.float32)
                body, headers = binary_infer_body(x)
                request = infer_request(x, NAME)

                def http_run(body=body, headers=headers):
                    result = asyncio.run(
                        run_load(
                            HOST,
                            proc.port,
                            f"/v2/models/{NAME}/infer",
                            body,
                            headers,
                            args.concurrency,
                            args.seconds,
                        )
                    )
                    failed = sum(n for status, n in result.statuses.items() if status != 200)
                    return result.completed - failed, failed, result.seconds

                def grpc_run(request=request):
                    done, failed = asyncio.run(
                        grpc_load(f"{HOST}:{grpc_port}", request, args.concurrency, args.seconds)
                    )
                    return done, failed, args.seconds

                figures: dict[str, list[tuple[float, float, int]]] = {
                    "HTTP binary": [],
                    "gRPC raw": [],
                }
                for _ in range(args.rounds):
                    figures["HTTP binary"].append(measure(proc, http_run))
                    figures["gRPC raw"].append(measure(proc, grpc_run))
                for protocol, runs in figures.items():
                    rps = statistics.mean(r[0] for r in runs)
                    cpu = statistics.mean(r[1] for r in runs)
                    fails = sum(r[2] for r in runs)
                    print(f"| {length} | {protocol} | {rps:.0f} | {cpu:.2f} | {fails} |")
                ratio = [
                    g[0] / h[0]
                    for h, g in zip(figures["HTTP binary"], figures["gRPC raw"], strict=True)
                ]
                cpu_ratio = [
                    g[1] / h[1]
                    for h, g in zip(figures["HTTP binary"], figures["gRPC raw"], strict=True)
                ]
                print(
                    f"| {length} | gRPC / HTTP | {min(ratio):.2f}–{max(ratio):.2f} | "
                    f"{min(cpu_ratio):.2f}–{max(cpu_ratio):.2f} | |"
                )


if __name__ == "__main__":
    main()
