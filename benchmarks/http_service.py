"""Service benchmark: HTTP throughput and CPU efficiency against the raw engine and a naive server.

`python -m benchmarks.http_service [--seconds 8] [--clients 32]` starts each server
configuration as a subprocess on loopback, drives it with `clients` closed-loop connections,
and prints one markdown table plus the target ratios, all from the same run. The server's
CPU-seconds per request (from /proc) are compared with the raw engine's CPU-seconds per
sequence, since the load generator shares the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

import mha_engine
from benchmarks.client import LoadResult, binary_infer_body, run_load
from benchmarks.server import HOST, running

EMBED_DIM = 512  # the demo model's d_model


@dataclass
class Case:
    name: str
    server: str  # "service" or "naive"
    payload: str  # "binary", "json" or "naive"
    seq_len: int
    args: tuple[str, ...] = ()


def _body(payload: str, seq_len: int) -> tuple[str, bytes, dict[str, str]]:
    x = np.random.default_rng(0).standard_normal((1, seq_len, EMBED_DIM)).astype(np.float32)
    if payload == "naive":
        return (
            "/predict",
            json.dumps({"input": x.tolist()}).encode(),
            {"Content-Type": "application/json"},
        )
    tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32"}
    if payload == "json":
        body = {"inputs": [{**tensor, "data": x.ravel().tolist()}]}
        return (
            "/v2/models/mha/infer",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
    body, headers = binary_infer_body(x)
    return "/v2/models/mha/infer", body, headers


def run_case(case: Case, clients: int, seconds: float) -> tuple[LoadResult, float]:
    """Throughput/latency of one configuration and the server's CPU-seconds per request."""
    path, body, headers = _body(case.payload, case.seq_len)
    args = () if case.server == "naive" else (*case.args, "--log-level", "warning")
    with running(*args, naive=case.server == "naive") as server:
        asyncio.run(run_load(HOST, server.port, path, body, headers, clients, 1.0, 0.5))
        cpu_before = server.cpu_seconds()
        result = asyncio.run(run_load(HOST, server.port, path, body, headers, clients, seconds, 0))
        cpu = server.cpu_seconds() - cpu_before
    bad = {s: n for s, n in result.statuses.items() if s != 200}
    if bad:
        print(f"  warning: {case.name} got non-200 answers {bad}", file=sys.stderr)
    return result, cpu / max(result.completed, 1)


def raw_engine(seq_len: int, batch: int = 32, seconds: float = 3.0) -> tuple[float, float]:
    """Raw engine sequences/s and CPU-seconds per sequence via forward_varlen, batch of `batch`."""
    model = mha_engine.build_demo_model(device="cpu")
    seqs = list(torch.randn(batch, seq_len, EMBED_DIM))
    model.forward_varlen(seqs)
    wall, cpu, n = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - wall < seconds:
        model.forward_varlen(seqs)
        n += batch
    return n / (time.perf_counter() - wall), (time.process_time() - cpu) / n


CASES = [
    Case("binary, batching on (32)", "service", "binary", 128, ("--max-batch-size", "32")),
    Case("binary, batching off (1)", "service", "binary", 128, ("--max-batch-size", "1")),
    Case("JSON, batching on (32)", "service", "json", 128, ("--max-batch-size", "32")),
    Case("naive FastAPI server", "naive", "naive", 128),
    Case("T=16 binary, batching on (32)", "service", "binary", 16, ("--max-batch-size", "32")),
    Case("T=16 binary, batching off (1)", "service", "binary", 16, ("--max-batch-size", "1")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per case")
    parser.add_argument("--clients", type=int, default=32, help="concurrent connections")
    args = parser.parse_args()

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"date: {when}; {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load avg {os.getloadavg()[0]:.2f}"
    )
    engine = {t: raw_engine(t) for t in (128, 16)}
    rows = {}
    print(
        f"\nD=512, 8 heads, 1 encoder layer (demo model), fp32, {args.clients} clients, "
        f"{args.seconds:.0f} s per case\n"
    )
    print("| case | T | req/s | p50 ms | p99 ms | server CPU ms/req |")
    print("|---|---:|---:|---:|---:|---:|")
    for seq_len, (sps, cpu) in engine.items():
        print(
            f"| raw engine, forward_varlen batch 32 | {seq_len} | {sps:.0f} seq/s | | | "
            f"{cpu * 1e3:.2f} per seq |"
        )
    for case in CASES:
        result, cpu = run_case(case, args.clients, args.seconds)
        rows[case.name] = (result, cpu)
        p50, p99 = result.percentile(50) * 1e3, result.percentile(99) * 1e3
        print(
            f"| {case.name} | {case.seq_len} | {result.rps:.0f} | {p50:.1f} | {p99:.1f} "
            f"| {cpu * 1e3:.2f} |",
            flush=True,
        )

    binary, _ = rows["binary, batching on (32)"]
    ratios = [
        (
            "server CPU efficiency, binary (engine CPU/seq ÷ server CPU/req)",
            engine[128][1] / rows["binary, batching on (32)"][1],
            "≥ 0.80",
        ),
        ("server CPU efficiency, JSON", engine[128][1] / rows["JSON, batching on (32)"][1], "-"),
        (
            "JSON req/s ÷ naive req/s",
            rows["JSON, batching on (32)"][0].rps / max(rows["naive FastAPI server"][0].rps, 1e-9),
            "≥ 15",
        ),
        ("binary req/s ÷ raw engine seq/s (T=128)", binary.rps / engine[128][0], "-"),
        (
            "T=16 batching on ÷ off (req/s)",
            rows["T=16 binary, batching on (32)"][0].rps
            / max(rows["T=16 binary, batching off (1)"][0].rps, 1e-9),
            "≥ 3",
        ),
        (
            "T=128 batching on ÷ off (req/s)",
            binary.rps / max(rows["binary, batching off (1)"][0].rps, 1e-9),
            "-",
        ),
    ]
    print("\n| ratio | value | target |\n|---|---:|---|")
    for name, value, target in ratios:
        print(f"| {name} | {value:.2f} | {target} |")


if __name__ == "__main__":
    main()
