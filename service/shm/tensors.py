"""A request's tensors in shared memory, system or CUDA: inputs read from, outputs written into,
regions named by the `shared_memory_region`, `shared_memory_offset` and `shared_memory_byte_size`
parameters (Triton's names, over HTTP and gRPC alike).

Every range is checked here, for both kinds, against the region's registered size before
anything is read or written; inputs are copied out (the client may reuse its memory as soon as
the answer arrives, and the batch never sees memory a client can change under it). Only where
the bytes live differs (Region.read/write: a mapping, or a CUDA buffer). The request's leases
end with `close()`.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from service.oip.codecs import OFFLOAD_BYTES, check_shape
from service.oip.datatypes import DATATYPES
from service.pipeline.errors import BadInput
from service.shm import BYTE_SIZE, OFFSET, REGION

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from service.shm.regions import Leased, Regions


@dataclass
class Target:
    """Where an output goes: its region, offset and the bytes the client set aside."""

    region: Leased
    offset: int
    byte_size: int
    written: bool = False  # by the engine, device-to-device (a CUDA region)


def _int(parameters: dict[str, Any], key: str, what: str, default: int | None = None) -> int:
    value = parameters.get(key, default)
    if value is None:
        raise BadInput(f"{what}: '{key}' is required with '{REGION}'")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadInput(f"{what}: '{key}' must be a non-negative integer, got {value!r}")
    return value


class SharedMemoryIO:
    """One request's use of the registered regions (as a context manager: its leases end on
    exit, whatever happened)."""

    def __init__(self, regions: Regions) -> None:
        self.regions = regions
        self.outputs: dict[str, Target] = {}
        self._leases: list[Leased] = []

    def __enter__(self) -> SharedMemoryIO:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        leases, self._leases = self._leases, []
        for region in leases:
            self.regions.release(region)

    def _range(self, parameters: dict[str, Any], what: str) -> tuple[Leased, int, int]:
        """The region, offset and byte size named by `parameters`, inside the region."""
        name = parameters.get(REGION)
        if not isinstance(name, str) or not name:
            raise BadInput(f"{what}: '{REGION}' must be a region's name")
        offset = _int(parameters, OFFSET, what, default=0)
        byte_size = _int(parameters, BYTE_SIZE, what)
        if self.regions.disabled and self.regions.cuda_disabled:  # neither kind is offered
            raise BadInput(f"{what}: {self.regions.disabled}")
        limit = self.regions.max_tensor_bytes
        if limit is not None and byte_size > limit:  # before anything is copied
            raise BadInput(
                f"{what}: shared_memory_byte_size {byte_size} is over --max-body-bytes "
                f"({limit}), the most a request's tensor may hold"
            )
        region = self.regions.acquire(name)
        self._leases.append(region)
        if offset + byte_size > region.byte_size:
            raise BadInput(
                f"{what}: shared memory offset {offset} + byte_size {byte_size} runs past the "
                f"end of region '{name}' ({region.byte_size} bytes)"
            )
        return region, offset, byte_size

    def read_input(
        self, name: str, datatype: str, shape: Any, parameters: dict[str, Any]
    ) -> np.ndarray:
        """Input `name` of `shape` copied out of its region; its byte size must be exact."""
        what = f"input '{name}'"
        region, offset, byte_size = self._range(parameters, what)
        shape, count = check_shape(shape, name, byte_size)
        dtype = DATATYPES[datatype].numpy
        needed = count * dtype.itemsize
        if byte_size != needed:
            raise BadInput(
                f"{what}: shared_memory_byte_size is {byte_size} but shape {list(shape)} of "
                f"{datatype} needs {needed} bytes"
            )
        # a copy (nothing refers to the region's memory after), as dtype once on the host
        return region.read(offset, byte_size).view(dtype).reshape(shape)

    def want_output(self, name: str, parameters: dict[str, Any]) -> None:
        """Record where output `name` goes (checked against its region now, before any work)."""
        region, offset, byte_size = self._range(parameters, f"output '{name}'")
        self.outputs[name] = Target(region, offset, byte_size)

    def device_sink(self, name: str) -> Callable[[torch.Tensor], None] | None:
        """Where the engine writes output `name` from the device, when it goes to a CUDA region
        (one device-to-device copy on the engine thread, before the answer; unverified on a
        GPU); None for the host path (write_output)."""
        target = self.outputs.get(name)
        if target is None or target.region.kind != "cuda":
            return None

        def sink(rows: torch.Tensor) -> None:
            _check_fits(name, target, rows.numel() * rows.element_size())
            target.region.write_tensor(target.offset, rows)
            target.written = True

        return sink

    def write_output(self, name: str, array: np.ndarray) -> dict[str, Any]:
        """Write output `name` into its region (unless the engine did, device_sink); returns the
        output's parameters for the answer. A result larger than the client set aside is refused
        (nothing written)."""
        target = self.outputs[name]
        nbytes = math.prod(array.shape) * array.dtype.itemsize
        _check_fits(name, target, nbytes)
        if not target.written:
            target.region.write(
                target.offset, np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            )
        parameters: dict[str, Any] = {REGION: target.region.name, BYTE_SIZE: nbytes}
        if target.offset:
            parameters[OFFSET] = target.offset
        return parameters


def _check_fits(name: str, target: Target, nbytes: int) -> None:
    if nbytes > target.byte_size:
        raise BadInput(
            f"shared memory size specified with the request for output '{name}' "
            f"({target.byte_size} bytes) should be at least {nbytes} bytes to hold the results"
        )


async def write_outputs(shm: SharedMemoryIO, name: str, array: np.ndarray) -> dict[str, Any] | None:
    """Output `name` into its region if the request put it in one (large ones off the event
    loop); returns its parameters for the answer, None when it travels in the answer."""
    if name not in shm.outputs:
        return None
    if array.nbytes > OFFLOAD_BYTES:
        return await asyncio.to_thread(shm.write_output, name, array)
    return shm.write_output(name, array)
