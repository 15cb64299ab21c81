"""Triton's CUDA shared memory against a real `mha-serve --device cuda`, with the unmodified
tritonclient (HTTP and gRPC) and tritonclient.utils.cuda_shared_memory: the client cudaMallocs
its regions and registers their IPC handles; inputs are read from and outputs written into them
(checked against nn.MultiheadAttention on the same GPU), out-of-bounds offsets and a byte_size
past the allocation are refused, and regions unregistered while requests use them stay valid
for those requests.

Skipped, saying why, without a CUDA GPU or without cuda-python (tritonclient's CUDA module
needs it and libcudart at import, so it is imported inside the tests). Unverified on a GPU (no
GPU this session): the first GPU run is this file's first real run.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import mha_engine
from tests.support import Server, free_port, run_server

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
E, H = 64, 4
SHAPE = (2, 8, E)
NBYTES = int(np.prod(SHAPE)) * 4
PAD = 64  # bytes before the input in its region: a non-zero offset
TOL = {"atol": 1e-5, "rtol": 1.3e-6}  # fp32 on both sides (TF32 off for both)


def _cudashm():
    try:
        import tritonclient.utils.cuda_shared_memory as cudashm
    except (ImportError, RuntimeError) as exc:  # RuntimeError: cuda-python missing
        pytest.skip(f"tritonclient.utils.cuda_shared_memory unavailable: {exc}")
    return cudashm


@pytest.fixture(scope="module")
def served(module, tmp_path_factory) -> Iterator[tuple[Server, int]]:
    tmp = tmp_path_factory.mktemp("gpu-cudashm")
    mha_engine.save_model(module, tmp / "attn")
    grpc_port = free_port()
    args = ["--model-dir", str(tmp / "attn"), "--device", "cuda", "--dtype", "float32"]
    with run_server(tmp, *args, "--grpc-port", str(grpc_port)) as server:
        yield server, grpc_port


def _client(served, protocol: str):
    server, grpc_port = served
    if protocol == "http":
        import tritonclient.http as thttp

        return thttp, thttp.InferenceServerClient(f"127.0.0.1:{server.port}")
    import tritonclient.grpc as tgrpc

    return tgrpc, tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")


def _reference(module, x: np.ndarray) -> np.ndarray:
    copy = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    copy.load_state_dict(module.state_dict())
    copy = copy.cuda()
    xt = torch.from_numpy(x).cuda()
    with torch.no_grad():
        return copy(xt, xt, xt, need_weights=False)[0].cpu().numpy()


def _infer(lib, client, in_region: str, out_region: str | None, offset: int = PAD):
    item = lib.InferInput("input", list(SHAPE), "FP32")
    item.set_shared_memory(in_region, NBYTES, offset=offset)
    outputs = None
    if out_region is not None:
        output = lib.InferRequestedOutput("output")
        output.set_shared_memory(out_region, NBYTES)
        outputs = [output]
    return client.infer("attn", [item], outputs=outputs)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cuda_regions_with_the_unmodified_client(served, module, protocol) -> None:
    from tritonclient.utils import InferenceServerException

    cudashm = _cudashm()
    lib, client = _client(served, protocol)
    assert "cuda_shared_memory" in _extensions(client, protocol)
    x = np.random.default_rng(7).standard_normal(SHAPE).astype(np.float32)
    want = _reference(module, x)
    handle_in = cudashm.create_shared_memory_region(f"in-{protocol}", PAD + NBYTES, 0)
    handle_out = cudashm.create_shared_memory_region(f"out-{protocol}", NBYTES, 0)
    try:
        cudashm.set_shared_memory_region(handle_in, [np.zeros(PAD // 4, np.float32), x])
        client.register_cuda_shared_memory("in", cudashm.get_raw_handle(handle_in), 0, PAD + NBYTES)
        client.register_cuda_shared_memory("out", cudashm.get_raw_handle(handle_out), 0, NBYTES)
        status = client.get_cuda_shared_memory_status()
        if protocol == "http":
            assert {"name": "in", "device_id": 0, "byte_size": PAD + NBYTES} in status
        else:
            assert status.regions["in"].byte_size == PAD + NBYTES

        _infer(lib, client, "in", "out")
        got = cudashm.get_contents_as_numpy(handle_out, np.float32, list(SHAPE))
        np.testing.assert_allclose(got, want, **TOL)
        answered = _infer(lib, client, "in", None).as_numpy("output")  # output in the answer
        np.testing.assert_allclose(answered, want, **TOL)

        with pytest.raises(InferenceServerException, match="runs past the end of region 'in'"):
            _infer(lib, client, "in", "out", offset=PAD + 4)
        with pytest.raises(InferenceServerException, match="more than the"):
            big = 64 * 1024 * 1024  # far past the allocation, whatever cudaMalloc rounded to
            client.register_cuda_shared_memory("big", cudashm.get_raw_handle(handle_in), 0, big)
        _infer(lib, client, "in", "out")  # the server still serves after the refusals
    finally:
        client.unregister_cuda_shared_memory()
        cudashm.destroy_shared_memory_region(handle_in)
        cudashm.destroy_shared_memory_region(handle_out)
    status = client.get_cuda_shared_memory_status()
    assert (status == []) if protocol == "http" else not status.regions
    assert "Traceback" not in served[0].log()


def _extensions(client, protocol: str) -> list[str]:
    meta = client.get_server_metadata()
    return meta["extensions"] if protocol == "http" else list(meta.extensions)


def test_unregister_while_requests_use_a_region(served, module) -> None:
    """Requests racing an unregister each finish with the right answer or are refused naming the
    region; the server goes on serving (the handle is closed after its last request)."""
    from tritonclient.utils import InferenceServerException

    cudashm = _cudashm()
    tgrpc, client = _client(served, "grpc")
    _, http = _client(served, "http")
    x = np.random.default_rng(8).standard_normal(SHAPE).astype(np.float32)
    want = _reference(module, x)
    handle = cudashm.create_shared_memory_region("busy", PAD + NBYTES, 0)
    try:
        cudashm.set_shared_memory_region(handle, [np.zeros(PAD // 4, np.float32), x])
        http.register_cuda_shared_memory("busy", cudashm.get_raw_handle(handle), 0, PAD + NBYTES)

        def one(_: int) -> str:
            try:
                got = _infer(tgrpc, client, "busy", None).as_numpy("output")
            except InferenceServerException as exc:
                assert "unable to find shared memory region: 'busy'" in exc.message()
                return "refused"
            np.testing.assert_allclose(got, want, **TOL)
            return "answered"

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            first = list(pool.map(one, range(8)))
            racing = [pool.submit(one, i) for i in range(32)]
            http.unregister_cuda_shared_memory("busy")
            outcomes = [f.result() for f in racing]
        assert first == ["answered"] * 8
        assert set(outcomes) <= {"answered", "refused"}
        assert one(0) == "refused"
        # registered again from the same handle: opened afresh, answers again
        http.register_cuda_shared_memory("busy", cudashm.get_raw_handle(handle), 0, PAD + NBYTES)
        assert one(0) == "answered"
    finally:
        http.unregister_cuda_shared_memory()
        cudashm.destroy_shared_memory_region(handle)
    assert "Traceback" not in served[0].log()
