"""bf16 on AMX CPUs: MiniLM (32 sentences, 446 tokens) with bf16 GEMMs in one call against
blocks of exactly 64, 128 (the engine's fused.AMX_BF16_BLOCK) and 256 rows, interleaved; and
the latency of one short sentence alone, which the blocks pad to a whole block.

    python -m benchmarks.bf16_blocks [--threads N] [--rounds 4] [--seconds 1.2]

One call per GEMM is what the engine did before the blocks (not batch invariant on AMX).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import mha_engine
from benchmarks.embeddings import SENTENCES
from benchmarks.peers import minilm_dir, tokenizer
from mha_engine import fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument("--seconds", type=float, default=1.2, help="seconds per case a round")
    args = parser.parse_args()
    if not fused.AMX:
        raise SystemExit("this CPU has no AMX: the engine runs bf16 GEMMs in one call here")
    mha_engine.tune_cpu_allocator()
    torch.set_num_threads(args.threads)
    directory = minilm_dir()
    tok = tokenizer(directory)
    ids = [torch.tensor(e.ids) for e in tok.encode_batch(SENTENCES[:32])]
    model = mha_engine.load_model(directory, device="cpu", dtype="bfloat16")
    cases = {"one call": None, "blocks of 64": 64, "blocks of 128": 128, "blocks of 256": 256}
    rates: dict[str, list[float]] = {name: [] for name in cases}
    alone: dict[str, list[float]] = {name: [] for name in cases}
    short = [torch.tensor(tok.encode("A short sentence of ten or so tokens.").ids)]
    default = fused.AMX_BF16_BLOCK
    try:
        for _ in range(args.rounds):
            for name, block in cases.items():
                fused.AMX = block is not None
                fused.AMX_BF16_BLOCK = block or default
                for _ in range(3):
                    model.embed_varlen(ids, pooling="mean", normalize=True)
                started, n = time.perf_counter(), 0
                while time.perf_counter() - started < args.seconds:
                    model.embed_varlen(ids, pooling="mean", normalize=True)
                    n += 1
                rates[name].append(len(ids) * n / (time.perf_counter() - started))
                for _ in range(20):
                    started = time.perf_counter()
                    model.embed_varlen(short, pooling="mean", normalize=True)
                    alone[name].append((time.perf_counter() - started) * 1e3)
    finally:
        fused.AMX, fused.AMX_BF16_BLOCK = True, default
    base = statistics.median(rates["one call"])
    print(
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU capability "
        f"{fused.cpu_capability()}; torch {torch.__version__}; {args.threads} threads; load avg "
        f"{os.getloadavg()[0]:.2f}; {sum(len(i) for i in ids)} tokens; the short sentence "
        f"{len(short[0])} tokens\n"
    )
    print("| bf16 GEMMs | sentences/s (median) | rounds | x one call | short sentence alone, ms |")
    print("|---|---:|---|---:|---:|")
    for name, got in rates.items():
        med = statistics.median(got)
        spread = ", ".join(f"{r:.0f}" for r in got)
        ms = statistics.median(alone[name])
        print(f"| {name} | {med:.0f} | {spread} | {med / base:.2f} | {ms:.1f} |")


if __name__ == "__main__":
    main()
