"""Keep freed CPU buffers in the process heap between forwards (glibc's malloc settings).

Under glibc's defaults a freed block of more than the (adaptive) mmap threshold, or a heap top
past the trim threshold, goes back to the kernel, and the next forward's activations fault in
fresh pages. How much depends on what the process freed before (the thresholds adapt): measured
with `python -m benchmarks.cpu_memory` (MiniLM, 32 sentences), an int8 model loaded first and run
on the main thread took 9,700 page faults and 53 CPU-ms a batch, 0 faults and 38 ms kept (1.38x);
other cases moved within the noise. This is what jemalloc or tcmalloc do by default; here it is
three mallopt calls, no library to preload.

The cost: resident memory stays at its peak. It is process-wide, so nothing applies it on
import: scripts that run the engine call `tune_cpu_allocator()` (the benchmarks do). The
service does not (its engine thread measured no difference: docs/engine-cpu.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 256 << 20  # below this, allocations come from the heap and are reused
TRIM_THRESHOLD = 1 << 30  # the heap top is returned to the kernel only past 1 GiB free
TOP_PAD = 64 << 20  # grow the heap in 64 MiB steps (address space only, until touched)

_applied: bool | None = None


def tune_cpu_allocator() -> bool:
    """Apply the settings above once per process; True where they took effect (glibc on Linux),
    False elsewhere (another libc, macOS, Windows), where nothing changes."""
    global _applied
    if _applied is None:
        _applied = _mallopt_all()
    return _applied


def cpu_allocator_tuned() -> bool:
    """Whether tune_cpu_allocator() has taken effect in this process."""
    return bool(_applied)


def _mallopt_all() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    applied = all(mallopt(param, value) == 1 for param, value in settings)
    return applied and mallopt(M_TOP_PAD, TOP_PAD) == 1
