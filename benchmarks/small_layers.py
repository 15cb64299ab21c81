"""Small layers on CPU: where oneDNN's prepacked linear costs more than a plain F.linear, and
what the engine's size rule (mha_engine.fused.PLAIN_FP32_WEIGHT) does for small models.

    python -m benchmarks.small_layers [--threads 1] [--rounds 25]

Part 1: one linear (K -> N) on 16, 64 and 256 rows, oneDNN prepacked against F.linear, fp32 and
bf16 (wall time). Part 2: MHA blocks' forward_packed with the rule on (default) and off (every
float32 weight prepacked, as before), against nn.MultiheadAttention on the same batch; CPU time
of the calling thread (steadier than wall time on a shared host). Both through
benchmarks.timing.time_cases: the cases alternate, medians of `--rounds` blocks of ~20 ms.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.timing import time_cases
from mha_engine import fused
from mha_engine.checkpoint import model_from_state_dict
from mha_engine.save import module_config, module_state

LINEARS = [(16, 48), (64, 192), (128, 384), (256, 768), (384, 1152), (512, 1536)]
BLOCK_S = 0.02  # seconds of calls per timed block
BLOCKS = [(16, 2, 1, 1), (16, 2, 32, 1), (64, 4, 8, 8), (128, 4, 16, 16), (256, 4, 16, 16)]


def linears(rounds: int) -> None:
    print("| dtype | K -> N | rows | oneDNN us | F.linear us | F.linear / oneDNN |")
    print("|---|---|---:|---:|---:|---:|")
    # no bf16 rows where oneDNN has no bf16 kernels for this CPU (AVX2 only): it cannot pack them
    for dtype in (torch.float32, torch.bfloat16) if fused.ONEDNN_BF16 else (torch.float32,):
        for k, n in LINEARS:
            lin = nn.Linear(k, n).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), None)
            for rows in (16, 64, 256):
                x = torch.randn(rows, k).to(dtype)
                onednn_call = functools.partial(
                    torch.ops.mkldnn._linear_pointwise, x, packed, lin.bias, "none", [], ""
                )
                plain_call = functools.partial(F.linear, x, lin.weight, lin.bias)
                seconds = time_cases({"oneDNN": onednn_call, "plain": plain_call}, rounds, BLOCK_S)
                onednn, plain = seconds["oneDNN"] * 1e6, seconds["plain"] * 1e6
                name = str(dtype).removeprefix("torch.")
                print(
                    f"| {name} | {k} -> {n} | {rows} | {onednn:.1f} | {plain:.1f} | "
                    f"{plain / onednn:.2f} |",
                    flush=True,
                )


def _with_limit(limit: int, forward: Callable[[], object]) -> object:
    fused.PLAIN_FP32_WEIGHT = limit  # a module constant, read at every linear
    return forward()


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
        cases = {
            "nn.MHA": functools.partial(mha, x, x, x, need_weights=False),
            "prepacked": functools.partial(_with_limit, 0, forward),
            "rule": functools.partial(_with_limit, rule, forward),
        }
        with torch.inference_mode():
            seconds = time_cases(cases, rounds, BLOCK_S, clock=time.thread_time)
        fused.PLAIN_FP32_WEIGHT = rule
        med = {name: t * 1e6 for name, t in seconds.items()}
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
    parser.add_argument("--rounds", type=int, default=15, help="timed blocks per case")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
        f"{fused.cpu_capability()}, {torch.get_num_threads()} thread(s)\n"
    )
    linears(args.rounds)
    blocks(args.rounds)


if __name__ == "__main__":
    main()
