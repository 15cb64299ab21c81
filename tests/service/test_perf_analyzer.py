"""Triton's own benchmark tool, perf_analyzer, against a real server over HTTP and gRPC: it ends
with rc 0 and a throughput line. perf_analyzer checks the server's statistics as it measures
and aborts ("Server side statistics compute counts must be the same") when success,
compute_input, compute_infer and compute_output disagree.

PyPI's perf-analyzer wheels need a newer glibc than Debian 12, but the tritonclient==2.46.0 wheel
ships a perf_analyzer binary that runs with Debian's libb64-0d and the nvidia-cuda-runtime-cu12
wheel's libcudart. The test fetches them with pip and apt-get (no root needed: `apt-get download`
+ `dpkg-deb -x`), caches them under the temp dir keyed by version, and skips, saying why, where
it cannot."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import mha_engine
from tests.support import Server, free_port, run_server

TRITONCLIENT = "2.46.0"  # the last wheel whose perf_analyzer runs on glibc 2.36
CUDA_RUNTIME = "12.9.79"  # any libcudart.so.12 does: perf_analyzer only links it
CACHE = Path(tempfile.gettempdir()) / f"mha-serve-perf-analyzer-{TRITONCLIENT}-{CUDA_RUNTIME}"
NAME = "attn"
EMBED_DIM = 64
THROUGHPUT = re.compile(r"Concurrency: \d+, throughput: ([\d.]+) infer/sec")


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
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int]]:
    """A self-attention model (key, value and key_padding_mask optional) over HTTP and gRPC."""
    torch.manual_seed(0)
    model_dir = tmp_path_factory.mktemp("perf") / NAME
    mha_engine.save_model(nn.MultiheadAttention(EMBED_DIM, 4, batch_first=True).eval(), model_dir)
    grpc_port = free_port()
    args = ("--model-dir", str(model_dir), "--grpc-port", str(grpc_port))
    with run_server(model_dir.parent, *args) as http:
        yield http, grpc_port


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


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_the_server(perf_analyzer, server, input_data, protocol):
    binary, env = perf_analyzer
    http, grpc_port = server
    url = http.address if protocol == "http" else f"127.0.0.1:{grpc_port}"
    cmd = [
        str(binary), "-m", NAME, "-u", url, "-i", protocol,
        "--input-data", str(input_data),
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
    assert "Traceback" not in http.log()
