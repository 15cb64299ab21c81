"""What one SDPA call per sequence costs for few queries on many keys (packed_attention.
SMALL_QUERIES) against one call per group, the batch-variant way it was before: an MHA block
whose batch is short targets on long memories, as a decoder step's cross-attention is.

Run `python -m benchmarks.few_queries [--rounds 5] [--seconds 2]` from the repository root
under `flock /work/bench.lock`. The two settings alternate round by round; the table gives the
median batches/s and what one batch costs.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from torch import nn

from benchmarks.text_models import rate
from mha_engine import packed_attention
from mha_engine.checkpoint import model_from_state_dict
from mha_engine.save import module_config, module_state

SPLIT = packed_attention.SMALL_QUERIES  # the engine's setting; 0 groups every call
CASES = {  # name: (embed_dim, heads, sequences, query tokens, key tokens, key mask)
    "1 token on 300 keys, 32 sequences": (512, 8, 32, 1, 300, False),
    "3 tokens on 40 keys, masked, 64 sequences": (512, 8, 64, 3, 40, True),
    "12 tokens on 200 keys, 16 sequences": (768, 12, 16, 12, 200, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    print(
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {platform.processor() or 'cpu'}, "
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.2f}"
    )
    print("\n| case | per sequence: batches/s | per group | per sequence / per group |")
    print("|---|---:|---:|---:|")
    for name, case in CASES.items():
        split, grouped = compare(*case, args.rounds, args.seconds)
        print(f"| {name} | {split:.0f} | {grouped:.0f} | {split / grouped:.2f}x |")


def compare(
    E: int, H: int, B: int, T: int, S: int, masked: bool, rounds: int, seconds: float
) -> tuple[float, float]:
    """Median batches/s with one SDPA call per sequence and with one per group, alternating."""
    torch.manual_seed(0)
    module = nn.MultiheadAttention(E, H, batch_first=True).eval()
    model = model_from_state_dict(module_config(module), module_state(module))
    queries = [torch.randn(T, E) for _ in range(B)]
    keys = [torch.randn(S, E) for _ in range(B)]
    masks = [torch.arange(S) == S - 1 for _ in range(B)] if masked else None

    def step() -> None:
        model.forward_varlen(queries, keys, keys, masks)

    rows: dict[int, list[float]] = {SPLIT: [], 0: []}
    for i in range(rounds):
        for small in list(rows) if i % 2 == 0 else list(rows)[::-1]:
            packed_attention.SMALL_QUERIES = small
            step()  # warm
            rows[small].append(rate(step, 1, seconds))
    packed_attention.SMALL_QUERIES = SPLIT
    return statistics.median(rows[SPLIT]), statistics.median(rows[0])


if __name__ == "__main__":
    main()
