"""The registered system shared-memory regions: each a client's POSIX shared-memory object (its
shm_open key), mapped from `offset` for `byte_size` bytes, under a name requests refer to.

A request holds a lease on each region it uses; unregistering removes the name at once (new
requests cannot find it) and unmaps the region when its last lease ends, so a request in flight
finishes with the memory it started with. CPython keeps a mapping alive while a buffer over it
exists, so nothing is ever read through an unmapped address.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.pipeline.errors import BadInput, ModelNotFound, ServiceError

if TYPE_CHECKING:
    from service.runtime.settings import Settings

SHM_DIR = Path("/dev/shm")  # where Linux's shm_open keeps its objects
KEY_MAX = 255  # NAME_MAX: an shm_open name is one file name


def cuda_unsupported(name: str) -> NotSupported:
    """Triton's answer on a build without GPUs, naming the region."""
    return NotSupported(
        f"failed to register CUDA shared memory region: '{name}', GPUs not supported "
        "(this build serves on the CPU only)"
    )


class RegionExists(ServiceError):
    """A name registered twice (Triton: ALREADY_EXISTS)."""

    status = 400
    reason = "bad_input"
    grpc_status = "ALREADY_EXISTS"


class RegionNotFound(ModelNotFound):
    """A region name that is not registered."""


class RegionsFull(ServiceError):
    """Past --shm-max-regions or --shm-max-bytes."""

    status = 429
    reason = "overloaded"


class NotSupported(BadInput):
    """What this build or configuration cannot do: Triton's CPU builds answer a CUDA
    registration INVALID_ARG ("GPUs not supported"), HTTP 400."""

    reason = "unsupported"


@dataclass(eq=False)
class Region:
    """One registered region: its mapping and the leases on it."""

    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap
    start: int  # where the region starts in `mapping` (the mapping begins page-aligned)
    users: int = 0
    retired: bool = False  # unregistered: unmapped when the last lease ends
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}  # fmt: skip

    def view(self, offset: int, nbytes: int) -> memoryview:
        """`nbytes` of the region from `offset` (the caller checked they lie inside it). The
        object still being as long as registered is checked on every use: a client that
        truncated it would otherwise make the access fault."""
        if self.mapping.size() < self.offset + self.byte_size:
            raise BadInput(
                f"shared memory region '{self.name}': its object '{self.key}' is now smaller "
                f"than the {self.offset + self.byte_size} bytes registered"
            )
        begin = self.start + offset
        return memoryview(self.mapping)[begin : begin + nbytes]

    def _close(self) -> None:
        # BufferError: a view still exists; CPython unmaps when the last one goes
        with contextlib.suppress(BufferError):
            self.mapping.close()


def unavailable(settings: Settings) -> str | None:
    """Why system shared memory is not offered with `settings` (None: it is)."""
    if settings.shm_max_regions == 0:
        return "system shared memory is turned off (--shm-max-regions 0)"
    if settings.workers > 1:  # each front-end process would hold its own registrations
        return "system shared memory needs --workers 1 (regions are registered per process)"
    if not SHM_DIR.is_dir():
        return f"system shared memory needs POSIX shared memory at {SHM_DIR} (Linux)"
    return None


def check_key(key: str) -> str:
    """The object's file name under /dev/shm: shm_open's rules (leading slashes dropped, then
    one file name), so no key reaches a path outside it."""
    if not isinstance(key, str) or "\x00" in key:
        raise BadInput("shared memory key must be a string")
    name = key.lstrip("/")
    if not name or "/" in name or name in (".", "..") or len(name) > KEY_MAX:
        raise BadInput(
            f"shared memory key {key!r} is not a POSIX shared-memory name ('/name': one "
            f"component of at most {KEY_MAX} characters)"
        )
    return name


def _map(key: str, offset: int, byte_size: int) -> tuple[mmap.mmap, int]:
    """Map `byte_size` bytes of the object from `offset`; returns (mapping, start in it)."""
    path = SHM_DIR / check_key(key)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BadInput(f"unable to open shared memory key {key!r}: no such object") from None
    except OSError as exc:
        raise BadInput(f"unable to open shared memory key {key!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadInput(f"shared memory key {key!r} is not a shared-memory object")
        if info.st_size < offset + byte_size:
            raise BadInput(
                f"shared memory key {key!r} holds {info.st_size} bytes; offset {offset} + "
                f"byte_size {byte_size} runs past its end"
            )
        aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
        length = offset - aligned + byte_size
        return mmap.mmap(fd, length, mmap.MAP_SHARED, offset=aligned), offset - aligned
    finally:
        os.close(fd)  # the mapping holds its own descriptor


def _size(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadInput(f"'{what}' must be a non-negative integer, got {value!r}")
    return value


class SystemRegions:
    """The server's registered regions, bounded in count and total bytes. Thread-safe: requests
    decoded on worker threads take leases too."""

    def __init__(
        self,
        max_regions: int,
        max_bytes: int,
        disabled: str | None = None,
        max_tensor_bytes: int | None = None,
    ) -> None:
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.disabled = disabled  # why registration is refused (None: it is offered)
        # one tensor's bytes at most: what a request body could carry (--max-body-bytes)
        self.max_tensor_bytes = max_tensor_bytes
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_settings(cls, settings: Settings) -> SystemRegions:
        return cls(
            settings.shm_max_regions,
            settings.shm_max_bytes,
            unavailable(settings),
            max_tensor_bytes=settings.max_body_bytes,
        )

    def register(self, name: str, key: str, offset: Any, byte_size: Any) -> None:
        """Map the region and name it; 400 when it cannot be mapped as asked."""
        if self.disabled:
            raise NotSupported(self.disabled)
        if not isinstance(name, str) or not name:
            raise BadInput("a shared memory region needs a non-empty name")
        offset, byte_size = _size(offset, "offset"), _size(byte_size, "byte_size")
        if byte_size == 0:
            raise BadInput(f"shared memory region '{name}': byte_size must be positive")
        with self._lock:
            self._check_room(name, byte_size)
        mapping, start = _map(key, offset, byte_size)
        region = Region(name, key, offset, byte_size, mapping, start)
        with self._lock:
            try:
                self._check_room(name, byte_size)  # again: another registration may have won
            except ServiceError:
                region._close()
                raise
            self._regions[name] = region

    def _check_room(self, name: str, byte_size: int) -> None:
        if name in self._regions:
            raise RegionExists(f"shared memory region '{name}' is already registered")
        if len(self._regions) >= self.max_regions:
            raise RegionsFull(
                f"{len(self._regions)} shared memory regions are registered, the most "
                "--shm-max-regions allows; unregister one first"
            )
        total = sum(r.byte_size for r in self._regions.values()) + byte_size
        if total > self.max_bytes:
            raise RegionsFull(
                f"registering {byte_size} bytes would map {total} bytes of shared memory, "
                f"more than --shm-max-bytes {self.max_bytes}"
            )

    def unregister(self, name: str | None = None) -> None:
        """Forget `name` (every region when None); an unknown name is no error (as Triton)."""
        with self._lock:
            names = list(self._regions) if name is None else [name]
            gone = [self._regions.pop(n) for n in names if n in self._regions]
        for region in gone:
            with region.lock:
                region.retired = True
                idle = region.users == 0
            if idle:
                region._close()

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        """Each region's name, key, offset and byte_size (404 for an unknown `name`)."""
        with self._lock:
            if name is None:
                return [r.status() for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"unable to find system shared memory region: '{name}'")
        return [region.status()]

    def acquire(self, name: str) -> Region:
        """A lease on the region `name` (400 when not registered); end it with release()."""
        with self._lock:
            region = self._regions.get(name)
            if region is None:  # a request's mistake: 400, not the 404 of a model
                raise BadInput(f"unable to find system shared memory region: '{name}'")
            with region.lock:
                region.users += 1
        return region

    @staticmethod
    def release(region: Region) -> None:
        with region.lock:
            region.users -= 1
            last = region.retired and region.users == 0
        if last:
            region._close()

    def close(self) -> None:
        """At shutdown: forget every region (the mappings go with their last lease)."""
        self.unregister(None)
