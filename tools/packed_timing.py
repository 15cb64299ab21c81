"""Quick interleaved timing of forward_packed on mixed lengths: exact groups vs opt-in buckets,
eager vs torch.compile, against a uniform batch. Not a benchmark suite (see BENCHMARKS.md);
run it as `flock /tmp/mha-bench.lock python tools/packed_timing.py`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from mha_engine import build_demo_model
from mha_engine.varlen import cumulative, make_plan


def useful_flops(lens: list[int], E: int, F: int) -> float:
    """Projection + FFN FLOPs per token and attention FLOPs per sequence (no padding)."""
    per_token = 2 * (4 * E * E + 2 * E * F)
    return sum(per_token * n + 4 * n * n * E for n in lens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    model = build_demo_model(device="cpu")  # D=512, 8 heads, FFN 2048, 1 layer
    E, F = model.embed_dim, model.config.dim_feedforward
    mixed = [rng.randint(16, 256) for _ in range(args.sequences)]
    uniform = [round(sum(mixed) / len(mixed))] * args.sequences
    cases = {
        "uniform, exact": (uniform, 0.0),
        "mixed, exact (default)": (mixed, 0.0),
        "mixed, bucket_padding=0.1": (mixed, 0.1),
        "mixed, bucket_padding=0.25": (mixed, 0.25),
    }
    inputs = {name: torch.randn(sum(lens), E) for name, (lens, _) in cases.items()}
    runners = {
        name: (lambda m=model, n=name, lens=lens, b=b: m.forward_packed(
            inputs[n], cumulative(lens), bucket_padding=b))
        for name, (lens, b) in cases.items()
    }  # fmt: skip
    if args.compile:
        compiled = build_demo_model(device="cpu")
        compiled.core.compile(dynamic=True)
        start = time.perf_counter()
        compiled.forward_packed(inputs["mixed, exact (default)"], cumulative(mixed))
        print(f"compile (first call): {time.perf_counter() - start:.1f} s")
        runners["mixed, exact, compiled"] = lambda: compiled.forward_packed(
            inputs["mixed, exact (default)"], cumulative(mixed)
        )
        cases["mixed, exact, compiled"] = (mixed, 0.0)
    for run in runners.values():
        run()  # warm up
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):  # interleaved: every case once per round
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    base = None
    print(f"{'case':32} {'SDPA calls':>10} {'ms':>8} {'useful GFLOP/s':>15} {'vs uniform':>10}")
    for name, (lens, budget) in cases.items():
        ms = statistics.median(times[name]) * 1e3
        gflops = useful_flops(lens, E, F) / ms / 1e6
        base = base or gflops
        calls = make_plan(lens, bucket_padding=budget).num_sdpa_calls
        print(f"{name:32} {calls:>10} {ms:>8.1f} {gflops:>15.1f} {gflops / base:>10.2f}")


if __name__ == "__main__":
    main()
