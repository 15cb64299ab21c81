"""CPU attention of a packed batch: cpu_varlen.c's one call against one SDPA call per group.

    python -m benchmarks.varlen_attention [--threads 1] [--rounds 5]

Attention alone (the Q/K/V projections done beforehand), ms per batch, best of `--rounds`
interleaved rounds, for uniform batches of B sequences of T tokens (B = 1: one small SDPA call;
B = 8: one SDPA call over eight sequences, SDPA's best case) and for MiniLM-like mixed batches
(32 sentences of 5-30 tokens: 16+ groups). The kernel's length limit is lifted here to show
where SDPA overtakes it, which is what sets `cpu_varlen.MAX_LEN` (per CPU capability).
"""

from __future__ import annotations

import argparse
import random
import time
from functools import partial

import torch

from mha_engine import cpu_varlen, fused, packed_attention, varlen
from mha_engine.attention import FusedAttention
from mha_engine.config import MultiheadAttentionConfig


def best_ms(fn, calls: int, rounds: int) -> list[float]:
    fn()
    return [_time(fn, calls) for _ in range(rounds)]


def _time(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    limits = {str(dt)[6:]: cpu_varlen.max_len(dt) for dt in (torch.float32, torch.bfloat16)}
    print(
        f"CPU capability {fused.cpu_capability()}, torch {torch.__version__}, "
        f"{args.threads} threads, kernel {cpu_varlen.kernel_status()}, limits {limits}\n"
    )
    print("| head_dim | batch | dtype | grouped SDPA ms | kernel ms | kernel speed-up |")
    print("|---:|---|---|---:|---:|---:|")
    rng = random.Random(0)
    mixed = [rng.randint(5, 30) for _ in range(32)]
    shapes = [(f"{b} x {t}", [t] * b) for t in (16, 32, 48, 64, 96, 128) for b in (1, 8)]
    for head_dim in (32, 64):
        for name, lens in [("32 mixed 5-30", mixed), *shapes]:
            for dtype in (torch.float32, torch.bfloat16):
                H, E = 12, 12 * head_dim
                plan = varlen.make_plan(lens)
                qkv = torch.randn(sum(lens), 3 * E).to(dtype)
                q, k, v = qkv[:, :E], qkv[:, E : 2 * E], qkv[:, 2 * E :]
                modes, _ = plan.cpu_split(1 << 30)  # every sequence: the limit lifted

                attn = FusedAttention(MultiheadAttentionConfig(embed_dim=E, num_heads=H))

                grouped = partial(packed_attention.grouped_attention, attn, plan, q=q, k=k, v=v)
                kernel = partial(
                    cpu_varlen.varlen_attention,
                    q, k, v, plan.cu_seqlens, None, modes, lens, lens, H, H, head_dim,
                )  # fmt: skip
                calls = max(3, 2000 // sum(lens))
                g, c = [], []
                for _ in range(args.rounds):  # interleaved
                    g += best_ms(grouped, calls, 1)
                    c += best_ms(kernel, calls, 1)
                print(
                    f"| {head_dim} | {name} | {str(dtype)[6:]} | {min(g):.3f} | {min(c):.3f} "
                    f"| {min(g) / min(c):.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
