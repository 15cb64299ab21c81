"""Triton's CUDA shared-memory extension on a host without a GPU, through the real app (HTTP over
httpx.ASGITransport, gRPC on the app's own in-process listener with tritonclient.grpc.aio).

A CPU build answers every registration "GPUs not supported" (as Triton's CPU builds). For the
GPU path, torch.cuda.is_available/device_count are patched and only the lowest level is fake:
the CUDA libraries behind service.shm.cuda_regions.Cudart (cudaIpcOpenMemHandle and the rest,
called through ctypes as on a GPU, here backed by host buffers standing in for the client's GPU
memory) and device_tensor (which wraps a device pointer; here the host buffer). The rest runs:
wire parsing, validation, the registry's leases, unregister while in use, the bounds checks,
reads and writes. On a GPU: tests/gpu/test_gpu_cuda_shared_memory.py.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import itertools
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http as thttp
from torch import nn
from tritonclient.utils import InferenceServerException

import mha_engine
from service.oip.inputs import Payload
from service.oip.model_config import extensions
from service.pipeline.errors import BadInput
from service.runtime.forward import hidden_states
from service.runtime.settings import Settings
from service.shm import cuda_regions
from service.shm.cuda_regions import HANDLE_SIZE, Cudart, cuda_unavailable
from service.shm.regions import Regions
from service.shm.tensors import SharedMemoryIO
from tests.inprocess import asgi_client
from tests.support import FP32_TOL, free_port

E = 16
SHAPE = (2, 3, E)
NBYTES = int(np.prod(SHAPE)) * 4
CPU_ONLY = "failed to register CUDA shared memory region: 'r', GPUs not supported (this build serves on the CPU only)"  # noqa: E501
INVALID_RESOURCE_HANDLE = 400  # cudaErrorInvalidResourceHandle


class FakeRuntime:
    """libcudart's calls Cudart makes, over host buffers that stand in for the client's
    cudaMalloc'd memory (a handle: 64 bytes naming one buffer)."""

    def __init__(self, devices: int = 2) -> None:
        self.devices = devices
        self.current = 0
        self.buffers: dict[bytes, np.ndarray] = {}
        self.opened: list[tuple[int, int]] = []  # (address, device it was opened on)
        self.closed: list[int] = []
        self.last_error = 0
        self._ids = itertools.count(1)

    def allocate(self, nbytes: int) -> tuple[bytes, np.ndarray]:
        handle = f"fake-ipc-{next(self._ids)}".encode().ljust(HANDLE_SIZE, b"\x00")
        self.buffers[handle] = np.zeros(nbytes, np.uint8)
        return handle, self.buffers[handle]

    def cudaIpcOpenMemHandle(self, pointer, handle, flags) -> int:
        assert flags == cuda_regions.LAZY_PEER_ACCESS
        buffer = self.buffers.get(bytes(handle))
        if buffer is None:
            self.last_error = INVALID_RESOURCE_HANDLE
            return INVALID_RESOURCE_HANDLE
        pointer.contents.value = buffer.ctypes.data
        self.opened.append((buffer.ctypes.data, self.current))
        return 0

    def cudaIpcCloseMemHandle(self, pointer) -> int:
        self.closed.append(pointer.value)
        return 0

    def cudaGetDevice(self, device) -> int:
        device.contents.value = self.current
        return 0

    def cudaSetDevice(self, device: int) -> int:
        if not 0 <= device < self.devices:
            return 101  # cudaErrorInvalidDevice
        self.current = device
        return 0

    def cudaGetLastError(self) -> int:
        error, self.last_error = self.last_error, 0
        return error

    def cudaGetErrorString(self, code: int) -> bytes:
        return b"invalid resource handle" if code == INVALID_RESOURCE_HANDLE else b"error"


class FakeDriver:
    """libcuda's cuMemGetAddressRange over the fake runtime's buffers."""

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime

    def cuMemGetAddressRange_v2(self, base, size, pointer) -> int:
        for buffer in self.runtime.buffers.values():
            start = buffer.ctypes.data
            if start <= pointer.value < start + buffer.nbytes:
                base.contents.value, size.contents.value = start, buffer.nbytes
                return 0
        return 1  # CUDA_ERROR_INVALID_VALUE


def _host_tensor(pointer: int, nbytes: int, device_id: int) -> torch.Tensor:
    """device_tensor's stand-in: the same zero-copy wrap, of host memory."""
    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(pointer)))


@pytest.fixture
def fake_gpu(monkeypatch) -> FakeRuntime:
    """Two GPUs as torch sees them; the CUDA libraries fake."""
    runtime = FakeRuntime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: runtime.devices)
    monkeypatch.setattr(cuda_regions, "_CUDART", [Cudart(runtime, FakeDriver(runtime))])
    monkeypatch.setattr(cuda_regions, "device_tensor", _host_tensor)
    return runtime


@pytest.fixture(scope="module")
def module() -> nn.MultiheadAttention:
    torch.manual_seed(5)
    return nn.MultiheadAttention(E, 4, batch_first=True).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, module):
    path = tmp_path_factory.mktemp("cudashm") / "attn"
    mha_engine.save_model(module, path)
    return path


@asynccontextmanager
async def serving(model_dir, gpu: bool) -> AsyncIterator[tuple]:
    """The app (HTTP client, gRPC client, its state). `gpu`: its registry as on a --device cuda
    server (the model itself computes on the CPU: there is no CUDA here)."""
    port = free_port()
    async with asgi_client(model_dir=[model_dir], device="cpu", grpc_port=port) as http:
        state = http.app.state.service
        if gpu:
            cuda_settings = state.settings.model_copy(update={"device": "cuda"})
            state.shared_memory = Regions.for_settings(cuda_settings)
        async with tgrpc_aio.InferenceServerClient(f"127.0.0.1:{port}") as grpc_client:
            yield http, grpc_client, state


async def _grpc_error(call, *args) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        await call(*args)
    return info.value


def _register_body(handle: bytes, device_id: int = 0, byte_size: int = NBYTES) -> dict:
    """What tritonclient.http sends: get_raw_handle's base64, as a JSON string."""
    b64 = base64.b64encode(handle).decode()
    return {"raw_handle": {"b64": b64}, "device_id": device_id, "byte_size": byte_size}


class _Sent(Exception):
    pass


def _as_tritonclient_sends(handle: bytes, device_id: int) -> tuple[str, bytes]:
    """The URI and body the unmodified tritonclient.http sends to register `handle` (what
    get_raw_handle gives: base64 bytes), caught before it reaches a socket."""
    client = thttp.InferenceServerClient("127.0.0.1:9")
    sent: dict = {}

    def post(request_uri, request_body, headers, query_params):
        sent.update(uri=request_uri, body=request_body)
        raise _Sent

    client._post = post
    with pytest.raises(_Sent):
        client.register_cuda_shared_memory("a", base64.b64encode(handle), device_id, NBYTES)
    body = sent["body"]
    return sent["uri"], body.encode() if isinstance(body, str) else body


def test_a_cpu_build_answers_not_supported(model_dir) -> None:
    async def main() -> None:
        async with serving(model_dir, gpu=False) as (http, grpc_client, _):
            body = _register_body(b"\x01" * HANDLE_SIZE)
            response = await http.post("/v2/cudasharedmemory/region/r/register", json=body)
            assert response.status_code == 400 and response.json() == {"error": CPU_ONLY}
            raw = await http.post("/v2/cudasharedmemory/region/r/register", content=b"not json")
            assert raw.json() == {"error": CPU_ONLY}  # refused whatever the body
            error = await _grpc_error(
                grpc_client.register_cuda_shared_memory, "r", base64.b64encode(b"h"), 0, 64
            )
            assert error.status() == "StatusCode.INVALID_ARGUMENT"
            assert error.message() == CPU_ONLY
            assert (await http.get("/v2/cudasharedmemory/status")).json() == []
            named = await http.get("/v2/cudasharedmemory/region/r/status")
            assert named.status_code == 404
            assert "unable to find cuda shared memory region: 'r'" in named.json()["error"]
            assert not (await grpc_client.get_cuda_shared_memory_status()).regions
            assert (await http.post("/v2/cudasharedmemory/unregister")).json() == {}
            await grpc_client.unregister_cuda_shared_memory("r")
            meta = (await http.get("/v2")).json()
            assert "cuda_shared_memory" not in meta["extensions"]
            assert "system_shared_memory" in meta["extensions"]

    asyncio.run(main())


def test_offered_only_with_the_engine_on_a_gpu(fake_gpu) -> None:
    assert cuda_unavailable(Settings(device="cuda")) is None
    assert cuda_unavailable(Settings()) is None  # the default device is cuda where there is one
    assert "cuda_shared_memory" in extensions(Settings(device="cuda:1"))
    assert cuda_unavailable(Settings(device="cpu")) == (
        "GPUs not supported (the engine runs on cpu: --device cpu)"
    )
    assert "cuda_shared_memory" not in extensions(Settings(device="cpu"))
    assert "--shm-max-regions 0" in cuda_unavailable(Settings(device="cuda", shm_max_regions=0))
    assert "--workers 1" in cuda_unavailable(Settings(device="cuda", workers=2))


def test_register_status_and_unregister_over_http_and_grpc(model_dir, fake_gpu) -> None:
    runtime = fake_gpu
    first, first_memory = runtime.allocate(NBYTES)
    second, second_memory = runtime.allocate(2 * NBYTES)

    async def main() -> None:
        async with serving(model_dir, gpu=True) as (http, grpc_client, _):
            uri, body = _as_tritonclient_sends(first, 1)  # its body, replayed to the app
            assert body.startswith(b'{"raw_handle":{"b64":"')
            response = await http.post(f"/{uri}", content=body)
            assert response.status_code == 200, response.text
            assert runtime.opened == [(first_memory.ctypes.data, 1)]  # on the named device
            assert runtime.current == 0  # and the thread's device put back
            await grpc_client.register_cuda_shared_memory(
                "b", base64.b64encode(second), 0, 2 * NBYTES
            )
            want = [
                {"name": "a", "device_id": 1, "byte_size": NBYTES},
                {"name": "b", "device_id": 0, "byte_size": 2 * NBYTES},
            ]
            assert (await http.get("/v2/cudasharedmemory/status")).json() == want
            assert (await http.get("/v2/cudasharedmemory/region/b/status")).json() == want[1:]
            status = await grpc_client.get_cuda_shared_memory_status("a")
            assert status.regions["a"].device_id == 1 and status.regions["a"].byte_size == NBYTES
            assert set((await grpc_client.get_cuda_shared_memory_status()).regions) == {"a", "b"}
            # one namespace with system regions, but each kind lists and removes its own
            assert (await http.get("/v2/systemsharedmemory/status")).json() == []
            assert (await http.get("/v2/systemsharedmemory/region/a/status")).status_code == 404
            await http.post("/v2/systemsharedmemory/unregister")
            again = await http.post(
                "/v2/cudasharedmemory/region/a/register", json=_register_body(second)
            )
            assert again.status_code == 400 and "already registered" in again.json()["error"]
            error = await _grpc_error(
                grpc_client.register_cuda_shared_memory, "a", base64.b64encode(second), 0, 8
            )
            assert error.status() == "StatusCode.ALREADY_EXISTS"

            await http.post("/v2/cudasharedmemory/region/a/unregister")
            assert runtime.closed == [first_memory.ctypes.data]
            await grpc_client.unregister_cuda_shared_memory()
            assert runtime.closed == [first_memory.ctypes.data, second_memory.ctypes.data]
            assert (await http.get("/v2/cudasharedmemory/status")).json() == []
            assert not (await grpc_client.get_cuda_shared_memory_status()).regions

    asyncio.run(main())


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"device_id": 0, "byte_size": 8}, "'raw_handle': {'b64': <base64 string>}"),
        ({"raw_handle": "abc", "device_id": 0, "byte_size": 8}, "'raw_handle': {'b64'"),
        ({"raw_handle": {"b64": "not base64!"}, "device_id": 0, "byte_size": 8}, "base64"),
        (_register_body(b"\x01" * 63), f"must be the {HANDLE_SIZE} bytes of a cudaIpcMemHandle_t"),
        (_register_body(b"\x01" * HANDLE_SIZE, device_id=2), "device_id 2, but this server sees 2"),
        (_register_body(b"\x01" * HANDLE_SIZE, device_id=-1), "device_id must be a non-negative"),
        (_register_body(b"\x01" * HANDLE_SIZE, byte_size=0), "byte_size must be positive"),
        (_register_body(b"\x01" * HANDLE_SIZE, byte_size=-4), "'byte_size' must be a non-negat"),
        (_register_body(b"\x01" * HANDLE_SIZE), "cudaIpcOpenMemHandle failed: invalid resource"),
        ([1, 2], "'raw_handle': {'b64'"),
    ],
)
def test_registrations_are_checked(model_dir, fake_gpu, body, message) -> None:
    async def main() -> None:
        async with serving(model_dir, gpu=True) as (http, _, _state):
            response = await http.post("/v2/cudasharedmemory/region/r/register", json=body)
            assert response.status_code == 400, response.text
            assert message in response.json()["error"]
            assert (await http.get("/v2/cudasharedmemory/status")).json() == []

    asyncio.run(main())
    assert fake_gpu.last_error == 0  # a failed open's error is cleared, not left for torch
    assert fake_gpu.current == 0


def test_a_byte_size_past_the_allocation_is_refused_and_the_handle_closed(
    model_dir, fake_gpu
) -> None:
    handle, memory = fake_gpu.allocate(64)

    async def main() -> None:
        async with serving(model_dir, gpu=True) as (_, grpc_client, _state):
            error = await _grpc_error(
                grpc_client.register_cuda_shared_memory, "big", base64.b64encode(handle), 0, 65
            )
            assert error.status() == "StatusCode.INVALID_ARGUMENT"
            assert "byte_size 65 is more than the 64 bytes its allocation holds" in error.message()
            assert fake_gpu.closed == [memory.ctypes.data]
            short = await _grpc_error(
                grpc_client.register_cuda_shared_memory, "s", base64.b64encode(b"x" * 8), 0, 8
            )
            assert "64 bytes of a cudaIpcMemHandle_t, got 8" in short.message()

    asyncio.run(main())


def _infer_body(in_offset: int = 0, out_size: int = NBYTES, **input_params) -> dict:
    params = {"shared_memory_region": "in", "shared_memory_byte_size": NBYTES}
    params.update({"shared_memory_offset": in_offset} if in_offset else {}, **input_params)
    return {
        "inputs": [{"name": "input", "shape": list(SHAPE), "datatype": "FP32",
                    "parameters": params}],
        "outputs": [{"name": "output", "parameters": {
            "shared_memory_region": "out", "shared_memory_byte_size": out_size}}],
    }  # fmt: skip


def test_inference_reads_and_writes_cuda_regions_with_checked_bounds(
    model_dir, module, fake_gpu, monkeypatch
) -> None:
    # Inputs are read from a CUDA region off the event loop (here: the main thread), even a
    # small gRPC request's: the copy waits for the forward queued on the device. (Outputs are
    # written where the batch runs: on this CPU model, short batches run on the loop.)
    read_on: list[str] = []
    read = cuda_regions.CudaRegion.read

    def reading(self, offset: int, nbytes: int) -> np.ndarray:
        read_on.append(threading.current_thread().name)
        return read(self, offset, nbytes)

    monkeypatch.setattr(cuda_regions.CudaRegion, "read", reading)
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    q = torch.from_numpy(x)
    want = module(q, q, q, need_weights=False)[0].detach().numpy()
    in_handle, in_memory = fake_gpu.allocate(NBYTES + 8)
    in_memory[8:] = x.reshape(-1).view(np.uint8)  # the input at offset 8
    out_handle, out_memory = fake_gpu.allocate(NBYTES)

    async def main() -> None:
        async with serving(model_dir, gpu=True) as (http, grpc_client, _):
            for name, handle, size in (("in", in_handle, NBYTES + 8), ("out", out_handle, NBYTES)):
                body = _register_body(handle, byte_size=size)
                url = f"/v2/cudasharedmemory/region/{name}/register"
                response = await http.post(url, json=body)
                assert response.status_code == 200, response.text

            response = await http.post("/v2/models/attn/infer", json=_infer_body(in_offset=8))
            assert response.status_code == 200, response.text
            output = response.json()["outputs"][0]
            assert output["shape"] == list(SHAPE)  # in the region: no data, no parameters
            assert "data" not in output and "parameters" not in output  # (as Triton answers)
            np.testing.assert_allclose(out_memory.view(np.float32).reshape(SHAPE), want, **FP32_TOL)

            out_memory[:] = 0
            item = tgrpc_aio.InferInput("input", list(SHAPE), "FP32")
            item.set_shared_memory("in", NBYTES, offset=8)
            requested = tgrpc_aio.InferRequestedOutput("output")
            requested.set_shared_memory("out", NBYTES)
            result = await grpc_client.infer("attn", [item], outputs=[requested])
            assert result.get_output("output").parameters["shared_memory_byte_size"].int64_param
            np.testing.assert_allclose(out_memory.view(np.float32).reshape(SHAPE), want, **FP32_TOL)
            assert len(read_on) == 2 and threading.main_thread().name not in read_on

            # the bounds, checked before any access, with each protocol's error shape
            past = await http.post("/v2/models/attn/infer", json=_infer_body(in_offset=16))
            assert past.status_code == 400
            assert past.json()["error"] == (
                "input 'input': shared memory offset 16 + byte_size 384 runs past the end of "
                "region 'in' (392 bytes)"
            )
            small = await http.post("/v2/models/attn/infer", json=_infer_body(out_size=NBYTES - 4))
            assert small.status_code == 400 and "should be at least 384 bytes" in small.text
            item.set_shared_memory("in", NBYTES, offset=9)
            error = await _grpc_error(grpc_client.infer, "attn", [item])
            assert error.status() == "StatusCode.INVALID_ARGUMENT"
            assert "offset 9 + byte_size 384 runs past the end of region 'in'" in error.message()
            unknown = _infer_body()
            unknown["inputs"][0]["parameters"]["shared_memory_region"] = "nope"
            response = await http.post("/v2/models/attn/infer", json=unknown)
            assert "unable to find shared memory region: 'nope'" in response.json()["error"]
            assert fake_gpu.closed == []  # every request's lease ended; nothing closed

    asyncio.run(main())


def test_unregister_while_in_use_closes_after_the_last_lease(model_dir, fake_gpu) -> None:
    """A request holding the region (its input read, its output still to be written) finishes
    with it after an unregister; new requests cannot find it; it is closed when the request
    ends, once."""
    handle, memory = fake_gpu.allocate(NBYTES)
    memory[:] = np.arange(NBYTES, dtype=np.uint8)
    params = {"shared_memory_region": "busy", "shared_memory_byte_size": NBYTES}

    async def main() -> None:
        async with serving(model_dir, gpu=True) as (http, grpc_client, state):
            await grpc_client.register_cuda_shared_memory(
                "busy", base64.b64encode(handle), 0, NBYTES
            )
            with SharedMemoryIO(state.shared_memory) as shm:  # one request's leases
                data = shm.read_input("input", "UINT8", [NBYTES], params)
                shm.want_output("output", params)
                await grpc_client.unregister_cuda_shared_memory("busy")
                assert fake_gpu.closed == []  # leased: stays open
                assert (await http.get("/v2/cudasharedmemory/status")).json() == []
                with (
                    pytest.raises(Exception, match="unable to find shared memory region: 'busy'"),
                    SharedMemoryIO(state.shared_memory) as late,
                ):
                    late.read_input("input", "UINT8", [NBYTES], params)
                np.testing.assert_array_equal(data, np.arange(NBYTES, dtype=np.uint8))
                assert data.ctypes.data != memory.ctypes.data  # a copy
                shm.write_output("output", np.full(NBYTES // 4, 2.5, np.float32))
                np.testing.assert_array_equal(memory.view(np.float32), 2.5)
                assert fake_gpu.closed == []
            assert fake_gpu.closed == [memory.ctypes.data]  # closed as the last lease ended
            await http.post("/v2/cudasharedmemory/unregister")
            assert fake_gpu.closed == [memory.ctypes.data]  # and only once

    asyncio.run(main())


def test_the_engine_writes_a_cuda_output_from_the_device_once(model_dir, module, fake_gpu) -> None:
    """The batch output's rows go into a CUDA region from the engine thread (device to device
    on a GPU; here the fake's host memory), before the answer; write_output then only answers
    (it writes nothing more), and a region too small is that request's error, no one else's."""
    model = mha_engine.load_model(model_dir, device="cpu")
    regions = Regions.for_settings(Settings(device="cuda"))
    handle, memory = fake_gpu.allocate(NBYTES)
    small_handle, small_memory = fake_gpu.allocate(NBYTES - 4)
    cuda_regions.register_cuda(regions, "out", handle, 0, NBYTES)
    cuda_regions.register_cuda(regions, "small", small_handle, 0, NBYTES - 4)
    x = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    q = torch.from_numpy(x)
    want = module(q, q, q, need_weights=False)[0].detach().numpy()
    with SharedMemoryIO(regions) as shm, SharedMemoryIO(regions) as other:
        shm.want_output(
            "output", {"shared_memory_region": "out", "shared_memory_byte_size": NBYTES}
        )
        small = {"shared_memory_region": "small", "shared_memory_byte_size": NBYTES - 4}
        other.want_output("output", small)
        payloads = [Payload(x.reshape(-1, E), [SHAPE[1]] * SHAPE[0]) for _ in range(2)]
        payloads[0].output_sink = shm.device_sink("output")
        payloads[1].output_sink = other.device_sink("output")
        first, second = hidden_states(model, payloads)
        np.testing.assert_allclose(memory.view(np.float32).reshape(SHAPE), want, **FP32_TOL)
        np.testing.assert_allclose(first.reshape(SHAPE), want, **FP32_TOL)
        assert isinstance(second, BadInput) and "should be at least 384 bytes" in str(second)
        assert not small_memory.any()  # nothing written into the small one
        parameters = shm.write_output("output", np.zeros(SHAPE, np.float32))
        assert parameters == {"shared_memory_region": "out", "shared_memory_byte_size": NBYTES}
        np.testing.assert_allclose(memory.view(np.float32).reshape(SHAPE), want, **FP32_TOL)
    # a request that ended (timed out) while its batch ran: its lease is gone, the region was
    # unregistered and closed, and the engine's late write is refused, not made
    with SharedMemoryIO(regions) as gone:
        gone.want_output("output", {"shared_memory_region": "out", "shared_memory_byte_size": 8})
        sink = gone.device_sink("output")
        regions.unregister("out", kind="cuda")
        assert fake_gpu.closed == []
    assert fake_gpu.closed == [memory.ctypes.data]
    with pytest.raises(BadInput, match="region 'out' was unregistered"):
        sink(torch.zeros(2, dtype=torch.float32))
    np.testing.assert_allclose(memory.view(np.float32).reshape(SHAPE), want, **FP32_TOL)
    system = Regions(max_regions=1, max_bytes=1)  # a system region's output: the host path
    assert SharedMemoryIO(system).device_sink("output") is None
