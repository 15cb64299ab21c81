"""Build one of the engine's C files at first use and load it with ctypes (int8_rows, cpu_varlen).

Each file is compiled with the host's C compiler (`$CC`, else `cc`) for this CPU
(`-march=native`) into a private temporary directory and loaded from there; nothing is cached
on disk between processes (a fraction of a second per file and process), nothing is built at
install time, and no Python headers are needed. Callers keep an eager torch fallback for
hosts where this fails, and report the returned status (diagnostics, benchmarks, logs).
"""

from __future__ import annotations

import ctypes
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

COMPILE_TIMEOUT_S = 60.0
COMMON_FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared")


def build(
    source: Path, flags: Sequence[str], variants: Sequence[Sequence[str]] = ((),)
) -> tuple[ctypes.CDLL | None, str]:
    """(library, 'compiled (cc -march=native ...)') or (None, 'eager: <why>').

    Tries each variant's extra flags, with and without -march=native, first one that builds
    and loads wins (e.g. `(("-fopenmp",), ())`: OpenMP where the compiler has it)."""
    if sys.platform == "win32":
        return None, "eager: no C build on Windows"
    if not source.is_file():
        return None, f"eager: {source.name} is not installed in {source.parent}"
    compiler = shlex.split(os.environ.get("CC", "cc")) or ["cc"]
    try:
        with tempfile.TemporaryDirectory(prefix="mha-engine-") as tmp:
            return _build(compiler, source, list(flags), variants, tmp)
    except OSError as exc:  # no writable temporary directory
        return None, f"eager: no directory to build in ({exc})"


def _build(
    compiler: list[str],
    source: Path,
    flags: list[str],
    variants: Sequence[Sequence[str]],
    tmp: str,
) -> tuple[ctypes.CDLL | None, str]:
    errors: list[str] = []
    tries = [[*arch, *extra] for extra in variants for arch in (["-march=native"], [])]
    for n, extra in enumerate(tries):  # some compilers or targets lack -march=native
        target = str(Path(tmp) / f"{source.stem}-{n}.so")
        cmd = [*compiler, *COMMON_FLAGS, *flags, *extra, "-o", target, str(source), "-lm"]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"eager: could not run the C compiler {compiler[0]!r} ({exc})"
        if done.returncode != 0:
            errors.append(((done.stderr or done.stdout).strip().splitlines() or ["no output"])[0])
            continue
        try:  # the mapping outlives the file, which the directory's removal deletes
            return ctypes.CDLL(target), f"compiled ({' '.join([compiler[0], *extra])})"
        except OSError as exc:  # e.g. a temporary directory mounted noexec
            errors.append(f"the compiled library did not load ({exc})")
    first = errors[0] if errors else "no output"
    return None, f"eager: {compiler[0]} failed to build {source.name} ({first})"
