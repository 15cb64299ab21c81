"""Triton's shared-memory RPCs: system shared memory over the server's registry
(service.shm.regions); CUDA shared memory answers INVALID_ARGUMENT "GPUs not supported" on
registration, as Triton's CPU builds do (status lists none, unregistering has nothing to
remove: perf_analyzer unregisters both kinds before it starts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.grpc import grpc_service_pb2 as pb
from service.shm.regions import RegionNotFound, cuda_unsupported

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from contextlib import AbstractAsyncContextManager

    import grpc

    from service.runtime.state import ServiceState


class SharedMemoryServicer:
    """The shared-memory handlers of the InferenceServicer (its `_call` and `state`)."""

    state: ServiceState

    if TYPE_CHECKING:

        def _call(
            self, method: str, context: grpc.aio.ServicerContext
        ) -> AbstractAsyncContextManager[AsyncIterator]: ...

    async def SystemSharedMemoryStatus(self, request, context):
        async with self._call("SystemSharedMemoryStatus", context):
            answer = pb.SystemSharedMemoryStatusResponse()
            for region in self.state.shared_memory.status(request.name or None):
                answer.regions[region["name"]].CopyFrom(
                    pb.SystemSharedMemoryStatusResponse.RegionStatus(**region)
                )
            return answer

    async def SystemSharedMemoryRegister(self, request, context):
        async with self._call("SystemSharedMemoryRegister", context):
            self.state.shared_memory.register(
                request.name, request.key, request.offset, request.byte_size
            )
            return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        async with self._call("SystemSharedMemoryUnregister", context):
            self.state.shared_memory.unregister(request.name or None)
            return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):
        async with self._call("CudaSharedMemoryStatus", context):
            if request.name:
                raise RegionNotFound(f"unable to find cuda shared memory region: '{request.name}'")
            return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context):
        async with self._call("CudaSharedMemoryRegister", context):
            raise cuda_unsupported(request.name)

    async def CudaSharedMemoryUnregister(self, request, context):
        async with self._call("CudaSharedMemoryUnregister", context):
            return pb.CudaSharedMemoryUnregisterResponse()
