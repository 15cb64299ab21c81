"""A front-end's shared-memory slab: one anonymous memfd that the front-end maps and hands to
the engine process over the channel (SCM_RIGHTS), carved into regions per request.

Anonymous (memfd_create) rather than a named /dev/shm segment: it has no name to leak. The
memory goes back to the kernel when the last process holding it exits, crash or not, and a
container's small /dev/shm size limit does not apply. Pages are touched only when used, so a
large slab costs only the requests in flight.

The front-end owns the allocator (`Slab.alloc` / `Slab.free`); the engine only reads a request's
inputs from its region and writes its output there, between the submit and the reply.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import mmap
import os

import numpy as np

ALIGN = 64  # bytes: every region starts on a cache line, like torch's allocations


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class Slab:
    """`size` bytes of shared memory with a first-fit allocator over 64-byte-aligned regions."""

    def __init__(self, size: int, fd: int | None = None) -> None:
        self.size = size
        self.fd = os.memfd_create("mha-serve-slab", os.MFD_CLOEXEC) if fd is None else fd
        if fd is None:
            os.ftruncate(self.fd, size)
        self.buffer = mmap.mmap(self.fd, size)
        # free regions: sorted start offsets, and start -> length
        self._starts: list[int] = [0]
        self._free: dict[int, int] = {0: size}
        self.used = 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free region of at least `nbytes`, or None when none is left (the caller
        then sends the arrays inline)."""
        need = _aligned(max(nbytes, 1))
        for start in self._starts:
            length = self._free[start]
            if length >= need:
                del self._free[start]
                self._starts.remove(start)
                if length > need:
                    self._free[start + need] = length - need
                    bisect.insort(self._starts, start + need)
                self.used += need
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Give back the region alloc(nbytes) returned at `offset`, merging free neighbours."""
        length = _aligned(max(nbytes, 1))
        self.used -= length
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and offset + length == self._starts[i]:  # merge the next
            nxt = self._starts.pop(i)
            length += self._free.pop(nxt)
        if i > 0 and (prev := self._starts[i - 1]) + self._free[prev] == offset:  # the previous
            self._free[prev] += length
            return
        self._free[offset] = length
        self._starts.insert(i, offset)

    def array(self, offset: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A numpy view of a region (no copy)."""
        dt = np.dtype(dtype)
        count = math.prod(shape)  # Python ints: 0.1 µs, where np.prod took 4 µs a call
        return np.frombuffer(self.buffer, dt, count, offset).reshape(shape)

    def close(self) -> None:
        """Unmap and close; views still alive keep the mapping until they go."""
        with contextlib.suppress(BufferError):  # a view still exists: the mapping goes with it
            self.buffer.close()
        os.close(self.fd)
