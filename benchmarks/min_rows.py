"""What the tiny-batch padding costs: the engine's prepacked fp32 GEMM (fused._onednn_linear) on
12, 13, 15 and 16 rows, for MiniLM's and MHA(512, 8)'s shapes. Inputs of fewer than
fused.MIN_ROWS (16) rows run as 16 rows; the ratio 16 / n is what padding n rows costs.

    python -m benchmarks.min_rows [--threads 1] [--reps 400]

Best of 5 timings of `reps` calls per row count, row counts interleaved per shape.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from mha_engine import fused

SHAPES = [(384, 1152), (384, 384), (384, 1536), (1536, 384), (512, 1536), (512, 512)]
ROWS = (12, 13, 15, 16)


def best_us(module: nn.Linear, x: torch.Tensor, reps: int) -> float:
    weight = fused.packed_weight(module)
    for _ in range(20):
        fused._onednn_linear(module, weight, x, None, None)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fused._onednn_linear(module, weight, x, None, None)
        times.append((time.perf_counter() - start) / reps * 1e6)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--reps", type=int, default=400, help="calls per timing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU capability {fused.cpu_capability()}, torch {torch.__version__}, "
          f"{args.threads} thread(s), MIN_ROWS {fused.MIN_ROWS}")  # fmt: skip
    print("| K -> M | " + " | ".join(f"{n} rows µs" for n in ROWS) + " | 16 / 12 | 16 / 15 |")
    print("|---|" + "---:|" * (len(ROWS) + 2))
    with torch.inference_mode():
        for k, m in SHAPES:
            module = nn.Linear(k, m)
            us = {n: best_us(module, torch.randn(n, k), args.reps) for n in ROWS}
            cells = " | ".join(f"{us[n]:.1f}" for n in ROWS)
            print(f"| {k} -> {m} | {cells} | {us[16] / us[12]:.2f} | {us[16] / us[15]:.2f} |")


if __name__ == "__main__":
    main()
