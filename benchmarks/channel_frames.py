"""The `--workers` channel's framing: 16 messages pickled as 16 frames or as one.

`python -m benchmarks.channel_frames`: what a loaded front-end's loop turn sends (16 submits of
MHA(512, 8) T=16 payloads in its slab, 16 statistics messages) and what the engine answers for
a batch (16 replies), each written (pickled and framed) and read back; best of 7 runs, µs per
16 messages, and bytes.
"""

from __future__ import annotations

import timeit
from collections.abc import Callable

import numpy as np

from service.oip.inputs import Payload
from service.runtime.forward import hidden_states
from service.runtime.statistics import Timing
from service.workers.channel import FrameBuffer, frame
from service.workers.messages import Done, Executed, Submit
from service.workers.slab import Slab
from service.workers.wire import payload_to_wire


def best(fn: Callable[[], object]) -> float:
    """µs per call, best of 7 runs of 2,000 calls."""
    return min(timeit.repeat(fn, number=2000, repeat=7)) / 2000 * 1e6


def row(name: str, messages: list) -> str:
    apart = b"".join(frame(m) for m in messages)
    together = frame(*messages)
    assert FrameBuffer().feed(apart) == FrameBuffer().feed(together) == messages
    write = best(lambda: [frame(m) for m in messages]), best(lambda: frame(*messages))
    read = best(lambda: FrameBuffer().feed(apart)), best(lambda: FrameBuffer().feed(together))
    return (
        f"| {name} | {write[0]:.1f} | {write[1]:.1f} | {read[0]:.1f} | {read[1]:.1f} | "
        f"{len(apart):,} | {len(together):,} |"
    )


def main() -> None:
    slab = Slab(1 << 22)
    key = ("mha", "1")

    def wire(i: int) -> dict:  # each message its own payload, as requests are
        x = np.full((16, 512), i, np.float32)
        return payload_to_wire(Payload(query=x, lengths=[16]), slab, [])

    submits = [Submit(i, key, hidden_states, 1e4 + i, wire(i), (i << 15, 32768)) for i in range(16)]
    statistics = [Executed(key, Timing(1e-5 * i, 2e-4, 3e-4, 1e-5, 6e-4)) for i in range(16)]
    replies = [Done(i, ("shm", (1, 16, 512), "<f4"), 1e-4 * i, 2e-4) for i in range(16)]
    print(
        "| messages | write: 16 frames µs | 1 frame µs | read: 16 frames µs | 1 frame µs "
        "| bytes: 16 frames | 1 frame |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, messages in (
        ("16 submits", submits),
        ("16 statistics", statistics),
        ("16 replies", replies),
    ):
        print(row(name, messages))
    slab.close()


if __name__ == "__main__":
    main()
