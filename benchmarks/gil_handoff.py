"""What a small torch call costs a thread while another thread runs Python: the GIL hand-off.

`python -m benchmarks.gil_handoff [--calls 200]`: PyTorch releases the GIL inside every op it
dispatches from Python, however small. When another thread of the process is busy in Python
(the service's event loop under load, beside the engine thread), that thread takes the GIL at
each release, and the caller waits to get it back: until the other thread blocks (I/O) or is
made to drop it (every `sys.getswitchinterval()`, 5 ms by default). This times a few calls
alone and beside a thread spinning in Python: wall time per call and voluntary context
switches per call of the calling thread (from /proc).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import mha_engine


def switches() -> int:
    """Voluntary context switches of the calling thread so far."""
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        return int(re.search(r"\bvoluntary_ctxt_switches:\s+(\d+)", f.read()).group(1))


def timed(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(ms of wall time, voluntary switches) per call of fn."""
    fn()
    before, started = switches(), time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e3, (switches() - before) / calls


def cases() -> list[tuple[str, Callable[[], object]]]:
    torch.manual_seed(0)
    x = torch.randn(16, 16)
    directory = Path(tempfile.mkdtemp()) / "tiny"
    mha_engine.save_model(torch.nn.MultiheadAttention(16, 2, batch_first=True), directory)
    model = mha_engine.load_model(directory, device="cpu")
    return [
        ("x + x (16, 16)", lambda: x + x),
        ("x.sum()", lambda: x.sum()),
        ("torch.empty(16)", lambda: torch.empty(16)),
        ("x[:4] (a view)", lambda: x[:4]),
        ("np.add (numpy, for contrast)", lambda: np.add(1.0, 2.0)),
        ("MHA(16, 2) forward_packed, 16 tokens", lambda: model.forward_packed(x, [0, 16])),
    ]


def spin(stop: threading.Event) -> None:
    """Pure Python until `stop`: holds the GIL except when made to drop it."""
    count = 0
    while not stop.is_set():
        count += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per case and setting")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, fn in cases():
        alone = timed(fn, args.calls)
        stop = threading.Event()
        other = threading.Thread(target=spin, args=(stop,))
        other.start()
        time.sleep(0.05)  # the other thread is running (holding the GIL) before timing starts
        try:
            busy = timed(fn, max(args.calls // 10, 20))
        finally:
            stop.set()
            other.join()
        rows.append((name, alone, busy))
    interval = sys.getswitchinterval() * 1e3
    print(f"torch {torch.__version__}, switch interval {interval:.1f} ms, {args.calls} calls")
    print("\n| call | alone: ms/call | switches/call | beside a busy thread: ms/call | switches |")
    print("|---|---:|---:|---:|---:|")
    for name, (a_ms, a_sw), (b_ms, b_sw) in rows:
        print(f"| {name} | {a_ms:.4f} | {a_sw:.2f} | {b_ms:.3f} | {b_sw:.2f} |")


if __name__ == "__main__":
    main()
