"""Triton's shared-memory RPCs over the server's registry: system regions (service.shm.regions)
and CUDA ones (service.shm.cuda_regions). Where the engine is not on a GPU, a CUDA registration
answers INVALID_ARGUMENT "GPUs not supported", as Triton's CPU builds do (status lists none,
unregistering has nothing to remove: perf_analyzer unregisters both kinds before it starts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.grpc import grpc_service_pb2 as pb
from service.shm.cuda_regions import register_cuda

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
            answer = pb.CudaSharedMemoryStatusResponse()
            for region in self.state.shared_memory.status(request.name or None, kind="cuda"):
                answer.regions[region["name"]].CopyFrom(
                    pb.CudaSharedMemoryStatusResponse.RegionStatus(**region)
                )
            return answer

    async def CudaSharedMemoryRegister(self, request, context):
        async with self._call("CudaSharedMemoryRegister", context):
            register_cuda(
                self.state.shared_memory,
                request.name,
                request.raw_handle,
                request.device_id,
                request.byte_size,
            )
            return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request, context):
        async with self._call("CudaSharedMemoryUnregister", context):
            self.state.shared_memory.unregister(request.name or None, kind="cuda")
            return pb.CudaSharedMemoryUnregisterResponse()
