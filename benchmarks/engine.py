"""Engine benchmark: fp32/bf16/int8 against nn.MultiheadAttention and same-run GEMM rooflines.

Run `python -m benchmarks.engine [--quick] [--threads N]` from the repository root (under
`flock /tmp/mha-bench.lock`). Every ratio comes from one run with the cases interleaved, so
load from other processes hits all of them alike. Sections: uniform shapes (fp32, bf16, nn.MHA,
GEMMs); int8 Linear kernels (ours, fbgemm per-tensor, fp32) with a bitwise batch-invariance
check; MiniLM sentences/s and a D=512 encoder layer, int8 vs fp32; mixed lengths vs uniform.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import mha_engine
from benchmarks.timing import time_cases
from mha_engine.checkpoint import model_from_state_dict
from mha_engine.quantize import Int8Linear
from mha_engine.save import module_config, module_state

SHAPES = [(1, 16, 512, 8), (32, 128, 512, 8), (8, 512, 768, 12), (64, 32, 384, 12)]
BF16_SHAPES = [(32, 128, 512, 8), (8, 512, 768, 12)]
INT8_TOKENS = 32 * 128
# (in, out) of every Linear of all-MiniLM-L6-v2 (D=384, FFN 1536) and of a D=512 layer.
INT8_SHAPES = [(384, 1152), (384, 384), (384, 1536), (1536, 384), (512, 1536), (512, 2048)]
WORDS = [
    *[
        "the",
        "search",
        "index",
        "stores",
        "dense",
        "vectors",
        "so",
        "that",
        "similar",
        "questions",
        "about",
        "databases",
    ],
    *[
        "weather",
        "football",
        "cooking",
        "pasta",
        "quantum",
        "physics",
        "and",
        "old",
        "movies",
        "land",
        "near",
        "each",
        "other",
    ],
]


def attention_flops(lengths: list[int], embed_dim: int) -> float:
    """Useful FLOPs of self-attention: 4 projections (8·T·E²) + QKᵀ and AV (4·T²·E) per sequence."""
    return float(sum(8 * t * embed_dim**2 + 4 * t * t * embed_dim for t in lengths))


def _engine(module: nn.Module, dtype: str | torch.dtype):
    return model_from_state_dict(module_config(module), module_state(module), "cpu", dtype)


def bench_shape(B: int, T: int, D: int, H: int, repeats: int, min_time: float) -> dict:
    """ms and GFLOP/s per implementation at one uniform (B, T, D, H) shape."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, H, batch_first=True).eval()
    fp32 = _engine(mha, torch.float32)
    x = torch.randn(B, T, D)
    a, w = torch.randn(B * T, D), torch.randn(3 * D, D)  # the in_proj GEMM: (B*T, D) @ (D, 3D)
    cases = {
        "engine fp32": lambda: fp32(x),
        "nn.MHA need_weights=False": lambda: mha(x, x, x, need_weights=False),
        "GEMM fp32": lambda: a @ w.T,
    }
    if (B, T, D, H) in BF16_SHAPES:
        bf16, xb, ab, wb = _engine(mha, torch.bfloat16), x.bfloat16(), a.bfloat16(), w.bfloat16()
        cases["engine bf16"] = lambda: bf16(xb)
        cases["GEMM bf16"] = lambda: ab @ wb.T
    flops, gemm_flops = attention_flops([T] * B, D), 2.0 * B * T * D * 3 * D
    with torch.inference_mode():
        seconds = time_cases(cases, repeats, min_time)
    return {
        name: (sec * 1e3, (gemm_flops if name.startswith("GEMM") else flops) / sec / 1e9)
        for name, sec in seconds.items()
    }


def _rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """Are rows 0-7 bit-identical computed alone and inside the full batch (with a loud row)?"""
    loud = x.clone()
    loud[-1] *= 100.0  # a batch-mate with a much larger range
    full = fn(loud)
    return all(torch.equal(fn(x[i : i + 1])[0], full[i]) for i in range(8))


def bench_int8_kernels(repeats: int, min_time: float) -> list[tuple]:
    """One Linear at N = 32*128 tokens: fp32, fbgemm per-tensor dynamic, our Int8Linear."""
    rows = []
    for K, M in INT8_SHAPES:
        torch.manual_seed(0)
        linear = nn.Linear(K, M).eval()
        x = torch.randn(INT8_TOKENS, K)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
            fbgemm = torch.ao.quantization.quantize_dynamic(
                nn.Sequential(linear), {nn.Linear}, dtype=torch.qint8
            )
        ours = Int8Linear.from_linear(linear)
        cases = {
            name: (lambda fn=fn, x=x: fn(x))
            for name, fn in (("fp32", linear), ("fbgemm", fbgemm), ("ours", ours))
        }
        with torch.inference_mode():
            seconds = time_cases(cases, repeats, min_time)
            want = linear(x)
            errors = {
                name: float((fn(x) - want).norm() / want.norm())
                for name, fn in (("fbgemm", fbgemm), ("ours", ours))
            }
            invariant = {"fbgemm": _rows_invariant(fbgemm, x), "ours": _rows_invariant(ours, x)}
        for name in ("fbgemm", "ours"):
            rows.append(
                (K, M, name, seconds[name] * 1e3, seconds["fp32"] / seconds[name],
                 errors[name], invariant[name])
            )  # fmt: skip
        rows.append((K, M, "fp32", seconds["fp32"] * 1e3, 1.0, 0.0, True))
    return rows


def sentences(count: int = 32) -> list[str]:
    """A fixed set of `count` sentences of mixed lengths (about 4 to 200 tokens)."""
    rng = random.Random(0)
    out = ["Hi", "A man is eating food.", "What is the capital of France?"]
    while len(out) < count:
        n = rng.choice([6, 12, 20, 40, 80, 160])
        out.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return out


def bench_minilm(repeats: int, min_time: float) -> dict | None:
    """all-MiniLM-L6-v2, 32 sentences: tokenize + encode + pool, fp32 vs int8 engine."""
    from service.text.tokenizer import minilm_path

    path = minilm_path()
    if path is None:
        return None
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(256)
    texts = sentences()
    models = {p: mha_engine.load_model(path, device="cpu", dtype=p) for p in ("float32", "int8")}

    def run(model) -> torch.Tensor:
        ids = [torch.tensor(e.ids) for e in tokenizer.encode_batch(texts)]
        return model.embed_varlen(ids)

    with torch.inference_mode():
        cases = {p: (lambda m=m: run(m)) for p, m in models.items()}
        seconds = time_cases(cases, repeats, min_time)
        cosine = F.cosine_similarity(run(models["int8"]), run(models["float32"]))
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    return {
        "sentences/s": {p: len(texts) / s for p, s in seconds.items()},
        "min cosine": float(cosine.min()),
        "mean cosine": float(cosine.mean()),
        "lengths": (min(lengths), max(lengths), sum(lengths)),
    }


def bench_encoder_layer(repeats: int, min_time: float) -> dict:
    """The demo encoder layer (D=512, 8 heads, FFN 2048): 32 x 128 packed tokens, int8 vs fp32."""
    models = {p: mha_engine.build_demo_model(device="cpu", dtype=p) for p in ("float32", "int8")}
    torch.manual_seed(0)
    seqs = [torch.randn(128, 512) for _ in range(32)]
    with torch.inference_mode():
        cases = {p: (lambda m=m: m.forward_varlen(seqs)) for p, m in models.items()}
        seconds = time_cases(cases, repeats, min_time)
        got, want = (torch.cat(models[p].forward_varlen(seqs)) for p in ("int8", "float32"))
    cosine = F.cosine_similarity(got, want, dim=-1)
    return {"ms": {p: s * 1e3 for p, s in seconds.items()}, "min cosine": float(cosine.min())}


def bench_mixed(repeats: int, min_time: float, D: int = 512, H: int = 8) -> tuple[dict, list]:
    """32 sequences of lengths 16-256 through forward_varlen (exact and opt-in buckets)."""
    rng = random.Random(0)
    lengths = [rng.randint(16, 256) for _ in range(32)]
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, H, batch_first=True).eval()
    fp32 = _engine(mha, torch.float32)
    seqs = [torch.randn(t, D) for t in lengths]
    padded = nn.utils.rnn.pad_sequence(seqs, batch_first=True)  # (32, max_T, D)
    kpm = torch.arange(padded.shape[1])[None, :] >= torch.tensor(lengths)[:, None]
    uniform = torch.randn(32, 128, D)
    cases = {
        "engine fp32 uniform (32,128)": lambda: fp32(uniform),
        "engine fp32 varlen (exact)": lambda: fp32.forward_varlen(seqs),
        "engine fp32 varlen (bucket_padding=0.1)": lambda: fp32.forward_varlen(
            seqs, bucket_padding=0.1
        ),
        "engine fp32 pad+mask": lambda: fp32(padded, key_padding_mask=kpm),
    }
    flops = attention_flops(lengths, D)
    with torch.inference_mode():
        seconds = time_cases(cases, repeats, min_time)
    rows = {name: (sec * 1e3, flops / sec / 1e9) for name, sec in seconds.items()}
    name = "engine fp32 uniform (32,128)"
    rows[name] = (rows[name][0], attention_flops([128] * 32, D) / seconds[name] / 1e9)
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


def _verdict(value: float, target: float | None) -> str:
    if target is None:
        return "-"
    return f"≥ {target:g} ({'met' if value >= target else 'MISSED'})"


def main(argv: list[str] | None = None) -> None:
    """Print the tables and the target ratios; --quick uses fewer, shorter repeats."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 short repeats instead of 5")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--no-malloc-tuning",
        action="store_true",
        help="leave glibc's malloc defaults (the service keeps freed buffers in the heap)",
    )
    args = parser.parse_args(argv)
    if not args.no_malloc_tuning:
        mha_engine.tune_cpu_allocator()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats, min_time = (3, 0.05) if args.quick else (5, 0.15)
    started = time.perf_counter()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_model()}, "
        f"capability {torch.backends.cpu.get_cpu_capability()}, median of {repeats}, "
        f"malloc {'kept' if mha_engine.cpu_allocator_tuned() else 'glibc defaults'}\n"
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

    print(f"\nint8 Linear kernels, N = {INT8_TOKENS} tokens (invariant: rows bit-identical alone)")
    print("| (in, out) | kernel | ms | × fp32 | rel. error vs fp32 | batch invariant |")
    print("|---|---|---:|---:|---:|---|")
    for K, M, name, ms, speed, error, invariant in bench_int8_kernels(repeats, min_time):
        label = {"ours": "Int8Linear (per-token)", "fbgemm": "fbgemm per-tensor"}.get(name, name)
        print(f"| ({K}, {M}) | {label} | {ms:.2f} | {speed:.2f} | {error:.4f} | {invariant} |")

    minilm = bench_minilm(repeats, min_time)
    layer = bench_encoder_layer(repeats, min_time)
    if minilm is not None:
        lo, hi, total = minilm["lengths"]
        print(f"\nMiniLM, 32 sentences ({lo}-{hi} tokens, {total} in all): tokenize+encode+pool")
        for p, rate in minilm["sentences/s"].items():
            print(f"- {p}: {rate:.1f} sentences/s")
        print(f"- int8 cosine to fp32: min {minilm['min cosine']:.4f}, mean "
              f"{minilm['mean cosine']:.4f}")  # fmt: skip
    ms = layer["ms"]
    print(f"\nD=512 encoder layer, 32 x 128 tokens: fp32 {ms['float32']:.1f} ms, "
          f"int8 {ms['int8']:.1f} ms, min token cosine {layer['min cosine']:.4f}")  # fmt: skip

    def g(shape, name):
        return results[shape][name][1]

    main_shape = (32, 128, 512, 8)
    checks = [
        ("engine fp32 / GEMM fp32 @ (32,128,512,8)",
         g(main_shape, "engine fp32") / g(main_shape, "GEMM fp32"), 0.85),
        *[(f"engine fp32 / nn.MHA need_weights=False @ {s}",
           g(s, "engine fp32") / g(s, "nn.MHA need_weights=False"), 1.0) for s in SHAPES],
    ]  # fmt: skip
    for s in BF16_SHAPES:
        engine_gain = g(s, "engine bf16") / g(s, "engine fp32")
        gemm_gain = g(s, "GEMM bf16") / g(s, "GEMM fp32")
        checks += [
            (f"engine bf16 / engine fp32 @ {s}", engine_gain, None),
            (f"GEMM bf16 / GEMM fp32 @ {s}", gemm_gain, None),
            (f"(engine bf16 gain) / (GEMM bf16 gain) @ {s}", engine_gain / gemm_gain, 0.8),
        ]
    uniform = mixed["engine fp32 uniform (32,128)"][1]
    checks += [
        ("mixed varlen exact / uniform (useful GFLOP/s)",
         mixed["engine fp32 varlen (exact)"][1] / uniform, 0.95),
        ("mixed varlen bucket_padding=0.1 (opt-in) / uniform",
         mixed["engine fp32 varlen (bucket_padding=0.1)"][1] / uniform, 0.95),
    ]  # fmt: skip
    if minilm is not None:
        rate = minilm["sentences/s"]
        checks += [
            ("MiniLM int8 / fp32 sentences/s", rate["int8"] / rate["float32"], 2.5),
            ("MiniLM int8 min cosine to fp32", minilm["min cosine"], 0.99),
        ]
    checks.append(("D=512 layer int8 / fp32", layer["ms"]["float32"] / layer["ms"]["int8"], 2.5))
    print("\n| ratio | value | target |")
    print("|---|---:|---|")
    for name, value, target in checks:
        print(f"| {name} | {value:.3f} | {_verdict(value, target)} |")
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
