"""`--workers N`: req/s and CPU per request of one process against an engine process behind N
front-end processes, interleaved in one run, and the ceilings those costs imply.

`python -m benchmarks.workers [--suite tiny|mha] [--seconds 4] [--rounds 2] [--workers 1,2]`
(under `flock /tmp/mha-bench.lock`). `tiny`: an `nn.MultiheadAttention(16, 2)` so the engine
costs almost nothing and the front-end is the limit (T=1 and T=16 on each server); `mha`:
`nn.MultiheadAttention(512, 8)` at T=16 and T=128. Each round starts a fresh server per
`--workers` value (w1, w2, w1, w2, ...), measures every T on it with `clients` closed-loop
keep-alive connections from the lean client in this process, and reads from /proc the CPU of
the whole server process tree (supervisor, engine, front-ends, multiprocessing's resource
tracker), split by role, and the client's own CPU (this process: it shares the same cores).
`--ceiling FILE.json` (rows of earlier runs, repeatable) prints the table of expected ceilings
for 1, 4, 8 and 16 front-ends against an assumed GPU engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import scrape
from benchmarks.server import proc_cpu, running, tree_cpu
from benchmarks.serving import MHA_PATH, _many, request, save_mha

STARTED = re.compile(r"started (mha-engine|mha-frontend-\d+) \(pid (\d+)\)")
SUITES = {"tiny": ((16, 2), (1, 16)), "mha": ((512, 8), (16, 128))}  # (D, heads), T values


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def connections(pids: list[int], port: int) -> list[int]:
    """Established TCP connections on local `port` held by each of `pids` (their socket fds
    matched against /proc/net/tcp), to see how the kernel spread the clients."""
    inodes = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "01":
                    inodes.add(cols[9])
    counts = []
    for pid in pids:
        n = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            n += target.startswith("socket:[") and target[8:-1] in inodes
        counts.append(n)
    return counts


def roles(server, workers: int) -> dict[int, str]:
    """pid -> role of each server process ('engine', 'front-end N', 'supervisor', 'other')."""
    if workers == 1:
        return {server.process.pid: "single process"}
    named = {int(pid): name for name, pid in STARTED.findall(server.log())}
    out = {}
    for pid in tree_cpu(server.process.pid):
        name = named.get(pid)
        if pid == server.process.pid:
            out[pid] = "supervisor"
        elif name == "mha-engine":
            out[pid] = "engine"
        elif name:
            out[pid] = "front-end " + name.rsplit("-", 1)[1]
        else:
            out[pid] = "other"  # multiprocessing's resource tracker
    return out


@dataclass
class Window:
    """CPU seconds of the server tree, by role, and of the client, over one measured window."""

    by_role: dict[str, float] = field(default_factory=dict)
    client: float = 0.0


def measure(server, workers: int, fn) -> tuple[object, Window]:
    """Run `fn()` (the load) and the CPU every server process and the client spent meanwhile."""
    who = roles(server, workers)
    pid = server.process.pid
    before = tree_cpu(pid)
    loop_before = sum(proc_cpu(pid, pid)) if workers == 1 else 0.0
    client_before = time.process_time()
    result = fn()
    client = time.process_time() - client_before
    after = tree_cpu(pid)
    window = Window(client=client)
    for p, cpu in after.items():
        role = who.get(p, "other")
        window.by_role[role] = window.by_role.get(role, 0.0) + cpu - before.get(p, 0.0)
    if workers == 1:  # the main thread is the event loop: the front-end's share of the process
        loop = sum(proc_cpu(pid, pid)) - loop_before
        window.by_role = {"front-end 0": loop, "engine": window.by_role["single process"] - loop}
    return result, window


def batch_mean(before: str, after: str) -> float:
    """Mean batch size (sequences) over the window, from the engine's histogram."""
    name = "mha_batch_size_sequences"
    count = scrape.value(after, f"{name}_count", 0.0) - scrape.value(before, f"{name}_count", 0.0)
    total = scrape.value(after, f"{name}_sum", 0.0) - scrape.value(before, f"{name}_sum", 0.0)
    return total / count if count else float("nan")


def run_server(args, model_dir: Path, dims: tuple[int, int], lens, workers: int, rnd: int, log):
    """One fresh server with `--workers workers`: a row per T."""
    rows = []
    server_args = ["--model-dir", str(model_dir), "--workers", str(workers), *args.server_args]
    with running(*server_args, log_path=log) as server:
        rss = {}
        for seq_len in lens:
            body, headers = request("binary", seq_len, dims[0])

            def load(seconds: float, body=body, headers=headers):
                return asyncio.run(
                    _many(server.port, MHA_PATH, [body], headers, args.clients, seconds)
                )

            load(args.warmup)
            load_avg = os.getloadavg()[0]
            text_before = scrape.scrape(server.url)
            conns: list[int] = []

            def measured(load=load, conns=conns):
                async def both():
                    task = asyncio.create_task(asyncio.to_thread(load, args.seconds))
                    await asyncio.sleep(min(1.0, args.seconds / 2))  # clients connected
                    fronts = [p for p, r in roles(server, workers).items() if "front" in r]
                    conns.extend(connections(fronts or [server.process.pid], server.port))
                    return await task

                return asyncio.run(both())

            result, window = measure(server, workers, measured)
            text_after = scrape.scrape(server.url)
            n = max(result.completed, 1)
            front = sum(v for k, v in window.by_role.items() if k.startswith("front-end"))
            rows.append({
                "suite": args.suite, "D": dims[0], "T": seq_len, "workers": workers,
                "round": rnd, "load_avg": load_avg, "req_s": result.rps,
                "p50_ms": result.percentile(50) * 1e3, "p99_ms": result.percentile(99) * 1e3,
                "server_cpu_ms": sum(window.by_role.values()) / n * 1e3,
                "frontend_cpu_ms": front / n * 1e3,
                "engine_cpu_ms": window.by_role.get("engine", 0.0) / n * 1e3,
                "rest_cpu_ms": sum(v for k, v in window.by_role.items()
                                   if k in ("supervisor", "other")) / n * 1e3,
                "client_cpu_ms": window.client / n * 1e3,
                "frontend_split": sorted(
                    round(v / front, 2) for k, v in window.by_role.items()
                    if k.startswith("front-end")) if front else [],
                "batch_mean": batch_mean(text_before, text_after),
                "connections": conns,
                "non_200": sum(c for s, c in result.statuses.items() if s != 200),
            })  # fmt: skip
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        who = roles(server, workers)
        for pid, role in who.items():
            rss[role] = rss.get(role, 0.0) + rss_mib(pid)
        for row in rows:
            row["rss_mib"] = rss
    return rows


def run(args) -> list[dict]:
    dims, lens = SUITES[args.suite]
    lens = args.lens or lens
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_mha(Path(tmp), *dims)
        for rnd in range(1, args.rounds + 1):
            for workers in args.workers:
                log = Path(tmp) / f"server-{rnd}-{workers}.log"
                rows += run_server(args, model_dir, dims, lens, workers, rnd, log)
    return rows


def print_runs(rows: list[dict]) -> None:
    print("| D | T | workers | round | load avg | req/s | p50 ms | p99 ms | server CPU ms/req | "
          "front-ends | engine | supervisor + tracker | client CPU ms/req | front-end CPU split "
          "| connections per front-end | mean batch | non-200 |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|")
    for r in rows:
        split = " / ".join(f"{s:.0%}" for s in r["frontend_split"]) if r["workers"] > 1 else "-"
        print(
            f"| {r['D']} | {r['T']} | {r['workers']} | {r['round']} | {r['load_avg']:.1f} | "
            f"{r['req_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['server_cpu_ms']:.2f} | {r['frontend_cpu_ms']:.2f} | {r['engine_cpu_ms']:.2f} | "
            f"{r['rest_cpu_ms']:.2f} | {r['client_cpu_ms']:.2f} | {split} | "
            f"{' / '.join(map(str, r.get('connections', []))) or '-'} | "
            f"{r['batch_mean']:.1f} | {r['non_200']} |"
        )


def print_ratios(rows: list[dict], workers: list[int]) -> None:
    """Each configuration against the first, round by round (so both shared the same load)."""
    base = workers[0]
    print(f"\n| D | T | round | workers | req/s ÷ w{base} | server CPU/req ÷ w{base} |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["workers"] == base:
            continue
        b = next(x for x in rows if x["workers"] == base and x["round"] == r["round"]
                 and x["T"] == r["T"] and x["D"] == r["D"])  # fmt: skip
        print(
            f"| {r['D']} | {r['T']} | {r['round']} | {r['workers']} | "
            f"{r['req_s'] / b['req_s']:.2f} | {r['server_cpu_ms'] / b['server_cpu_ms']:.2f} |"
        )


def print_rss(rows: list[dict]) -> None:
    seen = set()
    print("\n| workers | resident memory per process (MiB, after the run) |")
    print("|---:|---|")
    for r in rows:
        key = (r["D"], r["workers"])
        if key in seen:
            continue
        seen.add(key)
        cells = ", ".join(f"{role} {mib:.0f}" for role, mib in sorted(r["rss_mib"].items()))
        print(f"| {r['workers']} (D={r['D']}) | {cells} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=SUITES, default="tiny")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per T")
    parser.add_argument("--warmup", type=float, default=1.0, help="load seconds before each T")
    parser.add_argument("--clients", type=int, default=32, help="closed-loop connections")
    parser.add_argument("--rounds", type=int, default=2, help="times each configuration runs")
    parser.add_argument("--workers", default="1,2", help="--workers values, in order per round")
    parser.add_argument("--lens", type=lambda v: [int(t) for t in v.split(",")],
                        help="T values instead of the suite's, e.g. 128")  # fmt: skip
    parser.add_argument("--server-args", default="", help="extra server flags")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--ceiling", type=Path, action="append",
        help="print only the ceiling table from these --json files (tiny and mha rows)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.ceiling:
        from benchmarks.workers_ceiling import print_ceiling

        print_ceiling([r for path in args.ceiling for r in json.loads(path.read_text())])
        return
    args.workers = [int(w) for w in args.workers.split(",")]
    args.server_args = args.server_args.split()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"date: {when}; {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load avg {os.getloadavg()[0]:.2f}; suite {args.suite}; {args.clients} clients; "
        f"{args.seconds:g} s per T; workers {args.workers} x {args.rounds} rounds; "
        f"server args {' '.join(args.server_args) or '-'}"
    )
    rows = run(args)
    print(f"load avg after: {os.getloadavg()[0]:.2f}\n")
    print_runs(rows)
    print_ratios(rows, args.workers)
    print_rss(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
