"""Decoder layer benchmark: the engine's transformer_decoder against PyTorch's eager
nn.TransformerDecoderLayer (batch_first, eval, no_grad), causal self-attention + cross-attention.

Run `flock /work/bench.lock python -m benchmarks.decoder [--quick] [--threads N]` from the
repository root. Per shape the cases run interleaved (benchmarks.timing.time_cases), so load from
other processes hits them alike and the ratios come from one run. Uniform shapes compare the
dense forward with PyTorch's; the mixed shape compares the engine's packed forward (no padding)
with PyTorch on the padded batch with both key padding masks.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch import nn

from benchmarks.engine import _engine, cpu_model
from benchmarks.timing import time_cases

# (B, T, S, d_model, nhead, dim_feedforward): target length T, memory length S
UNIFORM = [(8, 64, 128, 512, 8, 2048), (32, 32, 64, 256, 4, 1024)]
MIXED = (32, (16, 128), (32, 256), 512, 8, 2048)  # B, T range, S range, D, H, FF


def _layer(D: int, H: int, FF: int) -> nn.TransformerDecoderLayer:
    torch.manual_seed(0)
    return nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True).eval()


def bench_uniform(B, T, S, D, H, FF, repeats, min_time) -> dict[str, float]:
    """ms per call: engine dense and packed forward vs PyTorch eager, causal target."""
    layer = _layer(D, H, FF)
    model = _engine(layer, torch.float32)
    tgt, mem = torch.randn(B, T, D), torch.randn(B, S, D)
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    tgts, mems = list(tgt.unbind(0)), list(mem.unbind(0))
    cases = {
        "nn.TransformerDecoderLayer (eager)": lambda: layer(
            tgt, mem, tgt_mask=causal, tgt_is_causal=True
        ),
        "engine dense forward": lambda: model(tgt, mem, tgt_is_causal=True),
        "engine packed forward_varlen": lambda: model.forward_varlen(tgts, mems, True),
    }
    with torch.inference_mode():
        want = layer(tgt, mem, tgt_mask=causal, tgt_is_causal=True)
        error = (model(tgt, mem, tgt_is_causal=True) - want).abs().max().item()
        seconds = time_cases(cases, repeats, min_time)
    return {**{k: v * 1e3 for k, v in seconds.items()}, "max abs error": error}


def bench_mixed(repeats, min_time) -> tuple[dict[str, float], int, int]:
    """Mixed lengths: engine packed (no padding) vs PyTorch padded with both padding masks."""
    B, (t0, t1), (s0, s1), D, H, FF = MIXED
    rng = random.Random(0)
    t_lens = [rng.randint(t0, t1) for _ in range(B)]
    s_lens = [rng.randint(s0, s1) for _ in range(B)]
    layer = _layer(D, H, FF)
    model = _engine(layer, torch.float32)
    tgts = [torch.randn(t, D) for t in t_lens]
    mems = [torch.randn(s, D) for s in s_lens]
    tgt = nn.utils.rnn.pad_sequence(tgts, batch_first=True)  # (B, T_max, D)
    mem = nn.utils.rnn.pad_sequence(mems, batch_first=True)  # (B, S_max, D)
    tgt_kpm = torch.arange(tgt.shape[1])[None] >= torch.tensor(t_lens)[:, None]
    mem_kpm = torch.arange(mem.shape[1])[None] >= torch.tensor(s_lens)[:, None]
    causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
    masks = {"tgt_key_padding_mask": tgt_kpm, "memory_key_padding_mask": mem_kpm}
    cases = {
        "nn.TransformerDecoderLayer padded + masks (eager)": lambda: layer(
            tgt, mem, tgt_mask=causal, tgt_is_causal=True, **masks
        ),
        "engine dense padded + masks": lambda: model(tgt, mem, tgt_is_causal=True, **masks),
        "engine packed forward_varlen": lambda: model.forward_varlen(tgts, mems, True),
    }
    with torch.inference_mode():
        seconds = time_cases(cases, repeats, min_time)
    return {k: v * 1e3 for k, v in seconds.items()}, sum(t_lens), sum(s_lens)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 short repeats instead of 5")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats, min_time = (3, 0.05) if args.quick else (5, 0.2)
    started = time.perf_counter()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_model()}, "
        f"capability {torch.backends.cpu.get_cpu_capability()}, median of {repeats}\n"
    )
    print("| shape | implementation | ms | × eager |")
    print("|---|---|---:|---:|")
    for B, T, S, D, H, FF in UNIFORM:
        rows = bench_uniform(B, T, S, D, H, FF, repeats, min_time)
        error = rows.pop("max abs error")
        base = rows["nn.TransformerDecoderLayer (eager)"]
        label = f"B={B}, T={T}, S={S}, D={D}, H={H}, FF={FF}, causal"
        for name, ms in rows.items():
            print(f"| {label} | {name} | {ms:.2f} | {base / ms:.2f} |")
        print(f"| {label} | max abs difference engine vs eager | {error:.1e} | |")
    rows, n_tgt, n_mem = bench_mixed(repeats, min_time)
    base = rows["nn.TransformerDecoderLayer padded + masks (eager)"]
    B, (t0, t1), (s0, s1), D, H, FF = MIXED
    label = f"mixed B={B}, T {t0}-{t1} (sum {n_tgt}), S {s0}-{s1} (sum {n_mem}), D={D}, causal"
    for name, ms in rows.items():
        print(f"| {label} | {name} | {ms:.2f} | {base / ms:.2f} |")
    print(f"\n(× eager: PyTorch's time / this row's time; {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
