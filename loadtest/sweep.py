"""Batching sweep: the same Locust load against mha-serve at several --max-batch-size ×
--max-batch-delay-ms settings; prints a table (throughput, p50/p95/p99, mean batch) and, when
matplotlib is installed, plots throughput against p99 per setting.

    python -m loadtest.sweep --batch-sizes 1,8,32 --delays-ms 0,2,5 --users 32 --duration 15

Each setting gets a fresh server on a free loopback port (so queues and metrics start empty),
warmed up by its own readiness check; Locust's stats are reset once all users are running.
Batch size 1 runs once: a batch of one is full at once, so the delay never applies.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import scrape
from benchmarks.server import running
from loadtest import report
from loadtest.run import RESULTS, new_results_dir, run


@dataclass
class SweepRow:
    max_batch_size: int
    max_batch_delay_ms: float
    requests: int
    failures: int
    rps: float
    p50: float
    p95: float
    p99: float
    mean_batch: float  # sequences per forward, from the server's mha_batch_size_sequences
    load_1min: float  # machine load average when the setting started
    exit_code: int


@contextlib.contextmanager
def serve(args: list[str], log_path: Path) -> Iterator[str]:
    """`python -m service` on a free loopback port; yields its URL once ready, stops it after."""
    with running(*args, log_path=log_path) as server:
        yield server.url


def mean_batch(url: str) -> float:
    """Mean sequences per forward so far: mha_batch_size_sequences sum / count."""
    return scrape.mean(scrape.scrape(url), "mha_batch_size_sequences")


def settings(batch_sizes: list[int], delays_ms: list[float]) -> list[tuple[int, float]]:
    """The grid, with batch size 1 only once (at the first delay)."""
    grid = [(b, d) for b in batch_sizes for d in delays_ms]
    return [(b, d) for b, d in grid if b != 1 or d == delays_ms[0]]


def markdown(rows: list[SweepRow]) -> str:
    lines = [
        "| max-batch-size | max-batch-delay-ms | req/s | p50 ms | p95 ms | p99 ms "
        "| mean batch | failures | load avg (1 min) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.max_batch_size} | {r.max_batch_delay_ms:g} | {r.rps:.1f} | {r.p50:.0f} "
            f"| {r.p95:.0f} | {r.p99:.0f} | {r.mean_batch:.1f} | {r.failures}/{r.requests} "
            f"| {r.load_1min:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[SweepRow], path: Path, title: str) -> bool:
    """Throughput vs p99, one series per batch size, points labelled by delay; False if no
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for batch in sorted({r.max_batch_size for r in rows}):
        series = [r for r in rows if r.max_batch_size == batch]
        ax.plot([r.rps for r in series], [r.p99 for r in series], "o-", label=f"batch {batch}")
        for r in series:
            ax.annotate(
                f"delay {r.max_batch_delay_ms:g} ms", (r.rps, r.p99), textcoords="offset points",
                xytext=(5, 4), fontsize=8,
            )  # fmt: skip
    ax.margins(x=0.15, y=0.1)  # room for the labels of the outermost points
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(title="--max-batch-size", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.sweep", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--batch-sizes", default="1,8,32", help="Comma list of --max-batch-size.")
    parser.add_argument("--delays-ms", default="0,2,5", help="Comma list of --max-batch-delay-ms.")
    parser.add_argument("--users", type=int, default=32, help="Concurrent Locust users.")
    parser.add_argument("--duration", type=int, default=15, help="Seconds of load per setting.")
    parser.add_argument("--seq-len", type=int, default=16, help="T of each request.")
    parser.add_argument("--classes", default="BinaryUser", help="Locust user classes (comma list).")
    parser.add_argument("--server-args", default="", help="Extra mha-serve flags, one string.")
    parser.add_argument("--results", type=Path, default=RESULTS, help="Parent results folder.")
    parser.add_argument("--plot", type=Path, help="PNG path (default: in the results folder).")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    grid = settings(
        [int(v) for v in args.batch_sizes.split(",")], [float(v) for v in args.delays_ms.split(",")]
    )
    out = new_results_dir(args.results, "sweep")
    total = len(grid) * (args.duration + 6)
    print(
        f"{len(grid)} settings x {args.duration} s (about {total} s); results in {out}", flush=True
    )
    rows: list[SweepRow] = []
    for batch, delay in grid:
        name = f"b{batch}-d{delay:g}"
        server_args = [
            "--max-batch-size", str(batch), "--max-batch-delay-ms", f"{delay:g}",
            "--max-queue", str(max(1024, batch)), "--log-level", "warning",
            *shlex.split(args.server_args),
        ]  # fmt: skip
        load = os.getloadavg()[0]
        with serve(server_args, out / f"server-{name}.log") as url:
            (out / name).mkdir()
            result = run(
                url, out / name, users=args.users, spawn_rate=args.users,
                run_time=f"{args.duration}s", classes=args.classes.split(","),
                extra=["--seq-len", str(args.seq_len), "--reset-stats"],
                timeout=args.duration + 60,
            )  # fmt: skip
            batch_mean = mean_batch(url)
        if not result.has_csv:
            print(f"{name}: Locust wrote no report (exit {result.exit_code}); see {result.log}")
            return 2
        total_row = report.aggregated(report.read_stats(result.csv_prefix))
        row = SweepRow(
            batch, delay, total_row.requests, total_row.failures, total_row.rps, total_row.p50,
            total_row.p95, total_row.p99, batch_mean, load, result.exit_code,
        )  # fmt: skip
        rows.append(row)
        print(
            f"  batch {batch:>3} delay {delay:>4g} ms: {row.rps:7.1f} req/s  p50 {row.p50:4.0f}  "
            f"p99 {row.p99:4.0f} ms  mean batch {row.mean_batch:5.1f}  failures {row.failures}  "
            f"(load {load:.2f})",
            flush=True,
        )
    loads = [r.load_1min for r in rows]
    title = (
        f"{args.users} users, T={args.seq_len}, {args.classes}, {args.duration} s per setting; "
        f"{os.cpu_count()} cores, {_cpu_model()} (load avg {min(loads):.1f}-{max(loads):.1f})"
    )
    table = markdown(rows)
    command = " ".join(argv if argv is not None else sys.argv[1:])
    header = [
        f"Command: `python -m loadtest.sweep {command}`",
        f"Date: {time.strftime('%a %b %d %H:%M:%S UTC %Y', time.gmtime())}; {title}",
    ]
    (out / "sweep.md").write_text("\n".join([*header, "", table]) + "\n")
    (out / "sweep.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    with open(out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    print("\n" + "\n".join(header) + "\n\n" + table + "\n")
    png = args.plot or out / "sweep.png"
    if plot(rows, png, title):
        print(f"Plot: {png}")
    else:
        print("matplotlib is not installed (pip install -e '.[plot]'): no plot")
    print(f"Table: {out / 'sweep.md'}")
    return 1 if any(r.failures for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
