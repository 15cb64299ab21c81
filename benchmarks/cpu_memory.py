"""glibc's heap kept or not: page faults and CPU time per batch of all-MiniLM-L6-v2 (32 sentences),
the forward on the main thread or on a second thread (as the service's engine thread runs it).

    python -m benchmarks.cpu_memory [--batches 20] [--rounds 2]

Each case (dtype, mode, thread) runs in a process of its own, interleaved: malloc's settings
are per process, and glibc's defaults adapt to what the process freed before (its mmap
threshold rises after a large block is freed), so one model loaded before another would change
the second one's figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import threading
import time

import torch

import mha_engine
from benchmarks.embeddings import SENTENCES
from benchmarks.peers import minilm_dir, tokenizer
from mha_engine import fused

DTYPES = ("float32", "bfloat16", "int8")


def child(dtype: str, mode: str, where: str, batches: int) -> None:
    """One case: print 'faults_per_batch cpu_ms_per_batch'."""
    if mode == "kept":
        mha_engine.tune_cpu_allocator()
    torch.set_num_threads(1)
    directory = minilm_dir()
    tok = tokenizer(directory)
    ids = [torch.tensor(e.ids) for e in tok.encode_batch(SENTENCES[:32])]
    lines: list[str] = []

    def work() -> None:
        model = mha_engine.load_model(directory, device="cpu", dtype=dtype)
        for _ in range(5):
            model.embed_varlen(ids, pooling="mean", normalize=True)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu = time.process_time()
        for _ in range(batches):
            model.embed_varlen(ids, pooling="mean", normalize=True)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / batches
        lines.append(f"{faults} {(time.process_time() - cpu) / batches * 1e3}")

    if where == "thread":
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
    else:
        work()
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20, help="measured batches per case")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.batches)
        return
    rows: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for where in ("main", "thread"):
            for dtype in DTYPES:
                for mode in ("default", "kept"):
                    out = subprocess.run(
                        [sys.executable, "-m", "benchmarks.cpu_memory", "--batches",
                         str(args.batches), "--child", dtype, mode, where],
                        capture_output=True, text=True, check=True, timeout=600,
                    ).stdout  # fmt: skip
                    faults, ms = out.split()
                    rows.setdefault((where, dtype, mode), []).append((float(faults), float(ms)))
    print(
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
        f"CPU capability {fused.cpu_capability()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, 1 thread, load avg {os.getloadavg()[0]:.2f}; MiniLM, 32 sentences"
        f"; {args.batches} batches a case, {args.rounds} rounds (best CPU ms of the rounds)\n"
    )
    print("| forward on thread | dtype | page faults a batch: glibc defaults → kept | "
          "CPU ms a batch: defaults → kept | speed-up |")  # fmt: skip
    print("|---|---|---:|---:|---:|")
    for where in ("main", "thread"):
        for dtype in DTYPES:
            default = rows[(where, dtype, "default")]
            kept = rows[(where, dtype, "kept")]
            f0, f1 = max(f for f, _ in default), max(f for f, _ in kept)
            m0, m1 = min(m for _, m in default), min(m for _, m in kept)
            print(
                f"| {where} | {dtype} | {f0:,.0f} → {f1:,.0f} | {m0:.1f} → {m1:.1f} | "
                f"{m0 / m1:.2f}x |"
            )


if __name__ == "__main__":
    main()
