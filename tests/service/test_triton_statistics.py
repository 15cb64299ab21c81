"""Triton's statistics extension as its consumers read it, on a real server over HTTP and gRPC.

Under concurrent load with failures mixed in, every snapshot (HTTP /v2/models/{m}/stats and gRPC
ModelStatistics, sampled many times while requests run over both protocols) has success ==
queue == compute_input == compute_infer == compute_output; failed requests count in `fail` only.

Triton's own benchmark tool, perf_analyzer, needs exactly that: it aborts ("Server side
statistics compute counts must be the same") when they differ. It runs here over HTTP and gRPC
and must end with rc 0 and a throughput line. PyPI's perf-analyzer wheels need a newer glibc than
Debian 12, but the tritonclient==2.46.0 wheel ships a perf_analyzer binary that runs with
Debian's libb64-0d and the nvidia-cuda-runtime-cu12 wheel's libcudart. The test fetches them
with pip and apt-get (no root needed: `apt-get download` + `dpkg-deb -x`), caches them under the
temp dir keyed by version, and skips, saying why, where it cannot."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from torch import nn
from tritonclient.utils import InferenceServerException

import mha_engine
from tests.support import Server, free_port, run_server, wait_for

NAME = "attn"
EMBED_DIM = 32
EXECUTED = ("success", "queue", "compute_input", "compute_infer", "compute_output")
SAMPLES = 60  # snapshots taken while the load runs
MIN_REQUESTS = 24  # per load thread, at least (it goes on until the sampler is done)
BAD_EVERY = 4  # one request in four fails validation (wrong embed_dim)
TRITONCLIENT = "2.46.0"  # its perf_analyzer runs on Debian 12's glibc 2.36
CUDA_RUNTIME = "12.9.79"  # any libcudart.so.12 does: perf_analyzer only links it
CACHE = Path(tempfile.gettempdir()) / f"mha-serve-perf-analyzer-{TRITONCLIENT}-{CUDA_RUNTIME}"
THROUGHPUT = re.compile(r"Concurrency: \d+, throughput: ([\d.]+) infer/sec")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    """A self-attention model (key, value and key_padding_mask optional) over HTTP and gRPC."""
    torch.manual_seed(0)
    model_dir = tmp_path_factory.mktemp("stats") / NAME
    mha_engine.save_model(nn.MultiheadAttention(EMBED_DIM, 4, batch_first=True).eval(), model_dir)
    port = free_port()
    args = ("--model-dir", str(model_dir), "--grpc-port", str(port))
    with run_server(model_dir.parent, *args) as http:
        yield http, f"127.0.0.1:{port}"


def http_counts(server: Server) -> dict[str, int]:
    body = httpx.get(f"{server.url}/v2/models/{NAME}/stats", timeout=30).json()
    (stats,) = body["model_stats"]
    return {kind: int(d["count"]) for kind, d in stats["inference_stats"].items()}


def grpc_counts(client: tgrpc.InferenceServerClient) -> dict[str, int]:
    (stats,) = client.get_inference_statistics(NAME).model_stats  # the message: zeros kept
    inference = stats.inference_stats
    kinds = (*EXECUTED, "fail", "cache_hit", "cache_miss")
    return {kind: getattr(inference, kind).count for kind in kinds}


class Load:
    """Requests over one protocol, every BAD_EVERY-th with the wrong embed_dim, until `stop` is
    set and at least MIN_REQUESTS were sent; counts what was answered and how."""

    def __init__(self, module, address: str, stop: threading.Event) -> None:
        self.module, self.address, self.stop = module, address, stop
        self.good = self.bad = 0
        self.unexpected: list[str] = []
        self.thread = threading.Thread(target=self.run)

    def item(self, embed_dim: int):
        x = np.full((1, 6, embed_dim), 0.25, np.float32)
        item = self.module.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        return item

    def run(self) -> None:
        client = self.module.InferenceServerClient(self.address)
        good, bad = self.item(EMBED_DIM), self.item(EMBED_DIM + 1)
        sent = 0
        while sent < MIN_REQUESTS or not self.stop.is_set():
            failing = sent % BAD_EVERY == BAD_EVERY - 1
            sent += 1
            try:
                result = client.infer(NAME, [bad if failing else good])
            except InferenceServerException as exc:
                if failing and exc.status() in ("400", "StatusCode.INVALID_ARGUMENT"):
                    self.bad += 1
                else:
                    self.unexpected.append(f"{exc.status()}: {exc.message()}")
                continue
            if failing or result.as_numpy("output").shape != (1, 6, EMBED_DIM):
                self.unexpected.append(f"request {sent} (bad: {failing}) answered 200")
            else:
                self.good += 1


def test_counts_agree_in_every_snapshot_under_load(server) -> None:
    http, address = server
    client = tgrpc.InferenceServerClient(address)
    before = http_counts(http)
    assert grpc_counts(client) == before
    stop = threading.Event()
    loads = [Load(module, a, stop) for module, a in ((thttp, http.address), (tgrpc, address)) * 2]
    for load in loads:
        load.thread.start()
    snapshots = []
    try:
        for i in range(SAMPLES):
            snapshots.append(http_counts(http) if i % 2 else grpc_counts(client))
    finally:
        stop.set()
        for load in loads:
            load.thread.join(120)
    assert not any(load.thread.is_alive() for load in loads)
    assert [u for load in loads for u in load.unexpected] == []

    differing = [s for s in snapshots if len({s[kind] for kind in EXECUTED}) != 1]
    assert differing == [], (
        f"{len(differing)} of {len(snapshots)} snapshots differ: {differing[:3]}"
    )
    good, bad = sum(load.good for load in loads), sum(load.bad for load in loads)
    assert good > 0 and bad > 0
    want = {kind: before[kind] + good for kind in EXECUTED} | {"fail": before["fail"] + bad}
    want |= {"cache_hit": 0, "cache_miss": 0}  # no --response-cache-bytes
    # a request's statistics may land just after its answer is sent
    wait_for(lambda: http_counts(http) == want, f"HTTP statistics counts {want}")
    assert grpc_counts(client) == want


# -- perf_analyzer: installed once, cached --------------------------------------------------------
def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _libb64(work: Path, lib: Path) -> str | None:
    """Put libb64.so.0d in `lib` unless the system has it; the reason when neither works."""
    found = _run(["/sbin/ldconfig", "-p"], work) if Path("/sbin/ldconfig").exists() else None
    if found is not None and "libb64.so.0d" in found.stdout:
        return None
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        return "libb64.so.0d is missing and there is no apt-get/dpkg-deb to fetch libb64-0d"
    got = _run(["apt-get", "download", "libb64-0d"], work)
    debs = list(work.glob("libb64-0d_*.deb"))
    if got.returncode != 0 or not debs:
        return f"`apt-get download libb64-0d` failed: {_last_line(got.stderr)}"
    extracted = work / "deb"
    _run(["dpkg-deb", "-x", str(debs[0]), str(extracted)], work)
    libs = list(extracted.rglob("libb64.so.0d"))
    if not libs:
        return "libb64-0d's package holds no libb64.so.0d"
    shutil.copy2(libs[0], lib / "libb64.so.0d")
    return None


def _install(target: Path) -> str | None:
    """perf_analyzer into target/bin, its libraries into target/lib; the reason when it cannot."""
    work = Path(tempfile.mkdtemp(prefix="perf-analyzer-", dir=target.parent))
    try:
        bin_dir, lib = work / "out" / "bin", work / "out" / "lib"
        bin_dir.mkdir(parents=True)
        lib.mkdir()
        wheels = [f"tritonclient=={TRITONCLIENT}", f"nvidia-cuda-runtime-cu12=={CUDA_RUNTIME}"]
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work)]
        got = _run([*pip, "--retries", "1", "--timeout", "30", *wheels], work)
        if got.returncode != 0:
            return f"`pip download {' '.join(wheels)}` failed: {_last_line(got.stderr)}"
        members = {"/bin/perf_analyzer": bin_dir, "/lib/libcudart.so.12": lib}
        for wheel in work.glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    for suffix, into in members.items():
                        if name.endswith(suffix):
                            (into / Path(name).name).write_bytes(archive.read(name))
        binary = bin_dir / "perf_analyzer"
        if not binary.exists() or not (lib / "libcudart.so.12").exists():
            return "the wheels hold no perf_analyzer or libcudart.so.12"
        binary.chmod(0o755)
        reason = _libb64(work, lib)
        if reason:
            return reason
        try:
            (work / "out").rename(target)  # atomic: a half-made cache is never used
        except OSError:
            if not target.exists():
                raise
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _env(root: Path) -> dict[str, str]:
    paths = [str(root / "lib"), os.environ.get("LD_LIBRARY_PATH", "")]
    return {**os.environ, "LD_LIBRARY_PATH": ":".join(p for p in paths if p)}


@pytest.fixture(scope="module")
def perf_analyzer() -> tuple[Path, dict[str, str]]:
    """The cached perf_analyzer and the environment it runs in (installed on first use)."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("tritonclient's perf_analyzer binary is for Linux x86_64 only")
    if not CACHE.exists():
        try:
            reason = _install(CACHE)
        except (OSError, subprocess.TimeoutExpired) as exc:
            reason = f"installing perf_analyzer failed: {exc!r}"
        if reason:
            pytest.skip(reason)
    binary, env = CACHE / "bin" / "perf_analyzer", _env(CACHE)
    version = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, env=env, timeout=60
    )
    if version.returncode != 0:
        pytest.skip(f"perf_analyzer does not run here: {(version.stdout + version.stderr)[-500:]}")
    return binary, env


@pytest.fixture(scope="module")
def input_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """perf_analyzer's --input-data: `input` only, so the optional inputs are left out (with
    none given it would make up key, value and a mask of its own)."""
    path = tmp_path_factory.mktemp("perf-data") / "data.json"
    rows = [
        {"input": {"content": [((i * 7 + j) % 13) / 13 for j in range(8 * EMBED_DIM)],
                   "shape": [8, EMBED_DIM]}}
        for i in range(4)
    ]  # fmt: skip
    path.write_text(json.dumps({"data": rows}))
    return path


def measure(perf_analyzer: tuple[Path, dict[str, str]], url: str, *options: str) -> str:
    """Run perf_analyzer on NAME at `url` for a few bounded windows; its output, once it has
    ended with rc 0 and a throughput line."""
    binary, env = perf_analyzer
    cmd = [
        str(binary), "-m", NAME, "-u", url, *options,
        "--concurrency-range", "4",
        "--measurement-interval", "1000",  # ms per window
        "--max-trials", "4",
        "--stability-percentage", "1000",  # a shared machine is never stable; counts are what count
    ]  # fmt: skip
    got = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    output = got.stdout + got.stderr
    assert got.returncode == 0, output[-3000:]
    match = THROUGHPUT.search(output)
    assert match and float(match.group(1)) > 0, output[-3000:]
    return output


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_the_server(perf_analyzer, server, input_data, protocol):
    http, address = server
    url = http.address if protocol == "http" else address
    measure(perf_analyzer, url, "-i", protocol, "--input-data", str(input_data))
    assert "Traceback" not in http.log()
