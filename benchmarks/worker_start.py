"""`--workers N`: how long a start and a restart take, and the memory of the process tree,
with children forked from a preloaded fork server (`--worker-start forkserver`, the default)
against fresh interpreters (`--worker-start spawn`), and with the engine's compiled C kernels
loaded from their cache or compiled (`--kernel-cache off,on`), interleaved in one run.

`python -m benchmarks.worker_start [--workers 2,4] [--rounds 3] [--modes spawn,forkserver]
[--kernel-cache on]` (under `flock /work/bench.lock`).
Per round and mode: start the default model with `--workers N` and time it to /v2/health/ready;
read the tree's CPU seconds and proportional memory (Pss, /proc/*/smaps_rollup); SIGKILL
front-end 0 and time it until the supervisor's replacement logs that it is linked to the
engine; SIGKILL the engine and time it until /v2/health/ready answers 200 again.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.server import Proc, running, tree_cpu
from mha_engine import cpu_varlen, int8_rows

MODES = ("spawn", "forkserver")


def tree_pss_mb(root: int) -> float:
    """Proportional set size of `root` and its descendants, MB (shared pages split fairly)."""
    total = 0
    for pid in tree_cpu(root):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def wait_log(proc: Proc, pattern: str, start: int, timeout: float = 60) -> re.Match:
    """The first match of `pattern` in the server log after byte `start`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, proc.log_path.read_text()[start:])
        if found:
            return found
        time.sleep(0.02)
    raise TimeoutError(f"no {pattern!r} in the log within {timeout} s")


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def measure(mode: str, workers: int, cache: str, tmp: Path) -> dict[str, float]:
    log_path = tmp / f"{mode}-{workers}-{time.monotonic_ns()}.log"
    args = ("--workers", str(workers), "--worker-start", mode)  # the default model
    # "on": a cache of this run's own, filled by its first start; "off": every process compiles
    env = {"MHA_ENGINE_CACHE_DIR": "off" if cache == "off" else str(tmp / "kernel-cache")}
    began = time.monotonic()
    with running(*args, log_path=log_path, env=env) as proc:
        row = {"start_s": time.monotonic() - began}
        row["cpu_s"] = sum(tree_cpu(proc.process.pid).values())
        row["pss_mb"] = tree_pss_mb(proc.process.pid)
        mark = len(proc.log_path.read_text())
        frontend = int(re.findall(r"started mha-frontend-0 \(pid (\d+)\)", proc.log())[-1])
        began = time.monotonic()
        os.kill(frontend, signal.SIGKILL)
        wait_log(proc, r"started mha-frontend-0 \(pid \d+\)", mark)
        wait_log(proc, r"front-end 0 ready", mark)
        row["frontend_restart_s"] = time.monotonic() - began
        engine = int(re.findall(r"started mha-engine \(pid (\d+)\)", proc.log())[-1])
        began = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        while ready(proc.url):  # until the front-ends see it gone
            time.sleep(0.01)
        while not ready(proc.url):
            time.sleep(0.02)
        row["engine_restart_s"] = time.monotonic() - began
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--kernel-cache", default="on", help="on, off, or off,on")
    opts = parser.parse_args()
    counts = [int(n) for n in opts.workers.split(",")]
    modes, caches = opts.modes.split(","), opts.kernel_cache.split(",")
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"python {sys.version.split()[0]}"
    )
    rows: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "on" in caches:  # filled first: the "on" rows start with the kernels cached
            os.environ["MHA_ENGINE_CACHE_DIR"] = str(Path(tmp) / "kernel-cache")
            for kernel in (cpu_varlen.KERNEL, int8_rows.KERNEL):
                print(f"  {kernel.name}: {kernel.compile()[1]}")
            del os.environ["MHA_ENGINE_CACHE_DIR"]
        for _ in range(opts.rounds):
            for workers in counts:
                for mode in modes:
                    for cache in caches:
                        row = measure(mode, workers, cache, Path(tmp))
                        rows.setdefault((mode, workers, cache), []).append(row)
                        print(f"  {mode:10} workers={workers} kernel cache {cache}: " + ", ".join(
                            f"{k} {v:.2f}" for k, v in row.items()), flush=True)  # fmt: skip
    keys = ["start_s", "frontend_restart_s", "engine_restart_s", "cpu_s", "pss_mb"]
    print("\n| workers | children | kernel cache | " + " | ".join(keys) + " |")
    print("|---:|---|---|" + "---:|" * len(keys))
    for (mode, workers, cache), samples in rows.items():
        medians = [statistics.median(s[k] for s in samples) for k in keys]
        cells = " | ".join(f"{m:.2f}" for m in medians)
        print(f"| {workers} | {mode} | {cache} | {cells} |")


if __name__ == "__main__":
    main()
