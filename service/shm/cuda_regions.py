"""Triton's CUDA shared memory: a client's GPU buffer (cudaMalloc'd in its own process), shared by
its 64-byte IPC handle. The server opens the handle on the named device (cudaIpcOpenMemHandle),
reads inputs from and writes outputs into the buffer, and closes it (cudaIpcCloseMemHandle) once
the region is unregistered and no request holds a lease on it (service.shm.regions: both kinds
share the registry, its leases and, in service.shm.tensors, its bounds checks).

Unverified on a GPU (no GPU this session): in the CPU suite the CUDA libraries are fakes at the
ctypes level (tests/service/test_cuda_shared_memory.py); tests/gpu/test_gpu_cuda_shared_memory.py
is the check on a GPU, with the unmodified tritonclient.utils.cuda_shared_memory.

Why ctypes: torch 2.13 has no API that opens a raw cudaIpcMemHandle_t (torch.UntypedStorage.
_new_shared_cuda opens one only with torch.multiprocessing's reference-counter file and event
handles, which a Triton client does not send); torch.cuda.cudart() exposes no IPC calls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from service.pipeline.errors import BadInput
from service.shm.regions import CPU_ONLY, NotSupported, checked_size

if TYPE_CHECKING:
    from service.runtime.settings import Settings
    from service.shm.regions import Regions

log = logging.getLogger("service")

HANDLE_SIZE = 64  # CUDA_IPC_HANDLE_SIZE: sizeof(cudaIpcMemHandle_t)
LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess, the flag Triton opens handles with


class IpcHandle(ctypes.Structure):
    """cudaIpcMemHandle_t, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * HANDLE_SIZE)]


def cuda_unavailable(settings: Settings) -> str | None:
    """Why CUDA shared memory is not offered with `settings` (None: it is): only where the
    engine computes on a CUDA device this process sees, in one process."""
    if not torch.cuda.is_available():
        return CPU_ONLY  # Triton's CPU builds answer the same
    try:
        device = torch.device(settings.device or "cuda")
    except (RuntimeError, TypeError, ValueError):
        return f"GPUs not supported (--device {settings.device!r} is not a device name)"
    if device.type != "cuda":
        return f"GPUs not supported (the engine runs on {device}: --device {settings.device})"
    if settings.shm_max_regions == 0:
        return "shared memory is turned off (--shm-max-regions 0)"
    if settings.workers > 1:  # front-ends would each hold their own; the engine is elsewhere
        return "CUDA shared memory needs --workers 1 (regions are registered per process)"
    return None


def not_supported(name: str, why: str) -> NotSupported:
    """Triton's answer to a registration this server cannot take, naming the region."""
    return NotSupported(f"failed to register CUDA shared memory region: '{name}', {why}")


class CudaError(BadInput):
    """A CUDA call on a client's handle failed (a bad or stale handle, a wrong device): 400."""


class Cudart:
    """The CUDA calls regions make, through ctypes: libcudart's device and IPC calls and
    libcuda's cuMemGetAddressRange (how many bytes the opened allocation really holds, so a
    byte_size past its end is refused before any access). `runtime`/`driver` are the loaded
    libraries (the CPU suite passes fakes with the same functions)."""

    def __init__(self, runtime: Any, driver: Any) -> None:
        self.runtime = runtime
        self.driver = driver
        self._lock = threading.Lock()  # set device, call, restore: one thread at a time

    @classmethod
    def load(cls) -> Cudart:
        torch.cuda.init()  # torch's CUDA libraries loaded, its context made
        runtime = ctypes.CDLL(_runtime_path())
        for name, args in (
            ("cudaIpcOpenMemHandle", [ctypes.POINTER(ctypes.c_void_p), IpcHandle, ctypes.c_uint]),
            ("cudaIpcCloseMemHandle", [ctypes.c_void_p]),
            ("cudaGetDevice", [ctypes.POINTER(ctypes.c_int)]),
            ("cudaSetDevice", [ctypes.c_int]),
            ("cudaGetLastError", []),
            ("cudaGetErrorString", [ctypes.c_int]),
        ):
            getattr(runtime, name).argtypes = args
            getattr(runtime, name).restype = ctypes.c_int
        runtime.cudaGetErrorString.restype = ctypes.c_char_p
        driver = ctypes.CDLL("libcuda.so.1")
        driver.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64
        ]  # fmt: skip
        driver.cuMemGetAddressRange_v2.restype = ctypes.c_int
        return cls(runtime, driver)

    def _check(self, code: int, call: str) -> None:
        if code != 0:
            self.runtime.cudaGetLastError()  # clear it: torch would blame its next launch
            text = self.runtime.cudaGetErrorString(code)
            text = text.decode() if isinstance(text, bytes) else str(text)
            raise CudaError(f"{call} failed: {text} (CUDA error {code})")

    def _on_device(self, device_id: int, call: Any) -> Any:
        with self._lock:
            previous = ctypes.c_int(0)
            self._check(self.runtime.cudaGetDevice(ctypes.pointer(previous)), "cudaGetDevice")
            self._check(self.runtime.cudaSetDevice(device_id), "cudaSetDevice")
            try:
                return call()
            finally:
                self.runtime.cudaSetDevice(previous.value)

    def open(self, handle: bytes, device_id: int) -> tuple[int, int]:
        """The handle opened on `device_id`: (device pointer, bytes of its allocation from it)."""

        def call() -> tuple[int, int]:
            pointer = ctypes.c_void_p()
            code = self.runtime.cudaIpcOpenMemHandle(
                ctypes.pointer(pointer), IpcHandle.from_buffer_copy(handle), LAZY_PEER_ACCESS
            )
            self._check(code, "cudaIpcOpenMemHandle")
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            code = self.driver.cuMemGetAddressRange_v2(
                ctypes.pointer(base), ctypes.pointer(size), ctypes.c_uint64(pointer.value)
            )
            if code != 0:
                self.runtime.cudaIpcCloseMemHandle(pointer)
                raise CudaError(f"cuMemGetAddressRange failed on the opened handle (error {code})")
            return pointer.value, base.value + size.value - pointer.value

        return self._on_device(device_id, call)

    def close(self, pointer: int, device_id: int) -> None:
        """Close an opened handle; a failure is logged (nothing a request could do about it)."""
        ptr = ctypes.c_void_p(pointer)

        def call() -> None:
            self._check(self.runtime.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")

        try:
            self._on_device(device_id, call)
        except CudaError as exc:
            log.warning("closing a CUDA shared memory region: %s", exc)


def _runtime_path() -> str:
    """The libcudart torch loaded (found in this process's mappings), else the system's."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return ctypes.util.find_library("cudart") or "libcudart.so"


class _DeviceBytes:
    """`nbytes` of device memory at `pointer` as __cuda_array_interface__ (uint8, 1-D)."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 2,
        }  # fmt: skip


def device_tensor(pointer: int, nbytes: int, device_id: int) -> torch.Tensor:
    """A zero-copy uint8 tensor over device memory (the CPU suite swaps in host memory)."""
    return torch.as_tensor(_DeviceBytes(pointer, nbytes), device=f"cuda:{device_id}")


_CUDART: list[Cudart] = []  # loaded on the first registration


def cudart() -> Cudart:
    if not _CUDART:
        _CUDART.append(Cudart.load())
    return _CUDART[0]


@dataclass(eq=False)
class CudaRegion:
    """One registered CUDA region: the opened handle's device pointer and the leases on it."""

    kind = "cuda"
    name: str
    device_id: int
    byte_size: int
    pointer: int
    cuda: Cudart = field(repr=False)
    users: int = 0
    retired: bool = False  # unregistered: closed when the last lease ends
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def memory(self, offset: int, nbytes: int) -> torch.Tensor:
        """`nbytes` from `offset` as a uint8 CUDA tensor, zero-copy (the caller checked the
        range against byte_size; byte_size was checked against the allocation)."""
        if self.closed:  # a lease keeps it open: reaching this is a bug, not a fault
            raise RuntimeError(f"CUDA shared memory region '{self.name}' is closed")
        return device_tensor(self.pointer + offset, nbytes, self.device_id)

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        """A host copy of the range (one device->host copy): the batch is assembled on the host
        from every request's inputs, and the client may reuse its buffer once answered."""
        host = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            host.copy_(self.memory(offset, nbytes))  # synchronous: the bytes are here after
        return host.numpy()

    def write(self, offset: int, data: np.ndarray) -> None:
        """`data` (contiguous uint8, on the host) into the client's buffer; synchronous, so the
        client reads it once answered. (Outputs of the engine go by write_tensor instead.)"""
        if data.nbytes:
            self.memory(offset, data.nbytes).copy_(torch.from_numpy(data))

    def write_tensor(self, offset: int, rows: torch.Tensor) -> None:
        """`rows` (contiguous: a request's rows of the batch output, on the engine's device) into
        the client's buffer: one device-to-device copy, finished before this returns (so before
        the answer is sent). On the engine thread, which may outlive the request's lease (a
        request that timed out while its batch ran): so under the region's lock, which _close
        takes too, and refused once closed."""
        data = rows.reshape(-1).view(torch.uint8)
        if not data.numel():
            return
        with self.lock:
            if self.closed:
                raise BadInput(f"CUDA shared memory region '{self.name}' was unregistered")
            destination = self.memory(offset, data.numel())
            destination.copy_(data)
            for device in {destination.device, data.device}:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)

    def _close(self) -> None:
        """Close the handle, once; never while write_tensor copies into it."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.cuda.close(self.pointer, self.device_id)


def register_cuda(
    regions: Regions, name: str, raw_handle: Any, device_id: Any, byte_size: Any
) -> None:
    """Open `raw_handle` on `device_id` and name it; 400 naming what is wrong, before any access
    (a byte_size past the allocation's end included)."""
    if regions.cuda_disabled:
        raise not_supported(name, regions.cuda_disabled)
    _, byte_size = checked_size(name, 0, byte_size)
    what = f"failed to register CUDA shared memory region '{name}'"
    if not isinstance(raw_handle, bytes) or len(raw_handle) != HANDLE_SIZE:
        size = len(raw_handle) if isinstance(raw_handle, bytes) else type(raw_handle).__name__
        raise BadInput(
            f"{what}: raw_handle must be the {HANDLE_SIZE} bytes of a cudaIpcMemHandle_t, "
            f"got {size}"
        )
    count = torch.cuda.device_count()
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise BadInput(f"{what}: device_id must be a non-negative integer, got {device_id!r}")
    if device_id >= count:
        raise BadInput(f"{what}: device_id {device_id}, but this server sees {count} GPU(s)")
    regions.check_room(name, byte_size, "cuda")  # before opening anything
    try:
        cuda = cudart()
    except OSError as exc:  # no libcudart/libcuda to be found: not a request's fault, but no 500
        raise not_supported(name, f"the CUDA libraries could not be loaded ({exc})") from None
    try:
        pointer, available = cuda.open(raw_handle, device_id)
    except CudaError as exc:
        raise CudaError(f"{what}: {exc}") from None
    region = CudaRegion(name, device_id, byte_size, pointer, cuda)
    if available < byte_size:
        region._close()
        raise BadInput(
            f"{what}: byte_size {byte_size} is more than the {available} bytes its allocation "
            f"holds on device {device_id}"
        )
    regions.add(region)
