"""Small layers on CPU: where oneDNN's prepacked linear costs more than a plain F.linear, and
what the engine's size rule (mha_engine.fused.PLAIN_FP32_WEIGHT) does for small models.

    python -m benchmarks.small_layers [--threads 1] [--rounds 25]

Part 1: one linear (K -> N) on 16, 64 and 256 rows, oneDNN prepacked against F.linear, fp32 and
bf16 (wall time, median of 5 timings). Part 2: MHA blocks' forward_packed with the rule on
(default) and off (every float32 weight prepacked, as before), against nn.MultiheadAttention on
the same batch; CPU time of the calling thread (steadier than wall time on a shared host),
median over rounds in which the three alternate.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from mha_engine import fused
from mha_engine.checkpoint import model_from_state_dict
from mha_engine.save import module_config, module_state

LINEARS = [(16, 48), (64, 192), (128, 384), (256, 768), (384, 1152), (512, 1536)]
BLOCKS = [(16, 2, 1, 1), (16, 2, 32, 1), (64, 4, 8, 8), (128, 4, 16, 16), (256, 4, 16, 16)]


def wall_us(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps * 1e6)
    return statistics.median(times)


def linears() -> None:
    print("| dtype | K -> N | rows | oneDNN us | F.linear us | F.linear / oneDNN |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in LINEARS:
            lin = nn.Linear(k, n).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), None)
            for rows in (16, 64, 256):
                x = torch.randn(rows, k).to(dtype)
                reps = max(20, int(2e8 / (rows * k * n + 2e5)))
                onednn_call = functools.partial(
                    torch.ops.mkldnn._linear_pointwise, x, packed, lin.bias, "none", [], ""
                )
                onednn = wall_us(onednn_call, reps)
                plain = wall_us(functools.partial(F.linear, x, lin.weight, lin.bias), reps)
                name = str(dtype).removeprefix("torch.")
                print(
                    f"| {name} | {k} -> {n} | {rows} | {onednn:.1f} | {plain:.1f} | "
                    f"{plain / onednn:.2f} |",
                    flush=True,
                )


def cpu_us(fn, reps: int) -> float:
    start = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - start) / reps * 1e6


def blocks(rounds: int) -> None:
    rule = fused.PLAIN_FP32_WEIGHT
    print("\n| MHA(E, heads), B x T | nn.MHA us | engine, all prepacked | engine, size rule |")
    print("|---|---:|---:|---:|")
    for embed_dim, heads, batch, tokens in BLOCKS:
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(embed_dim, heads, batch_first=True).eval()
        engine = model_from_state_dict(module_config(mha), module_state(mha), "cpu", "float32")
        x = torch.randn(batch, tokens, embed_dim)
        packed, cu = x.reshape(batch * tokens, embed_dim), [i * tokens for i in range(batch + 1)]
        forward = functools.partial(engine.forward_packed, packed, cu)
        calls = {
            "nn.MHA": (None, functools.partial(mha, x, x, x, need_weights=False)),
            "prepacked": (0, forward),
            "rule": (rule, forward),
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        with torch.inference_mode():
            for _ in range(rounds):
                for name, (limit, fn) in calls.items():
                    fused.PLAIN_FP32_WEIGHT = rule if limit is None else limit
                    fn()
                    times[name].append(cpu_us(fn, 100))
        fused.PLAIN_FP32_WEIGHT = rule
        med = {name: statistics.median(t) for name, t in times.items()}
        print(
            f"| MHA({embed_dim}, {heads}), {batch} x {tokens} | {med['nn.MHA']:.1f} | "
            f"{med['prepacked']:.1f} ({med['prepacked'] / med['nn.MHA']:.2f}x) | "
            f"{med['rule']:.1f} ({med['rule'] / med['nn.MHA']:.2f}x; "
            f"{med['rule'] / med['prepacked']:.2f} of prepacked) |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
        f"{fused.cpu_capability()}, {torch.get_num_threads()} thread(s)\n"
    )
    linears()
    blocks(args.rounds)


if __name__ == "__main__":
    main()
