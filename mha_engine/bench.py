"""Benchmark: engine vs nn.MultiheadAttention, a naive module and same-run GEMM rooflines.

Run `python -m mha_engine.bench [--quick]`; prints a markdown table (median of repeats) and the
ratios behind the performance targets, all from one run so machine noise cancels out.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from .checkpoint import model_from_state_dict, module_config, module_state

SHAPES = [(1, 16, 512, 8), (32, 128, 512, 8), (8, 512, 768, 12), (64, 32, 384, 12)]


class NaiveAttention(nn.Module):
    """Tutorial-style MHA: three Linear layers, matmul, softmax, matmul, output Linear."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.q, self.k, self.v = (nn.Linear(embed_dim, embed_dim) for _ in range(3))
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, E = x.shape
        q, k, v = (
            f(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
            for f in (self.q, self.k, self.v)
        )
        att = torch.softmax(q @ k.transpose(-2, -1) / self.head_dim**0.5, dim=-1)  # (B, H, T, T)
        return self.out((att @ v).transpose(1, 2).reshape(B, T, E))  # (B, T, E)


def attention_flops(lengths: list[int], embed_dim: int) -> float:
    """Useful FLOPs of self-attention: 4 projections (8·T·E²) + QKᵀ and AV (4·T²·E) per sequence."""
    return float(sum(8 * t * embed_dim**2 + 4 * t * t * embed_dim for t in lengths))


def _calibrate(fn: Callable[[], object], min_time: float) -> int:
    """Warm up and return how many calls fill one timed block of about `min_time` seconds."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_time:
        fn()
        calls += 1
    return max(1, calls)


def time_cases(
    cases: dict[str, Callable[[], object]], repeats: int, min_time: float
) -> dict[str, float]:
    """Median seconds per call of each case; repeats are interleaved across cases so a burst of
    load from other processes hits every implementation alike and ratios stay meaningful."""
    blocks = {name: _calibrate(fn, min_time) for name, fn in cases.items()}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(blocks[name]):
                fn()
            samples[name].append((time.perf_counter() - t0) / blocks[name])
    return {name: statistics.median(values) for name, values in samples.items()}


def _engine(module: nn.Module, dtype: torch.dtype):
    return model_from_state_dict(module_config(module), module_state(module), "cpu", dtype)


def bench_shape(B: int, T: int, D: int, H: int, repeats: int, min_time: float) -> dict:
    """ms per call for every implementation at one uniform (B, T, D, H) shape."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, H, batch_first=True).eval()
    naive = NaiveAttention(D, H).eval()
    fp32, bf16 = _engine(mha, torch.float32), _engine(mha, torch.bfloat16)
    x, xb = torch.randn(B, T, D), torch.randn(B, T, D, dtype=torch.bfloat16)
    a, w = torch.randn(B * T, D), torch.randn(3 * D, D)  # the in_proj GEMM: (B*T, D) @ (D, 3D)
    ab, wb = a.bfloat16(), w.bfloat16()
    cases = {
        "engine fp32": lambda: fp32(x),
        "engine bf16": lambda: bf16(xb),
        "nn.MHA need_weights=False": lambda: mha(x, x, x, need_weights=False),
        "nn.MHA need_weights=True": lambda: mha(x, x, x, need_weights=True),
        "naive module": lambda: naive(x),
        "GEMM fp32": lambda: a @ w.T,
        "GEMM bf16": lambda: ab @ wb.T,
    }
    flops = attention_flops([T] * B, D)
    gemm_flops = 2.0 * B * T * D * 3 * D
    with torch.inference_mode():
        seconds = time_cases(cases, repeats, min_time)
    return {
        name: (sec * 1e3, (gemm_flops if name.startswith("GEMM") else flops) / sec / 1e9)
        for name, sec in seconds.items()
    }


def bench_mixed(repeats: int, min_time: float, D: int = 512, H: int = 8) -> tuple[dict, list]:
    """32 sequences of lengths 16-256 through forward_varlen, and pad+mask for reference."""
    rng = random.Random(0)
    lengths = [rng.randint(16, 256) for _ in range(32)]
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, H, batch_first=True).eval()
    fp32, bf16 = _engine(mha, torch.float32), _engine(mha, torch.bfloat16)
    seqs = [torch.randn(t, D) for t in lengths]
    seqs_bf16 = [s.bfloat16() for s in seqs]
    padded = nn.utils.rnn.pad_sequence(seqs, batch_first=True)  # (32, max_T, D)
    kpm = torch.arange(padded.shape[1])[None, :] >= torch.tensor(lengths)[:, None]
    uniform = torch.randn(32, 128, D)  # interleaved here so the mixed/uniform ratio is same-time
    cases = {
        "engine fp32 uniform (32,128)": lambda: fp32(uniform),
        "engine fp32 varlen": lambda: fp32.forward_varlen(seqs),
        "engine bf16 varlen": lambda: bf16.forward_varlen(seqs_bf16),
        "engine fp32 pad+mask": lambda: fp32(padded, key_padding_mask=kpm),
        "nn.MHA pad+mask": lambda: mha(padded, padded, padded, key_padding_mask=kpm),
    }
    flops = attention_flops(lengths, D)
    with torch.inference_mode():
        seconds = time_cases(cases, repeats, min_time)
    rows = {name: (sec * 1e3, flops / sec / 1e9) for name, sec in seconds.items()}
    uniform_name = "engine fp32 uniform (32,128)"
    rows[uniform_name] = (
        rows[uniform_name][0],
        attention_flops([128] * 32, D) / seconds[uniform_name] / 1e9,
    )
    return rows, lengths


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> None:
    """Print the table and target ratios; --quick uses fewer, shorter repeats."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 short repeats instead of 7")
    args = parser.parse_args(argv)
    repeats, min_time = (3, 0.05) if args.quick else (7, 0.2)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_model()}, "
        f"capability {torch.backends.cpu.get_cpu_capability()}, median of {repeats}\n"
    )
    results = {shape: bench_shape(*shape, repeats, min_time) for shape in SHAPES}
    print("| (B, T, D, H) | implementation | ms | GFLOP/s |")
    print("|---|---|---:|---:|")
    for shape, rows in results.items():
        for name, (ms, gflops) in rows.items():
            print(f"| {shape} | {name} | {ms:.3f} | {gflops:.1f} |")
    mixed, lengths = bench_mixed(repeats, min_time)
    label = f"mixed 32 seqs, T 16-256 (sum {sum(lengths)}), D 512, H 8"
    for name, (ms, gflops) in mixed.items():
        print(f"| {label} | {name} | {ms:.3f} | {gflops:.1f} |")

    def g(shape, name):
        return results[shape][name][1]

    main_shape, big = (32, 128, 512, 8), (8, 512, 768, 12)
    print("\n| ratio | value | target |")
    print("|---|---:|---|")
    checks = [
        (
            "engine fp32 / GEMM fp32 @ (32,128,512,8)",
            g(main_shape, "engine fp32") / g(main_shape, "GEMM fp32"),
            0.85,
        ),
        *[
            (
                f"engine fp32 / nn.MHA need_weights=False @ {s}",
                g(s, "engine fp32") / g(s, "nn.MHA need_weights=False"),
                1.5 if s == big else 1.0,
            )
            for s in SHAPES
        ],
        (
            "engine bf16 / engine fp32 @ (32,128,512,8)",
            g(main_shape, "engine bf16") / g(main_shape, "engine fp32"),
            4.0,
        ),
        (
            "engine bf16 / GEMM bf16 @ (32,128,512,8)",
            g(main_shape, "engine bf16") / g(main_shape, "GEMM bf16"),
            0.70,
        ),
        (
            "mixed varlen fp32 / uniform fp32 (32,128,512,8), interleaved (useful GFLOP/s)",
            mixed["engine fp32 varlen"][1] / mixed["engine fp32 uniform (32,128)"][1],
            0.90,
        ),
        (
            "GEMM bf16 / GEMM fp32 @ (32,128,512,8) (hardware context)",
            g(main_shape, "GEMM bf16") / g(main_shape, "GEMM fp32"),
            None,
        ),
    ]
    for name, value, target in checks:
        verdict = "info" if target is None else ("met" if value >= target else "MISSED")
        shown = "-" if target is None else f"≥ {target:g} ({verdict})"
        print(f"| {name} | {value:.2f} | {shown} |")


if __name__ == "__main__":
    main()
