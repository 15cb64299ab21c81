"""The Docker image, built from the Dockerfile's CPU target and run by a real Docker engine.

The build uses a local Debian base (deploy/ci/docker.sh) for python:3.11-slim and the local CPU
torch wheel (pip's find-links directory, served on loopback): build arguments only, the
Dockerfile is the one users build. The containers publish on 127.0.0.1 only. The CUDA variant
is not built here (its nvidia/cuda base cannot be pulled; it is hadolint-checked only).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

import mha_engine
from benchmarks import scrape
from tests.deploy.docker import Built, Container, docker, run_container
from tests.service.test_embeddings import minilm_dir, reference  # noqa: F401 (a fixture)
from tests.support import fp32_request

UID = "10001"
PUBLISH = ("-p", "127.0.0.1::8000", "-p", "127.0.0.1::8001")
# One torch thread: the machine's cores are shared with the test process.
THREADS = ("-e", "OMP_NUM_THREADS=1")
MAX_IMAGE_BYTES = 2_000_000_000  # ~1.3 GB measured (torch's CPU wheel is most of it)
TOLERANCE = {"atol": 1e-5, "rtol": 1.3e-6}  # fp32, the same torch build as the test process


@pytest.fixture(scope="module")
def demo(built_image: Built) -> Iterator[tuple[Container, str, str]]:
    """The image as `docker run` starts it: the built-in demo model, HTTP and gRPC."""
    with run_container(built_image.tag, *PUBLISH, *THREADS) as container:
        url = f"http://127.0.0.1:{container.port(8000)}"
        container.wait_ready(url)
        yield container, url, f"127.0.0.1:{container.port(8001)}"


def test_image_size(built_image: Built, record_property) -> None:
    record_property("image_bytes", built_image.size_bytes)
    record_property("build_seconds", round(built_image.seconds))
    assert 0 < built_image.size_bytes < MAX_IMAGE_BYTES, built_image


def test_runs_as_the_non_root_user(demo) -> None:
    container, _, _ = demo
    assert container.inspect("{{.Config.User}}") == f"{UID}:{UID}"
    status = docker("exec", container.name, "cat", "/proc/1/status").stdout
    uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    assert uids == [UID] * 4, status  # real, effective, saved, filesystem
    cmdline = docker("exec", container.name, "cat", "/proc/1/cmdline").stdout
    assert "mha-serve" in cmdline, "mha-serve is PID 1 (it gets SIGTERM itself)"


def test_the_engines_c_kernels_are_prebuilt(demo) -> None:
    """The runtime image has no C compiler; the build stage prebuilt the kernels
    (tools/build_kernels.py) and the engine loads the one for this CPU."""
    container, _, _ = demo
    compilers = docker("exec", container.name, "sh", "-c", "command -v cc gcc", check=False)
    assert compilers.stdout == "", compilers.stdout
    code = (
        "from mha_engine import cpu_varlen, int8_rows; "
        "print(cpu_varlen.kernel_status()); print(int8_rows.kernel_status())"
    )
    statuses = docker("exec", container.name, "python", "-c", code).stdout.splitlines()
    assert len(statuses) == 2 and all(s.startswith("prebuilt (") for s in statuses), statuses


def test_tritonclient_over_http_and_grpc(demo) -> None:
    _, url, grpc_address = demo
    x = np.random.default_rng(3).standard_normal((2, 16, 512), dtype=np.float32)  # (B, T, E)
    with torch.no_grad():
        expected = mha_engine.demo_module().eval()(torch.from_numpy(x)).numpy()
    for module, address in ((thttp, url.removeprefix("http://")), (tgrpc, grpc_address)):
        client = module.InferenceServerClient(address)
        assert client.is_server_ready() and client.is_model_ready("mha")
        item = module.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        got = client.infer("mha", [item]).as_numpy("output")
        np.testing.assert_allclose(got, expected, **TOLERANCE)
        client.close()


def test_healthcheck_turns_healthy(demo) -> None:
    """The image's own HEALTHCHECK (every 10 s), as Docker runs it."""
    container, _, _ = demo
    deadline = time.monotonic() + 90
    while (status := container.inspect("{{.State.Health.Status}}")) == "starting":
        assert time.monotonic() < deadline, "health check still starting after 90 s"
        time.sleep(1)
    assert status == "healthy", container.inspect("{{json .State.Health}}")


def test_minilm_volume_serves_embeddings_with_openai(built_image: Built, reference) -> None:  # noqa: F811
    openai = pytest.importorskip("openai")
    name = "all-MiniLM-L6-v2"
    options = (
        *PUBLISH, *THREADS, "-v", f"{minilm_dir()}:/models/minilm:ro",
        "-e", "MHA_MODEL_DIR=/models/minilm", "-e", f"MHA_MODEL_NAME={name}",
    )  # fmt: skip
    with run_container(built_image.tag, *options) as container:
        url = f"http://127.0.0.1:{container.port(8000)}"
        container.wait_ready(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        texts = ["This is an example sentence", "Each sentence is converted"]
        response = client.embeddings.create(model=name, input=texts)
    got = np.asarray([d.embedding for d in response.data], dtype=np.float32)
    want, lengths = reference(texts)
    assert got.shape == (2, 384) and response.usage.prompt_tokens == sum(lengths)
    cosine = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cosine.min() >= 0.99999, cosine


def test_sigterm_drains_accepted_requests_and_exits_0(built_image: Built) -> None:
    """`docker stop` (SIGTERM) while requests wait in the queue: each is answered 200 with the
    right numbers, then the process exits 0. A long batch delay holds the requests queued, so
    they are all accepted before the signal, whatever the machine's speed."""
    requests = 6
    hold = ("-e", "MHA_MAX_BATCH_DELAY_MS=20000", "-e", "MHA_MAX_BATCH_SIZE=64")
    module = mha_engine.demo_module().eval()
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal((1, 8, 512), dtype=np.float32) for _ in range(requests)]
    results: list[object] = [None] * requests
    with run_container(built_image.tag, *PUBLISH, *THREADS, *hold) as container:
        url = f"http://127.0.0.1:{container.port(8000)}"
        container.wait_ready(url)

        def send(i: int) -> None:
            body, headers = fp32_request(inputs[i])
            try:
                results[i] = httpx.post(
                    f"{url}/v2/models/mha/infer", content=body, headers=headers, timeout=90
                )
            except httpx.HTTPError as exc:
                results[i] = exc

        threads = [threading.Thread(target=send, args=(i,)) for i in range(requests)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 15  # well inside the batch delay (20 s) holding them
        while scrape.value(scrape.scrape(url), "mha_requests_in_flight", default=0) < requests:
            assert time.monotonic() < deadline, "the requests never all reached the server"
            time.sleep(0.1)
        docker("stop", "-t", "60", container.name, timeout=90)
        for thread in threads:
            thread.join(30)
        assert container.inspect("{{.State.ExitCode}}") == "0", container.logs()[-3000:]
        assert container.inspect("{{.State.OOMKilled}}") == "false"
        logs = container.logs()
    for x, result in zip(inputs, results, strict=True):
        assert isinstance(result, httpx.Response) and result.status_code == 200, (result, logs)
        header_length = int(result.headers["Inference-Header-Content-Length"])
        got = np.frombuffer(result.content[header_length:], dtype=np.float32).reshape(x.shape)
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got, want, **TOLERANCE)
