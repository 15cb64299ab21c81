"""Load one of the engine's C files (int8_rows, cpu_varlen) with ctypes: prebuilt, or built now.

`Kernel` is what a C file's Python module holds: the library, loaded once per process, an
environment switch that turns it off, and a status line for diagnostics; `Bindings` binds the
entry points and decides how many of torch's threads a call uses.

Prebuilt: `tools/build_kernels.py` compiles each file once per x86-64 level into
`mha_engine/prebuilt/` (the container image does this in its build stage, so the runtime image
needs no compiler); the library for the level torch's kernels run at here (AVX512, AVX2 or
DEFAULT) is loaded. Otherwise the file is compiled at first use with the host's C compiler
(`$CC`, else `cc`) for this CPU (`-march=native`) into a private temporary directory, and kept
in a cache only this user can write (`cache_dir()`), keyed by the source, flags, compiler and
CPU: the next process loads it instead of spending ~1 s per file compiling again. Callers
keep an eager torch fallback for hosts where both fail, and report the returned status.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

import torch

COMPILE_TIMEOUT_S = 60.0
COMMON_FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared")
OPENMP = ("-fopenmp",)  # torch's own libgomp.so.1 at run time: one thread pool
PREBUILT = Path(__file__).with_name("prebuilt")
# torch's CPU capability -> the x86-64 level a prebuilt library targets (each a superset of
# what torch's kernels of that capability use, so the library runs wherever they do)
LEVELS = {"AVX512": "x86-64-v4", "AVX2": "x86-64-v3", "DEFAULT": "x86-64"}
CACHE_ENV = "MHA_ENGINE_CACHE_DIR"  # where compiled libraries are kept; "off": nowhere

log = logging.getLogger(__name__)


class Bindings:
    """A C file's entry points, bound with ctypes by a subclass (each call releases the GIL).

    Every file exports `int <openmp_probe>(void)`: whether it was built with OpenMP (linking
    torch's own libgomp.so.1, so `torch.set_num_threads` holds for it too)."""

    openmp_probe: ClassVar[str]
    parallel_min: ClassVar[int]  # below this much work a call runs on one thread

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.openmp = bool(getattr(lib, self.openmp_probe)())

    def threads(self, work: int) -> int:
        """torch's intra-op thread count where there is enough work to share, else 1 (waking
        the other threads costs more than they save on small calls)."""
        return torch.get_num_threads() if self.openmp and work >= self.parallel_min else 1


B = TypeVar("B", bound=Bindings)


class Kernel(Generic[B]):
    """One C file of the engine: built or loaded at first use, once per process, with an eager
    fallback the caller runs where it is off (`switch` set to `off`, read at each call, so
    tests and benchmarks can flip it) or could not be built."""

    def __init__(
        self,
        name: str,
        source: Path,
        flags: Sequence[str],
        bindings: type[B],
        switch: str,
        off: str,
        fallback: str,
    ) -> None:
        self.name, self.source, self.flags, self.bindings = name, source, tuple(flags), bindings
        self.switch, self.off, self.fallback = switch, off, fallback
        self._loaded: tuple[B | None, str] | None = None
        self._lock = threading.Lock()

    def compile(self) -> tuple[B | None, str]:
        """Build (or load prebuilt) now, uncached: (bindings, how) or (None, 'eager: <why>')."""
        lib, status = build(self.source, self.flags, (OPENMP, ()))
        return (None if lib is None else self.bindings(lib)), status

    def loaded(self) -> tuple[B | None, str]:
        """`compile()`'s result, once per process; a failure is logged once, as a warning."""
        if self._loaded is not None:
            return self._loaded
        with self._lock:
            if self._loaded is None:
                self._loaded = self.compile()
                if self._loaded[0] is None:
                    log.warning("%s: %s (%s)", self.name, self._loaded[1], self.fallback)
            return self._loaded

    def forced_off(self) -> bool:
        return os.environ.get(self.switch, "auto") == self.off

    def library(self) -> B | None:
        """The bound library, or None where it is switched off or could not be built."""
        return None if self.forced_off() else self.loaded()[0]

    def status(self) -> str:
        """'prebuilt (...)', 'compiled (cc -march=native -fopenmp)' or 'eager: <why>'."""
        return f"eager: {self.switch}={self.off}" if self.forced_off() else self.loaded()[1]


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def level() -> str:
    """The prebuilt library's suffix for this CPU: its torch capability, or 'generic' off
    x86-64 (one build without -march)."""
    return torch.backends.cpu.get_cpu_capability() if is_x86_64() else "generic"


def prebuilt_levels() -> list[str]:
    """Every level tools/build_kernels.py builds here: the x86-64 ones, widest first, or
    'generic' off x86-64."""
    return list(LEVELS) if is_x86_64() else ["generic"]


def runnable_levels() -> list[str]:
    """The prebuilt levels this CPU can run: its own and every narrower one."""
    levels = prebuilt_levels()
    return levels[levels.index(level()) :] if level() in levels else [level()]


def compiler() -> list[str]:
    """The C compiler command: `$CC`, else `cc`."""
    return shlex.split(os.environ.get("CC", "cc")) or ["cc"]


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
    cc = compiler()
    tries = [[*arch, *extra] for extra in variants for arch in (["-march=native"], [])]
    cached = _cached_paths(cc, source, flags, tries)  # one per try, or none
    for path, extra in zip(cached, tries, strict=False):
        if (lib := _load_cached(path)) is not None:
            return lib, f"compiled ({' '.join([cc[0], *extra])}; cached)"
    try:
        with tempfile.TemporaryDirectory(prefix="mha-engine-") as tmp:
            return _build(cc, source, list(flags), tries, tmp, cached)
    except OSError as exc:  # no writable temporary directory
        return None, f"eager: no directory to build in ({exc})"


def cache_dir() -> Path | None:
    """Where compiled libraries are kept between processes: `$MHA_ENGINE_CACHE_DIR`, else
    `$XDG_CACHE_HOME/mha-engine` or `~/.cache/mha-engine`, made 0700. None where it is "off",
    cannot be made, or is not this user's alone: a library loaded from it runs in-process."""
    value = os.environ.get(CACHE_ENV, "")
    if value == "off" or not hasattr(os, "geteuid"):
        return None
    try:
        if value:
            path = Path(value)
        else:
            path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mha-engine"
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path if _private(path) else None
    except (OSError, RuntimeError):  # RuntimeError: no home directory
        return None


def _private(path: Path) -> bool:
    """Owned by this user, and no one else may write it."""
    info = path.stat()
    return info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _cached_paths(
    cc: list[str], source: Path, flags: Sequence[str], tries: list[list[str]]
) -> list[Path]:
    """Where each try's library is kept, named by a hash of what it depends on: the source,
    the command line, the compiler binary and (for -march=native) the CPU; [] without a cache."""
    cache = cache_dir()
    if cache is None:
        return []
    try:
        identity = [_compiler_identity(cc[0]), _cpu()]
        common = [source.read_bytes(), *cc, *COMMON_FLAGS, *flags, *identity]
    except OSError:
        return []
    paths = []
    for extra in tries:
        digest = hashlib.sha256()
        for part in (*common, *extra):
            digest.update(b"\0" + (part if isinstance(part, bytes) else part.encode()))
        paths.append(cache / f"{source.stem}-{digest.hexdigest()[:32]}.so")
    return paths


@functools.cache
def _compiler_identity(command: str) -> str:
    """The compiler binary this command runs: its real path, size and modification time."""
    found = shutil.which(command)
    if found is None:
        return "missing"
    real = os.path.realpath(found)
    info = os.stat(real)
    return f"{real}:{info.st_size}:{info.st_mtime_ns}"


@functools.cache
def _cpu() -> str:
    """The CPU's model and feature flags (Linux), else what platform reports."""
    try:
        with open("/proc/cpuinfo") as f:
            wanted = ("model name", "flags", "Features", "CPU part")
            lines = [line for line in f.read(1 << 16).splitlines() if line.startswith(wanted)]
        return "\n".join(dict.fromkeys(lines))  # the first processor's, once each
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _load_cached(path: Path) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(path)) if path.is_file() and _private(path) else None
    except OSError:  # e.g. a truncated file or a noexec mount: built again, and replaced
        return None


def _keep(built: Path, path: Path) -> None:
    """Copy a library just built into the cache, atomically (another process may be loading
    or writing the same key); a cache that cannot be written is left as it is."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        shutil.copyfile(built, partial)
        os.chmod(partial, 0o600)
        os.replace(partial, path)
    except OSError as exc:
        log.debug("could not keep %s in the cache: %s", path.name, exc)
        with contextlib.suppress(OSError):
            partial.unlink()


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
    tries: list[list[str]],
    tmp: str,
    keep_at: list[Path],
) -> tuple[ctypes.CDLL | None, str]:
    """The first of `tries` (extra flags) that builds and loads, kept at its `keep_at` path
    (where there is a cache)."""
    errors: list[str] = []
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
            lib = ctypes.CDLL(str(target))
        except OSError as exc:  # e.g. a temporary directory mounted noexec
            errors.append(f"the compiled library did not load ({exc})")
            continue
        if keep_at:
            _keep(target, keep_at[n])
        return lib, f"compiled ({' '.join([compiler[0], *extra])})"
    first = errors[0] if errors else "no output"
    return None, f"eager: {compiler[0]} failed to build {source.name} ({first})"
