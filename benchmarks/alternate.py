"""Trees alternated round by round on the tiny model: medians of req/s and server CPU per request.

`python -m benchmarks.alternate --root DIR --root DIR [--rounds 5] [--seconds 4] [--seq-len 1]`
(under `flock /work/bench.lock`). `benchmarks.serving --frontend` runs each tree once per case;
on a shared machine one 5 s window can swing by 1.5x, so this runs every tree once per round
(the order reversed every other round), a fresh server each time, and reports each round and
the medians. Server CPU (all threads, and the event loop's thread alone) from /proc, per
completed request; 32 closed-loop keep-alive clients on MHA(16, 2), binary tensors.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.client import run_load
from benchmarks.server import HOST, running
from benchmarks.serving import MHA_PATH, request, save_mha


def one(tiny: Path, root: Path, body: bytes, headers: dict, seconds: float) -> tuple[float, ...]:
    """(req/s, server CPU ms per request, event-loop CPU ms per request) of one fresh server."""
    with running("--model-dir", str(tiny), root=root) as server:
        asyncio.run(run_load(HOST, server.port, MHA_PATH, body, headers, 32, 1.0, warmup_s=0.0))
        cpu, loop = server.cpu_seconds(), server.main_thread_cpu_seconds()
        result = asyncio.run(
            run_load(HOST, server.port, MHA_PATH, body, headers, 32, seconds, warmup_s=0.0)
        )
        cpu, loop = server.cpu_seconds() - cpu, server.main_thread_cpu_seconds() - loop
    done = max(result.completed, 1)
    return result.rps, cpu / done * 1e3, loop / done * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--seq-len", type=int, default=1)
    args = parser.parse_args()
    now = time.strftime("%H:%M", time.gmtime())
    print(f"{now} UTC, load avg {os.getloadavg()[0]:.2f}, T={args.seq_len}", flush=True)
    rows: dict[Path, list[tuple[float, ...]]] = {root: [] for root in args.root}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = save_mha(Path(tmp), 16, 2)
        body, headers = request("binary", args.seq_len, 16)
        for i in range(args.rounds):
            for root in args.root if i % 2 == 0 else args.root[::-1]:
                rows[root].append(one(tiny, root, body, headers, args.seconds))
                rps, cpu, loop = rows[root][-1]
                load = os.getloadavg()[0]
                print(f"round {i} {root.name}: {rps:.0f} req/s, CPU {cpu:.3f} ms/req "
                      f"(loop {loop:.3f}), load avg {load:.2f}", flush=True)  # fmt: skip
    print(f"load avg after: {os.getloadavg()[0]:.2f}\n")
    print("| code | req/s (median) | min-max | server CPU ms/req | of which event loop |")
    print("|---|---:|---:|---:|---:|")
    for root, got in rows.items():
        rps = [r[0] for r in got]
        cpu, loop = (statistics.median(r[k] for r in got) for k in (1, 2))
        print(f"| {root.name} | {statistics.median(rps):.0f} | {min(rps):.0f}-{max(rps):.0f} | "
              f"{cpu:.3f} | {loop:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
