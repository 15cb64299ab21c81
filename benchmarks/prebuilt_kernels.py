"""The prebuilt C kernels (tools/build_kernels.py, what the container image runs) against the same
C built with -march=native (what a host with a compiler runs), interleaved, 1 thread: every
prebuilt level this CPU can run (on AVX-512: the AVX2 and plain x86-64 ones too, what hosts
without AVX-512 get).

    python -m benchmarks.prebuilt_kernels [--rounds 7]

Cases: cpu_varlen's attention on MiniLM-like 32 mixed sentences (12 heads of 32, fp32), and
int8_rows' quantize pass and epilogue on 446 x 1536 rows. Best and median microseconds per call.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from mha_engine import cbuild, cpu_varlen, fused, int8_rows, varlen
from tools.build_kernels import build_all


def libraries(tmp: Path) -> dict[str, tuple[cpu_varlen._Library, int8_rows._Library]]:
    """Every prebuilt library this CPU can run, and the -march=native build, by name."""
    build_all(tmp, cbuild.compiler())
    kernels = (cpu_varlen.KERNEL, int8_rows.KERNEL)
    builds = {}
    for name in cbuild.runnable_levels():
        paths = [cbuild.prebuilt_path(k.source, tmp, name) for k in kernels]
        builds[f"prebuilt {name} ({cbuild.LEVELS.get(name, 'no -march')})"] = paths
    native = [tmp / f"{k.source.stem}-native.so" for k in kernels]
    for kernel, target in zip(kernels, native, strict=True):
        flags = [*kernel.flags, "-march=native", *cbuild.OPENMP]
        error = cbuild.compile_library(cbuild.compiler(), kernel.source, flags, target)
        if error:
            raise SystemExit(f"{kernel.source.name}: {error}")
    builds["-march=native"] = native
    return {
        name: (cpu_varlen._Library(ctypes.CDLL(str(a))), int8_rows._Library(ctypes.CDLL(str(r))))
        for name, (a, r) in builds.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    libs = libraries(Path(tempfile.mkdtemp(prefix="prebuilt-bench-")))
    lens = [random.Random(0).randint(5, 30) for _ in range(32)]
    H, D = 12, 32
    E = H * D
    plan = varlen.make_plan(lens)
    modes, _ = plan.cpu_split(max(lens))
    qkv = torch.randn(sum(lens), 3 * E)
    q, k, v = qkv.split(E, dim=1)
    out, cu = torch.empty(sum(lens), E), plan.cu_seqlens
    x = torch.randn(446, 1536)
    codes, scale, mid = (
        torch.empty(446, 1536, dtype=torch.uint8),
        torch.empty(446),
        torch.empty(446),
    )

    def attention(lib: cpu_varlen._Library) -> None:
        lib.attention(q.data_ptr(), 3 * E, k.data_ptr(), 3 * E, v.data_ptr(), 3 * E,
                      out.data_ptr(), E, cu.data_ptr(), cu.data_ptr(), len(lens), H, H, D,
                      D**-0.5, modes.data_ptr(), 0, 1, max(lens))  # fmt: skip

    def quantize(lib: int8_rows._Library) -> None:
        lib.quantize_rows(x.data_ptr(), 446, 1536, 1536, 127, codes.data_ptr(),
                          scale.data_ptr(), mid.data_ptr(), 1)  # fmt: skip

    y, bias, sums = torch.randn(446, 1536), torch.randn(1536), torch.randn(1536)

    def epilogue(lib: int8_rows._Library, fused_madd: int) -> None:
        lib.epilogue(y.data_ptr(), 446, 1536, scale.data_ptr(), mid.data_ptr(),
                     bias.data_ptr(), sums.data_ptr(), None, 0, fused_madd, 1)  # fmt: skip

    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):  # interleaved
        for name, (attn_lib, rows_lib) in libs.items():
            for case, call in (
                ("attention", partial(attention, attn_lib)),
                ("quantize", partial(quantize, rows_lib)),
                # fused multiply-adds as int8_rows asks on a CPU of that level (none on DEFAULT)
                ("epilogue", partial(epilogue, rows_lib, int("DEFAULT" not in name))),
            ):
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                elapsed = (time.perf_counter() - start) / args.calls * 1e6
                times.setdefault((case, name), []).append(elapsed)
    print(f"CPU capability {fused.cpu_capability()}, 1 thread, {args.rounds} rounds\n")
    print("| kernel | build | best us | median us |")
    print("|---|---|---:|---:|")
    for (case, name), got in times.items():
        print(f"| {case} | {name} | {min(got):.1f} | {statistics.median(got):.1f} |")


if __name__ == "__main__":
    main()
