"""Host cost of one engine forward at small shapes: the Python and op dispatch around the kernels.

At small batches the GPU finishes a layer before Python has launched it, so what a forward costs
the host (its Python calls and the ATen ops it dispatches, each a kernel launch or at least a
dispatch on CUDA) sets its speed. On CPU the same code runs with tiny kernels, so the host cost
shows there too. Per case: ATen ops dispatched and Python-level calls per `forward_packed`
(counted, not timed: the same on every run), and the thread CPU time per call against
nn.MultiheadAttention's fused fast path, interleaved (benchmarks.timing.time_cases); "wall" is
the same ratio in wall time (throughput). On CUDA each timed block ends with one synchronize:
where the GPU, not the host, is the bottleneck the thread time includes CUDA's spin-wait there,
and only "wall" is meaningful.

    python -m benchmarks.host_cost [--device cuda] [--rounds 5]
    python -m benchmarks.host_cost --root <tree> --root <tree>   # trees alternated, round by round

With --root each round runs this file against each tree's mha_engine, in the tree's own
interpreter (`<tree>/.venv`, else this one), so before/after figures come from one run.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if __package__:
    from benchmarks.timing import time_cases
else:  # run as a script against another tree's mha_engine (--root): its neighbour module
    from timing import time_cases

# (embed_dim, num_heads, tokens per sequence, sequences)
CASES = [(16, 2, 1, 16), (64, 4, 4, 8), (512, 8, 16, 1), (512, 8, 16, 32)]


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: str, dtype: torch.dtype, rounds: int, min_time: float) -> dict[str, dict]:
    """Per case: ops and Python calls per forward, and median thread-CPU µs per call of the
    engine's forward_packed and of nn.MultiheadAttention on the same tokens."""
    results = {}
    for E, H, T, B in CASES:
        case = f"MHA({E}, {H}), {B} x {T} tokens"
        results[case] = _case(E, H, T, B, torch.device(device), dtype, rounds, min_time)
    return results


def _case(E: int, H: int, T: int, B: int, dev: torch.device, dtype, rounds: int, min_time: float):
    from mha_engine.checkpoint import model_from_state_dict
    from mha_engine.save import module_config, module_state

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    model = model_from_state_dict(module_config(mha), module_state(mha), str(dev), dtype)
    mha = mha.to(device=dev, dtype=dtype)
    x = torch.randn(B * T, E, device=dev, dtype=dtype)  # (N, E) packed
    xb = x.view(B, T, E)
    cu = list(range(0, B * T + 1, T))

    def engine() -> None:
        model.forward_packed(x, cu)

    def pytorch() -> None:
        with torch.inference_mode():
            mha(xb, xb, xb, need_weights=False)

    for fn in (engine, pytorch):
        for _ in range(10):
            fn()
    _sync(dev)
    counter = _CountOps()
    with torch.inference_mode(), counter:
        model.forward_packed(x, cu)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(20):
        model.forward_packed(x, cu)
    profile.disable()
    cases = {"engine": engine, "pytorch": pytorch}
    sync = functools.partial(_sync, dev)  # a block of CUDA launches is timed to its end
    host = time_cases(cases, rounds, min_time, time.thread_time, sync)
    wall = time_cases(cases, rounds, min_time, time.perf_counter, sync)
    return {
        "aten_ops": counter.ops,
        "python_calls": round(pstats.Stats(profile).total_calls / 20),
        "engine_us": host["engine"] * 1e6,
        "pytorch_us": host["pytorch"] * 1e6,
        "wall_ratio": wall["engine"] / wall["pytorch"],
    }


def _child(root: str, args: argparse.Namespace) -> dict[str, dict]:
    venv = Path(root) / ".venv" / "bin" / "python"
    python = str(venv) if venv.exists() else sys.executable
    # this file, with the tree's mha_engine first on the path
    command = [python, __file__, "--json", "--rounds", str(args.rounds)]
    command += ["--device", args.device, "--dtype", args.dtype, "--min-time", str(args.min_time)]
    env = {**os.environ, "PYTHONPATH": str(Path(root).resolve())}
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"{root}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds per timed block")
    parser.add_argument("--root", action="append", default=[], help="a tree to alternate")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.root:
        results = measure(args.device, getattr(torch, args.dtype), args.rounds, args.min_time)
        if args.json:
            print(json.dumps(results))
            return
        runs = {"this tree": [results]}
    else:
        runs = {root: [] for root in args.root}
        for _ in range(3):  # rounds of trees, alternated
            for root in args.root:
                runs[root].append(_child(root, args))
    print(f"torch {torch.__version__}, {args.device}, {args.dtype}, 1 thread, "
          f"{torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    print("| case | tree | ATen ops | Python calls | engine µs | nn.MHA µs | engine / nn.MHA "
          "| wall |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for case in next(iter(runs.values()))[0]:
        for root, results in runs.items():
            rows = [r[case] for r in results]
            engine = statistics.median(r["engine_us"] for r in rows)
            pytorch = statistics.median(r["pytorch_us"] for r in rows)
            ratio = statistics.median(r["engine_us"] / r["pytorch_us"] for r in rows)
            wall = statistics.median(r["wall_ratio"] for r in rows)
            print(f"| {case} | {root} | {rows[0]['aten_ops']} | {rows[0]['python_calls']} | "
                  f"{engine:.1f} | {pytorch:.1f} | {ratio:.2f} | {wall:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
