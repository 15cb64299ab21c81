"""Triton's system shared-memory extension against a real server, with the unmodified
tritonclient (HTTP and gRPC) and tritonclient.utils.shared_memory: inputs read from and outputs
written into the client's regions, every range checked against the registered size, unknown
regions refused, unregistering while requests use a region, and CUDA shared memory answered as
unsupported (a CPU build)."""

from __future__ import annotations

import base64
import concurrent.futures
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
import tritonclient.utils.shared_memory as shm
from torch import nn
from tritonclient.utils import InferenceServerException

from service.runtime.settings import Settings
from service.shm.regions import Regions as ServerRegions
from service.shm.regions import unavailable
from tests.service.test_grpc import GrpcServer, attention, expected, rng_input, serving
from tests.support import FP32_TOL

NAME = "attn"
EMBED_DIM = 32
SHAPE = (2, 5, EMBED_DIM)
NBYTES = int(np.prod(SHAPE)) * 4
PROTOCOLS = ("http", "grpc")


@pytest.fixture(scope="module")
def module() -> nn.MultiheadAttention:
    return attention(EMBED_DIM)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, module) -> Iterator[GrpcServer]:
    limits = ("--max-seq-len", "64", "--shm-max-regions", "8", "--max-body-bytes", str(4 * NBYTES))
    with serving(tmp_path_factory.mktemp("models"), module, *limits) as grpc_server:
        yield grpc_server


def _client(server: GrpcServer, protocol: str):
    if protocol == "http":
        return thttp.InferenceServerClient(server.http.address)
    return server.client()


def _lib(protocol: str):
    return thttp if protocol == "http" else tgrpc


class Regions:
    """The test's shared-memory objects (tritonclient.utils.shared_memory), each registered
    with the server; unregistered and destroyed after the test."""

    def __init__(self, client) -> None:
        self.client = client
        self.handles: list = []

    def create(self, name: str, byte_size: int, register: bool = True, offset: int = 0):
        key = f"/mha-test-{os.getpid()}-{name}"
        handle = shm.create_shared_memory_region(name, key, byte_size)
        self.handles.append(handle)
        if register:
            self.client.register_system_shared_memory(name, key, byte_size - offset, offset)
        return handle

    def close(self) -> None:
        self.client.unregister_system_shared_memory()
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture(params=PROTOCOLS)
def regions(request, server) -> Iterator[tuple[str, Regions]]:
    protocol = request.param
    made = Regions(_client(server, protocol))
    try:
        yield protocol, made
    finally:
        made.close()


def _shm_infer(client, protocol: str, in_region: str, out_region: str, **sizes: int):
    """Infer with `input` in `in_region` and `output` into `out_region`."""
    lib = _lib(protocol)
    item = lib.InferInput("input", list(SHAPE), "FP32")
    item.set_shared_memory(in_region, sizes.get("in_size", NBYTES), sizes.get("in_offset", 0))
    output = lib.InferRequestedOutput("output")
    output.set_shared_memory(out_region, sizes.get("out_size", NBYTES), sizes.get("out_offset", 0))
    return client.infer(NAME, [item], outputs=[output])


def _error(call, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call(*args, **kwargs)
    return info.value


def test_inputs_and_outputs_in_shared_memory_match_pytorch(server, regions, module) -> None:
    protocol, made = regions
    x = rng_input(1, *SHAPE)
    handle_in = made.create("in", NBYTES)
    handle_out = made.create("out", NBYTES)
    shm.set_shared_memory_region(handle_in, [x])
    result = _shm_infer(made.client, protocol, "in", "out")
    got = shm.get_contents_as_numpy(handle_out, np.float32, list(SHAPE))
    np.testing.assert_allclose(got, expected(module, x).numpy(), **FP32_TOL)
    output = result.get_output("output")
    if protocol == "http":  # as Triton answers: no data, no parameters (its C++ client reads
        # an output's parameters as binary_data_size)
        assert "data" not in output and "parameters" not in output
        assert list(output["shape"]) == list(SHAPE)
    else:
        parameters = output.parameters
        assert parameters["shared_memory_region"].string_param == "out"
        assert parameters["shared_memory_byte_size"].int64_param == NBYTES
        assert list(result.get_response().raw_output_contents) == [b""]  # as Triton: one each


def test_input_in_shared_memory_output_in_the_answer(server, regions, module) -> None:
    protocol, made = regions
    x = rng_input(4, *SHAPE)
    shm.set_shared_memory_region(made.create("in", NBYTES), [x])
    item = _lib(protocol).InferInput("input", list(SHAPE), "FP32")
    item.set_shared_memory("in", NBYTES)
    got = made.client.infer(NAME, [item]).as_numpy("output")
    np.testing.assert_allclose(got, expected(module, x).numpy(), **FP32_TOL)


def test_offsets_within_regions(server, regions, module) -> None:
    """Both tensors in one region at offsets, the region itself registered from an offset."""
    protocol, made = regions
    x = rng_input(2, *SHAPE)
    page = 4096
    handle = made.create("both", page + 2 * NBYTES + 64, offset=page)
    shm.set_shared_memory_region(handle, [x], offset=page + 64)
    _shm_infer(made.client, protocol, "both", "both", in_offset=64, out_offset=64 + NBYTES)
    got = shm.get_contents_as_numpy(handle, np.float32, list(SHAPE), offset=page + 64 + NBYTES)
    np.testing.assert_allclose(got, expected(module, x).numpy(), **FP32_TOL)


def test_status_lists_the_registered_regions(server, regions) -> None:
    protocol, made = regions
    made.create("listed", NBYTES + 100, offset=100)
    if protocol == "grpc":
        status = made.client.get_system_shared_memory_status(region_name="listed", as_json=True)
        (entry,) = status["regions"].values()
        entry = {k: int(v) if k in ("offset", "byte_size") else v for k, v in entry.items()}
    else:
        (entry,) = made.client.get_system_shared_memory_status(region_name="listed")
    assert entry == {"name": "listed", "key": f"/mha-test-{os.getpid()}-listed",
                     "offset": 100, "byte_size": NBYTES}  # fmt: skip
    made.client.unregister_system_shared_memory("listed")
    assert (
        "unable to find" in _error(made.client.get_system_shared_memory_status, "listed").message()
    )


def test_out_of_bounds_wrong_sizes_and_unknown_regions_are_refused(server, regions) -> None:
    protocol, made = regions
    handle_out = made.create("out", NBYTES)
    made.create("in", NBYTES)
    client = made.client
    cases = {
        "runs past the end": {"in_offset": 4},  # offset + size past the region
        "needs": {"in_size": NBYTES - 4},  # the input's bytes do not match its shape
        "runs past the end ": {"out_offset": 8},
        "should be at least": {"out_size": NBYTES - 4},  # too small for the result
    }
    for words, sizes in cases.items():
        error = _error(_shm_infer, client, protocol, "in", "out", **sizes)
        assert words.strip() in error.message(), (sizes, error.message())
        if protocol == "grpc":
            assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "unable to find" in _error(_shm_infer, client, protocol, "nope", "out").message()
    # a tensor over --max-body-bytes is refused before anything is copied
    made.create("huge", 5 * NBYTES)
    error = _error(_shm_infer, client, protocol, "huge", "out", in_size=5 * NBYTES)
    assert "over --max-body-bytes" in error.message()
    assert "unable to find" in _error(_shm_infer, client, protocol, "in", "nope").message()
    # nothing was written into the output region by any refused request
    assert not shm.get_contents_as_numpy(handle_out, np.float32, list(SHAPE)).any()


def test_an_object_shrunk_after_registering_is_refused_not_read(server, regions) -> None:
    """The client truncates its object below the registered size: requests get a 400 naming the
    region (reading the mapping past the object's end would fault the server)."""
    protocol, made = regions
    made.create("in", NBYTES)
    made.create("out", NBYTES)
    os.truncate(f"/dev/shm/mha-test-{os.getpid()}-in", NBYTES // 2)
    error = _error(_shm_infer, made.client, protocol, "in", "out")
    assert "is now smaller than the" in error.message(), error.message()
    assert made.client.is_server_live()


def test_registration_is_checked(server, regions) -> None:
    protocol, made = regions
    client = made.client
    made.create("taken", NBYTES)
    key = f"/mha-test-{os.getpid()}-taken"
    error = _error(client.register_system_shared_memory, "taken", key, NBYTES)
    assert "already registered" in error.message()
    if protocol == "grpc":
        assert error.status() == "StatusCode.ALREADY_EXISTS"
    too_big = _error(client.register_system_shared_memory, "big", key, NBYTES + 1)
    assert "runs past its end" in too_big.message()
    for bad_key in ("/../etc/passwd", "/a/b", "/"):
        bad = _error(client.register_system_shared_memory, "bad", bad_key, 8)
        assert "not a POSIX shared-memory name" in bad.message()
    missing = _error(client.register_system_shared_memory, "gone", "/mha-no-such-object", 8)
    assert "no such object" in missing.message()
    assert (
        "byte_size must be positive"
        in _error(client.register_system_shared_memory, "empty", key, 0).message()
    )


def test_cuda_shared_memory_is_not_supported(server) -> None:
    http = thttp.InferenceServerClient(server.http.address)
    grpc_client = server.client()
    error = _error(http.register_cuda_shared_memory, "cuda", base64.b64encode(b"handle"), 0, 64)
    assert "GPUs not supported" in error.message() and error.status() == "400"
    error = _error(
        grpc_client.register_cuda_shared_memory, "cuda", base64.b64encode(b"handle"), 0, 64
    )
    assert error.status() == "StatusCode.INVALID_ARGUMENT" and "'cuda'" in error.message()
    assert http.get_cuda_shared_memory_status() == []
    assert not grpc_client.get_cuda_shared_memory_status().regions
    http.unregister_cuda_shared_memory()
    grpc_client.unregister_cuda_shared_memory()


def test_metadata_lists_system_shared_memory(server) -> None:
    http = thttp.InferenceServerClient(server.http.address)
    assert "system_shared_memory" in http.get_server_metadata()["extensions"]
    assert "system_shared_memory" in server.client().get_server_metadata().extensions
    assert "cuda_shared_memory" not in http.get_server_metadata()["extensions"]


def test_unregister_while_requests_use_the_region(server, module) -> None:
    """Requests racing an unregister each either finish with the right answer or are refused
    naming the region; none fails otherwise, and the server goes on serving."""
    client = server.client()  # gRPC's is thread-safe; the region is unregistered over HTTP
    made = Regions(thttp.InferenceServerClient(server.http.address))
    try:
        x = rng_input(3, *SHAPE)
        handle_in = made.create("busy", NBYTES)
        shm.set_shared_memory_region(handle_in, [x])
        want = expected(module, x).numpy()

        def one(_: int) -> str:
            item = tgrpc.InferInput("input", list(SHAPE), "FP32")
            item.set_shared_memory("busy", NBYTES)
            try:
                got = client.infer(NAME, [item]).as_numpy("output")
            except InferenceServerException as exc:
                assert "unable to find shared memory region: 'busy'" in exc.message()
                return "refused"
            np.testing.assert_allclose(got, want, **FP32_TOL)
            return "answered"

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            first = list(pool.map(one, range(8)))
            racing = [pool.submit(one, i) for i in range(32)]
            made.client.unregister_system_shared_memory("busy")
            outcomes = [f.result() for f in racing]
        assert first == ["answered"] * 8
        assert set(outcomes) <= {"answered", "refused"}
        assert one(0) == "refused"  # once unregistered, a new request cannot find it
        assert made.client.get_system_shared_memory_status() == []
        assert "Traceback" not in server.http.log()
    finally:
        made.close()


def test_a_lease_outlives_unregister_and_the_last_one_unmaps(tmp_path) -> None:
    """The registry itself: a region unregistered while leased stays readable by the lease
    holder, is gone for everyone else, and is unmapped when the lease ends."""
    handle = shm.create_shared_memory_region("unit", f"/mha-unit-{os.getpid()}", 64)
    try:
        shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.float32)])
        regions = ServerRegions(max_regions=2, max_bytes=128)
        regions.register("unit", f"/mha-unit-{os.getpid()}", 0, 64)
        lease = regions.acquire("unit")
        regions.unregister("unit")
        assert regions.status() == []
        with pytest.raises(Exception, match="unable to find"):
            regions.acquire("unit")
        data = np.frombuffer(lease.view(0, 64), np.float32).copy()
        np.testing.assert_array_equal(data, np.arange(16, dtype=np.float32))
        assert not lease.mapping.closed
        regions.release(lease)
        assert lease.mapping.closed
    finally:
        shm.destroy_shared_memory_region(handle)


def test_the_bounds_on_regions(tmp_path) -> None:
    handles = [shm.create_shared_memory_region(f"b{i}", f"/mha-b{i}-{os.getpid()}", 64)
               for i in range(3)]  # fmt: skip
    try:
        regions = ServerRegions(max_regions=2, max_bytes=100)
        regions.register("b0", f"/mha-b0-{os.getpid()}", 0, 64)
        with pytest.raises(Exception, match="--shm-max-bytes"):
            regions.register("b1", f"/mha-b1-{os.getpid()}", 0, 64)
        regions.register("b1", f"/mha-b1-{os.getpid()}", 0, 32)
        with pytest.raises(Exception, match="--shm-max-regions"):
            regions.register("b2", f"/mha-b2-{os.getpid()}", 0, 4)
        regions.close()
        assert regions.status() == []
    finally:
        for handle in handles:
            shm.destroy_shared_memory_region(handle)


def test_not_offered_with_several_front_ends_or_turned_off() -> None:
    assert unavailable(Settings(workers=2)) is not None
    assert unavailable(Settings(shm_max_regions=0)) is not None
    assert unavailable(Settings()) is None


def test_cross_attention_mixes_shared_memory_and_raw_inputs(tmp_path) -> None:
    """gRPC: `input` in shared memory, `key` and `value` in raw_input_contents (one entry per
    input not in shared memory, in order) against PyTorch's own module."""
    torch.manual_seed(0)
    module = nn.MultiheadAttention(EMBED_DIM, 4, kdim=24, vdim=20, batch_first=True).eval()
    q, k, v = rng_input(20, 2, 5, EMBED_DIM), rng_input(21, 2, 7, 24), rng_input(22, 2, 7, 20)
    with serving(tmp_path, module, "--max-seq-len", "64") as cross:
        client = cross.client()
        made = Regions(client)
        try:
            shm.set_shared_memory_region(made.create("q", q.nbytes), [q])
            query = tgrpc.InferInput("input", list(q.shape), "FP32")
            query.set_shared_memory("q", q.nbytes)
            tensors = [query]
            for name, x in (("key", k), ("value", v)):
                tensors.append(tgrpc.InferInput(name, list(x.shape), "FP32"))
                tensors[-1].set_data_from_numpy(x)
            got = client.infer(NAME, tensors).as_numpy("output")
        finally:
            made.close()
    want = module(*(torch.from_numpy(t) for t in (q, k, v)), need_weights=False)[0]
    np.testing.assert_allclose(got, want.detach().numpy(), **FP32_TOL)
