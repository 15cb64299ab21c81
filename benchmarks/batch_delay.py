"""What `--max-batch-delay-ms` and `--batch-delay-policy` buy and cost at a few loads: latency,
server CPU, batch size.

`python -m benchmarks.batch_delay [--configs 2:fixed,0:fixed,2:adaptive] [--rounds 2]
[--seconds 4]` (under `flock /work/bench.lock`): MHA(512, 8), T=16 binary requests, one server
per configuration (delay ms:policy) and round (order reversed every other round), each driven
in turn by one closed-loop client, open-loop (Poisson-free, evenly scheduled) offers of 250,
500 and 1,000 requests/s, and 32 closed-loop clients. Medians over rounds of requests/s, p50 /
p99 latency of 200s, server CPU per request (all threads, /proc) and the mean batch
(`mha_batch_size_sequences`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import scrape
from benchmarks.client import build_request, percentile, run_load, run_open_loop
from benchmarks.server import HOST, running
from benchmarks.serving import MHA_PATH, request, save_mha

LOADS = (("closed", 1), ("open", 250), ("open", 500), ("open", 1000), ("closed", 32))


def one_load(server, kind: str, amount: int, seconds: float) -> tuple[float, ...]:
    """(req/s, p50 ms, p99 ms, server CPU ms/req, mean batch) of one load on a running server."""
    body, headers = request("binary", 16, 512)
    if kind == "closed":  # warm the connections
        asyncio.run(run_load(HOST, server.port, MHA_PATH, body, headers, amount, 0.5, 0.0))
    before, cpu = scrape.scrape(server.url), server.cpu_seconds()
    if kind == "closed":
        result = asyncio.run(
            run_load(HOST, server.port, MHA_PATH, body, headers, amount, seconds, 0.0)
        )
        latencies = sorted(result.latencies)
    else:
        raw = build_request(MHA_PATH, body, headers)
        latencies = asyncio.run(run_open_loop(HOST, server.port, raw, amount, seconds)).latencies(
            200
        )
    cpu, after = server.cpu_seconds() - cpu, scrape.scrape(server.url)

    def delta(name: str) -> float:
        return scrape.value(after, name) - scrape.value(before, name)

    done = max(len(latencies), 1)
    batch = delta("mha_batch_size_sequences_sum") / max(delta("mha_batch_size_sequences_count"), 1)
    return (
        len(latencies) / seconds,
        percentile(latencies, 50) * 1e3,
        percentile(latencies, 99) * 1e3,
        cpu / done * 1e3,
        batch,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        default="2:fixed,0:fixed,2:adaptive",
        help="comma-separated --max-batch-delay-ms:--batch-delay-policy",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    delays = args.configs.split(",")
    rows: dict[tuple[str, str], list[tuple[float, ...]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_mha(Path(tmp))
        for round_ in range(args.rounds):
            for delay in delays if round_ % 2 == 0 else delays[::-1]:
                ms, policy = delay.split(":")
                flags = ["--max-batch-delay-ms", ms, "--batch-delay-policy", policy]
                with running("--model-dir", str(model), *flags) as server:
                    for kind, amount in LOADS:
                        load = f"{kind} {amount}"
                        got = one_load(server, kind, amount, args.seconds)
                        rows.setdefault((load, delay), []).append(got)
                        print(f"round {round_} {delay}, {load}: " +
                              ", ".join(f"{v:.3f}" for v in got), flush=True)  # fmt: skip
    print(f"\ndate: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
          f"{os.cpu_count()} cores, load avg {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("\n| load | delay ms:policy | req/s | p50 ms | p99 ms | server CPU ms/req | mean batch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, amount in LOADS:
        for delay in delays:
            found = rows[(f"{kind} {amount}", delay)]
            med = [statistics.median(r[i] for r in found) for i in range(5)]
            print(f"| {kind} {amount} | {delay} | {med[0]:,.0f} | {med[1]:.2f} | {med[2]:.2f} | "
                  f"{med[3]:.3f} | {med[4]:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
