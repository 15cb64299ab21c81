"""Load one of the engine's C files (int8_rows, cpu_varlen) with ctypes: prebuilt, or built now.

Prebuilt: `tools/build_kernels.py` compiles each file once per x86-64 level into
`mha_engine/prebuilt/` (the container image does this in its build stage, so the runtime image
needs no compiler); the library for the level torch's kernels run at here (AVX512, AVX2 or
DEFAULT) is loaded. Otherwise the file is compiled at first use with the host's C compiler
(`$CC`, else `cc`) for this CPU (`-march=native`) into a private temporary directory; nothing
is cached on disk between processes (a fraction of a second per file and process). Callers
keep an eager torch fallback for hosts where both fail, and report the returned status.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

COMPILE_TIMEOUT_S = 60.0
COMMON_FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared")
OPENMP = ("-fopenmp",)  # torch's own libgomp.so.1 at run time: one thread pool
PREBUILT = Path(__file__).with_name("prebuilt")
# torch's CPU capability -> the x86-64 level a prebuilt library targets (each a superset of
# what torch's kernels of that capability use, so the library runs wherever they do)
LEVELS = {"AVX512": "x86-64-v4", "AVX2": "x86-64-v3", "DEFAULT": "x86-64"}


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def level() -> str:
    """The prebuilt library's suffix for this CPU: its torch capability, or 'generic' off
    x86-64 (one build without -march)."""
    return torch.backends.cpu.get_cpu_capability() if is_x86_64() else "generic"


def target_flags(name: str) -> list[str]:
    """-march for a prebuilt level (none for 'generic')."""
    return [f"-march={LEVELS[name]}"] if name in LEVELS else []


def prebuilt_path(source: Path, directory: Path | None = None, name: str | None = None) -> Path:
    """Where the library of `source` for level `name` (default: this CPU's) lies prebuilt."""
    return (directory or PREBUILT) / f"{source.stem}-{(name or level()).lower()}.so"


def build(
    source: Path, flags: Sequence[str], variants: Sequence[Sequence[str]] = ((),)
) -> tuple[ctypes.CDLL | None, str]:
    """(library, 'prebuilt (...)' or 'compiled (cc -march=native ...)') or (None, 'eager: <why>').

    A prebuilt library for this CPU's level wins; else each variant's extra flags are tried,
    with and without -march=native, the first that builds and loads winning (e.g.
    `(OPENMP, ())`: OpenMP where the compiler has it)."""
    prebuilt = prebuilt_path(source)
    if prebuilt.is_file():
        try:
            return ctypes.CDLL(str(prebuilt)), f"prebuilt ({prebuilt.name})"
        except OSError:
            pass  # e.g. a library for another libc: build one instead
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


def compile_library(
    compiler: list[str], source: Path, flags: Sequence[str], target: Path | str
) -> str | None:
    """Compile `source` into the shared library `target`; None, or the compiler's first line
    of complaint. Raises OSError / TimeoutExpired where the compiler cannot run."""
    cmd = [*compiler, *COMMON_FLAGS, *flags, "-o", str(target), str(source), "-lm"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
    )
    if done.returncode == 0:
        return None
    return ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[0]


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
        target = Path(tmp) / f"{source.stem}-{n}.so"
        try:
            error = compile_library(compiler, source, [*flags, *extra], target)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"eager: could not run the C compiler {compiler[0]!r} ({exc})"
        if error is not None:
            errors.append(error)
            continue
        try:  # the mapping outlives the file, which the directory's removal deletes
            return ctypes.CDLL(str(target)), f"compiled ({' '.join([compiler[0], *extra])})"
        except OSError as exc:  # e.g. a temporary directory mounted noexec
            errors.append(f"the compiled library did not load ({exc})")
    first = errors[0] if errors else "no output"
    return None, f"eager: {compiler[0]} failed to build {source.name} ({first})"
