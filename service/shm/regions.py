"""The registered shared-memory regions, system and CUDA in one namespace (as Triton's manager):
a system region is a client's POSIX shared-memory object (its shm_open key), mapped from `offset`
for `byte_size` bytes; a CUDA region (service.shm.cuda_regions) a client's GPU buffer opened
from its IPC handle. Requests refer to either by name.

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
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from service.pipeline.errors import BadInput, ModelNotFound, ServiceError

if TYPE_CHECKING:
    from service.runtime.settings import Settings

# Triton's answer to a CUDA registration on a build without GPUs (the region's name follows)
CPU_ONLY = "GPUs not supported (this build serves on the CPU only)"
SHM_DIR = Path("/dev/shm")  # where Linux's shm_open keeps its objects
KEY_MAX = 255  # NAME_MAX: an shm_open name is one file name


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
    """One registered system region: its mapping and the leases on it. A CUDA region
    (cuda_regions.CudaRegion) has the same lease fields and read/write/status/_close."""

    kind = "system"
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

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        """A copy of `nbytes` from `offset` (uint8; the caller checked the range)."""
        return np.frombuffer(self.view(offset, nbytes), np.uint8).copy()

    def write(self, offset: int, data: np.ndarray) -> None:
        """`data` (contiguous uint8) into the region at `offset` (range checked by the caller)."""
        np.frombuffer(self.view(offset, data.nbytes), np.uint8)[:] = data

    def _close(self) -> None:
        # BufferError: a view still exists; CPython unmaps when the last one goes
        with contextlib.suppress(BufferError):
            self.mapping.close()


class Leased(Protocol):
    """What the registry needs of a region of either kind."""

    kind: str
    name: str
    byte_size: int
    users: int
    retired: bool
    lock: threading.Lock

    def status(self) -> dict[str, Any]: ...
    def read(self, offset: int, nbytes: int) -> np.ndarray: ...
    def write(self, offset: int, data: np.ndarray) -> None: ...
    def _close(self) -> None: ...


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


def checked_size(name: Any, offset: Any, byte_size: Any) -> tuple[int, int]:
    """A registration's name, offset and byte_size checked (either kind): (offset, byte_size)."""
    if not isinstance(name, str) or not name:
        raise BadInput("a shared memory region needs a non-empty name")
    offset, byte_size = _size(offset, "offset"), _size(byte_size, "byte_size")
    if byte_size == 0:
        raise BadInput(f"shared memory region '{name}': byte_size must be positive")
    return offset, byte_size


class Regions:
    """The server's registered regions of both kinds, bounded in count (both) and mapped bytes
    (system: CUDA regions stay in the client's GPU memory). Thread-safe: requests decoded on
    worker threads take leases too."""

    def __init__(
        self,
        max_regions: int,
        max_bytes: int,
        disabled: str | None = None,
        max_tensor_bytes: int | None = None,
        cuda_disabled: str | None = CPU_ONLY,
    ) -> None:
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.disabled = disabled  # why system registration is refused (None: it is offered)
        self.cuda_disabled = cuda_disabled  # why CUDA registration is refused (None: offered)
        # one tensor's bytes at most: what a request body could carry (--max-body-bytes)
        self.max_tensor_bytes = max_tensor_bytes
        self._regions: dict[str, Leased] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_settings(cls, settings: Settings) -> Regions:
        from service.shm.cuda_regions import cuda_unavailable  # torch's CUDA checks

        return cls(
            settings.shm_max_regions,
            settings.shm_max_bytes,
            unavailable(settings),
            max_tensor_bytes=settings.max_body_bytes,
            cuda_disabled=cuda_unavailable(settings),
        )

    def register(self, name: str, key: str, offset: Any, byte_size: Any) -> None:
        """Map the system region and name it; 400 when it cannot be mapped as asked."""
        if self.disabled:
            raise NotSupported(self.disabled)
        offset, byte_size = checked_size(name, offset, byte_size)
        self.check_room(name, byte_size, "system")
        mapping, start = _map(key, offset, byte_size)
        self.add(Region(name, key, offset, byte_size, mapping, start))

    def add(self, region: Leased) -> None:
        """Name an opened region; closed again (and the error raised) when there is no room."""
        with self._lock:
            try:
                self._check_room(region.name, region.byte_size, region.kind)
            except ServiceError:
                region._close()
                raise
            self._regions[region.name] = region

    def check_room(self, name: str, byte_size: int, kind: str) -> None:
        """The early refusal (name taken, no room) before a region is opened: add() checks
        again, as another registration may win in between."""
        with self._lock:
            self._check_room(name, byte_size, kind)

    def _check_room(self, name: str, byte_size: int, kind: str) -> None:
        if name in self._regions:
            raise RegionExists(f"shared memory region '{name}' is already registered")
        if len(self._regions) >= self.max_regions:
            raise RegionsFull(
                f"{len(self._regions)} shared memory regions are registered, the most "
                "--shm-max-regions allows; unregister one first"
            )
        if kind != "system":
            return
        mapped = (r.byte_size for r in self._regions.values() if r.kind == "system")
        total = sum(mapped) + byte_size
        if total > self.max_bytes:
            raise RegionsFull(
                f"registering {byte_size} bytes would map {total} bytes of shared memory, "
                f"more than --shm-max-bytes {self.max_bytes}"
            )

    def unregister(self, name: str | None = None, kind: str | None = "system") -> None:
        """Forget `name` (every region of `kind` when None; None `kind`: every kind). An
        unknown name, or one of the other kind, is no error (as Triton)."""
        with self._lock:
            names = list(self._regions) if name is None else [name]
            gone = [
                self._regions.pop(n)
                for n in names
                if n in self._regions and kind in (None, self._regions[n].kind)
            ]
        for region in gone:
            with region.lock:
                region.retired = True
                idle = region.users == 0
            if idle:
                region._close()

    def status(self, name: str | None = None, kind: str = "system") -> list[dict[str, Any]]:
        """Each `kind` region's status (404 for a `name` not registered as that kind)."""
        with self._lock:
            if name is None:
                return [r.status() for r in self._regions.values() if r.kind == kind]
            region = self._regions.get(name)
        if region is None or region.kind != kind:
            raise RegionNotFound(f"unable to find {kind} shared memory region: '{name}'")
        return [region.status()]

    def on_device(self, names: list[str]) -> bool:
        """Whether one of the regions `names` is CUDA shared memory (unknown names: no)."""
        return any(getattr(self._regions.get(n), "kind", None) == "cuda" for n in names)

    def acquire(self, name: str) -> Leased:
        """A lease on the region `name` (400 when not registered); end it with release()."""
        with self._lock:
            region = self._regions.get(name)
            if region is None:  # a request's mistake: 400, not the 404 of a model
                raise BadInput(f"unable to find shared memory region: '{name}'")
            with region.lock:
                region.users += 1
        return region

    @staticmethod
    def release(region: Leased) -> None:
        with region.lock:
            region.users -= 1
            last = region.retired and region.users == 0
        if last:
            region._close()

    def close(self) -> None:
        """At shutdown: forget every region (each is closed when its last lease ends)."""
        self.unregister(None, kind=None)
