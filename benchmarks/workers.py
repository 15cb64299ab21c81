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

import numpy as np
import torch

from benchmarks import scrape
from benchmarks.server import running
from benchmarks.serving import MHA_PATH, _many, request, save_mha

CLK = os.sysconf("SC_CLK_TCK")
STARTED = re.compile(r"started (mha-engine|mha-frontend-\d+) \(pid (\d+)\)")
SUITES = {"tiny": ((16, 2), (1, 16)), "mha": ((512, 8), (16, 128))}  # (D, heads), T values


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of `pid` from /proc/<pid>/stat; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK


def tree(root: int) -> dict[int, float]:
    """pid -> CPU seconds of `root` and every live descendant (a scan of /proc by parent pid,
    so no psutil is needed and nothing depends on CONFIG_PROC_CHILDREN)."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (s := _stat(int(name))) is not None:
            stats[int(name)] = s
    out, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in stats:
            out[pid] = stats[pid][1]
            frontier += [p for p, (ppid, _) in stats.items() if ppid == pid]
    return out


def thread_cpu(pid: int, tid: int) -> float:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


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
    for pid in tree(server.process.pid):
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
    before = tree(pid)
    loop_before = thread_cpu(pid, pid) if workers == 1 else 0.0
    client_before = time.process_time()
    result = fn()
    client = time.process_time() - client_before
    after = tree(pid)
    window = Window(client=client)
    for p, cpu in after.items():
        role = who.get(p, "other")
        window.by_role[role] = window.by_role.get(role, 0.0) + cpu - before.get(p, 0.0)
    if workers == 1:  # the main thread is the event loop: the front-end's share of the process
        loop = thread_cpu(pid, pid) - loop_before
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


def copy_gb_s(nbytes: int) -> float:
    """memcpy rate of `nbytes` arrays on this machine (median of single copies, so the other
    sessions' load preempting a few does not count), for the engine's staging copy."""
    src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    times = []
    for _ in range(1000):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / float(np.median(times)) / 1e9


def channel_ms(seq_len: int, embed_dim: int, repeats: int = 2000) -> tuple[float, float]:
    """(front-end ms, engine ms) per request spent on the channel alone: the submit message
    and the reply pickled, framed and parsed, tensors through a slab, as service.workers does
    it, in one process (no syscalls, wake-ups or batching); median wall time per phase."""
    from service.forward import hidden_states
    from service.inputs import Payload
    from service.workers.channel import FrameBuffer, frame
    from service.workers.slab import Slab
    from service.workers.wire import (
        payload_from_wire,
        payload_to_wire,
        result_from_wire,
        result_to_wire,
    )

    slab = Slab(64 << 20)
    x = np.ones((seq_len, embed_dim), np.float32)
    fronts, engines = [], []
    clock = time.perf_counter  # process_time is a syscall here, dearer than what it would time
    for i in range(repeats):
        t0 = clock()
        regions: list[tuple[int, int]] = []
        out = (slab.alloc(x.nbytes), x.nbytes)
        regions.append(out)
        wire = payload_to_wire(Payload(x, [seq_len]), slab, regions)
        data = frame(("submit", i, ("mha", "1"), hidden_states, 1e9, wire, out))
        t1 = clock()
        (message,) = FrameBuffer().feed(data)
        payload = payload_from_wire(message[5], slab)
        reply = frame(("done", i, *result_to_wire(slab, message[6], payload.query)))
        t2 = clock()
        (done,) = FrameBuffer().feed(reply)
        result_from_wire(slab, out, done[2:])
        for offset, nbytes in regions:
            slab.free(offset, nbytes)
        t3 = clock()
        fronts.append((t1 - t0) + (t3 - t2))
        engines.append(t2 - t1)
    slab.close()
    return float(np.median(fronts)) * 1e3, float(np.median(engines)) * 1e3  # median: not preempted


def _mean(rows: list[dict], key: str, **match) -> float:
    values = [r[key] for r in rows if all(r[k] == v for k, v in match.items())]
    return sum(values) / len(values) if values else float("nan")


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


# Assumed GPU engine rates (sequences/s) of an MHA(512, 8) block on one H100, fp32, batches of
# 32; NOT measured (no GPU on this task), see BENCHMARKS.md for the arithmetic.
GPU_SEQ_S = {16: 150_000, 128: 50_000}


def engine_fit(rows: list[dict]) -> tuple[float, float]:
    """(ms per request, ms per batch) of the engine side (engine process, or the single
    process's threads other than the event loop), least squares of engine CPU per request
    against 1 / mean batch over the tiny-model rows, where compute is almost nothing."""
    pts = [(1 / r["batch_mean"], r["engine_cpu_ms"]) for r in rows
           if r["D"] == 16 and r["batch_mean"] == r["batch_mean"]]  # fmt: skip
    x, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    per_req, per_batch = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)[0]
    if per_req < 0:  # within noise of nothing: all of it per batch
        per_req, per_batch = 0.0, float(x @ y / (x @ x))
    return float(per_req), float(per_batch)


def print_ceiling(rows: list[dict], batch: int = 32) -> None:
    """Expected req/s (one sequence each) for N front-ends: the least of N / front-end CPU
    per request (a core each), the engine process's 1 / CPU per request at full batches (its
    Python is one GIL: about one core), and the GPU's sequences/s (assumed)."""
    per_req, per_batch = engine_fit(rows)
    print(f"\nengine side, fitted on the tiny rows: {per_req:.3f} ms/request + "
          f"{per_batch:.2f} ms/batch; at batches of {batch}: "
          f"{per_req + per_batch / batch:.3f} ms/request")  # fmt: skip
    print("| T | front-end CPU ms/req (D=512, workers > 1) | engine-side ms/req at full batches "
          "| GPU seq/s (assumed) | 1 front-end | 4 | 8 | 16 | limit at 16 |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    multi = [r for r in rows if r["workers"] > 1 and r["D"] == 512]
    for seq_len, gpu in GPU_SEQ_S.items():
        front = _mean(multi, "frontend_cpu_ms", T=seq_len)
        nbytes = seq_len * 512 * 4
        # the engine's copy of the input into the batch (the output copy is in channel_ms)
        copies = nbytes / (copy_gb_s(nbytes) * 1e9) * 1e3
        chan_front, chan_engine = channel_ms(seq_len, 512)
        print(f"T={seq_len}: channel alone {chan_front:.3f} ms front-end, "
              f"{chan_engine:.3f} ms engine per request", file=sys.stderr)  # fmt: skip
        eng = max(per_req, chan_engine) + per_batch / batch + copies
        cells, limit = [], ""
        for n in (1, 4, 8, 16):
            limits = {"front-ends": n / front * 1e3, "engine process": 1e3 / eng, "GPU": gpu}
            limit = min(limits, key=limits.get)
            cells.append(f"{limits[limit]:,.0f}")
        print(f"| {seq_len} | {front:.2f} | {eng:.3f} (copies {copies:.3f}) | {gpu:,} | "
              + " | ".join(cells) + f" | {limit} |")  # fmt: skip


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
