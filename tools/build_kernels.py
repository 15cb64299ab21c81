"""Prebuild the engine's C kernels for every x86-64 level, so a host without a C compiler (the
container image) still runs them: `python tools/build_kernels.py [DEST]`.

DEST defaults to mha_engine/prebuilt/ (package data: `pip install .` afterwards ships it).
Writes `<file>-<level>.so` for each C file of mha_engine and each of AVX512, AVX2, DEFAULT
(x86-64-v4, -v3, plain x86-64), or one `-generic` build elsewhere; mha_engine/cbuild.py loads
the one matching torch's CPU capability at run time. Built with OpenMP, which resolves to
torch's own libgomp.so.1 when loaded. Exits non-zero, saying why, if any build fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mha_engine import cbuild, cpu_varlen, int8_rows

KERNELS = (int8_rows.KERNEL, cpu_varlen.KERNEL)


def build_all(dest: Path, compiler: list[str]) -> list[Path]:
    """Every kernel at every level into dest; the paths written. Raises RuntimeError on the
    first failure."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for kernel in KERNELS:
        for name in cbuild.prebuilt_levels():
            target = cbuild.prebuilt_path(kernel.source, dest, name)
            extra = [*kernel.flags, *cbuild.target_flags(name), *cbuild.OPENMP]
            error = cbuild.compile_library(compiler, kernel.source, extra, target)
            if error is not None:
                raise RuntimeError(f"{kernel.source.name} for {name}: {error}")
            written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", nargs="?", type=Path, default=cbuild.PREBUILT)
    args = parser.parse_args()
    try:
        for path in build_all(args.dest, cbuild.compiler()):
            print(path)
    except (RuntimeError, OSError) as exc:
        sys.exit(f"build_kernels: {exc}")


if __name__ == "__main__":
    main()
