"""The expected-ceiling table of `python -m benchmarks.workers --ceiling`: from the per-request
costs a run measured (front-end CPU, the engine side per request and per batch), the channel's
cost timed alone, and an assumed GPU engine rate, the req/s N front-ends could reach.
"""

from __future__ import annotations

import time

import numpy as np


def _mean(rows: list[dict], key: str, **match) -> float:
    values = [r[key] for r in rows if all(r[k] == v for k, v in match.items())]
    return sum(values) / len(values) if values else float("nan")


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


def channel_ms(
    seq_len: int, embed_dim: int, repeats: int = 2000, batch: int = 1
) -> tuple[float, float]:
    """(front-end ms, engine ms) per request spent on the channel alone: the submit message
    and the reply pickled, framed and parsed, tensors through a slab, as service.workers does
    it, in one process (no syscalls, wake-ups or batching); median wall time per phase.
    `batch` requests share a frame each way, as a loaded loop turn's submits and a batch's
    replies do (1: a frame per message, the channel before frames carried several)."""
    from service.oip.inputs import Payload
    from service.runtime.forward import hidden_states
    from service.workers.channel import FrameBuffer, frame
    from service.workers.messages import Done, Submit
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
    for i in range(0, repeats * batch, batch):
        t0 = clock()
        regions: list[tuple[int, int]] = []
        submits = []
        for ident in range(i, i + batch):
            out = (slab.alloc(x.nbytes), x.nbytes)
            regions.append(out)
            wire = payload_to_wire(Payload(x, [seq_len]), slab, regions)
            submits.append(Submit(ident, ("mha", "1"), hidden_states, 1e9, wire, out))
        data = b"".join(frame(m) for m in submits) if batch == 1 else frame(*submits)
        t1 = clock()
        replies = []
        for message in FrameBuffer().feed(data):
            payload = payload_from_wire(message.wire, slab)
            result = result_to_wire(slab, message.out, payload.query)
            replies.append(Done(message.ident, result, 0.0, 0.0))
        reply = frame(*replies)
        t2 = clock()
        for done, submit in zip(FrameBuffer().feed(reply), submits, strict=True):
            result_from_wire(slab, submit.out, done.result)
        for offset, nbytes in regions:
            slab.free(offset, nbytes)
        t3 = clock()
        fronts.append(((t1 - t0) + (t3 - t2)) / batch)
        engines.append((t2 - t1) / batch)
    slab.close()
    return float(np.median(fronts)) * 1e3, float(np.median(engines)) * 1e3  # median: not preempted


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
    multi = [r for r in rows if r["workers"] > 1 and r["D"] == 512]
    lines = [
        "| T | front-end CPU ms/req (D=512, workers > 1) | engine-side ms/req at full batches "
        "| GPU seq/s (assumed) | 1 front-end | 4 | 8 | 16 | limit at 16 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for seq_len, gpu in GPU_SEQ_S.items():
        front = _mean(multi, "frontend_cpu_ms", T=seq_len)
        nbytes = seq_len * 512 * 4
        # the engine's copy of the input into the batch (the output copy is in channel_ms)
        copies = nbytes / (copy_gb_s(nbytes) * 1e9) * 1e3
        chan_front, chan_engine = channel_ms(seq_len, 512)
        print(f"T={seq_len}: channel alone {chan_front:.3f} ms front-end, "
              f"{chan_engine:.3f} ms engine per request; input copy {copies:.3f} ms")  # fmt: skip
        eng = max(per_req, chan_engine) + per_batch / batch + copies
        cells, limit = [], ""
        for n in (1, 4, 8, 16):
            limits = {"front-ends": n / front * 1e3, "engine process": 1e3 / eng, "GPU": gpu}
            limit = min(limits, key=limits.get)
            cells.append(f"{limits[limit]:,.0f}")
        lines.append(f"| {seq_len} | {front:.2f} | {eng:.3f} | {gpu:,} | "
                     + " | ".join(cells) + f" | {limit} |")  # fmt: skip
    print("\n".join(lines))
