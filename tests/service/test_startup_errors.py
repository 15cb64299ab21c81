"""Start-up failures an operator meets, on real `mha-serve` processes: each ends with one line
naming the cause and the fix, a distinct exit status, and no traceback (unless
--log-level debug asks for it)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import mha_engine
from service.runtime.startup import (
    EXIT_CONFIG,
    EXIT_MODEL_DIR,
    EXIT_MODEL_LOAD,
    EXIT_PORT,
)
from tests.support import ROOT, free_port

PREFIX = "mha-serve: error: "


def start(*args: str) -> tuple[int, str, str]:
    """Run the server to its exit: (status, the error line, all output)."""
    result = subprocess.run(
        [sys.executable, "-m", "service", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(PREFIX)]
    assert len(errors) == 1, output[-3000:]  # exactly one line says why
    return result.returncode, errors[0].removeprefix(PREFIX), output


def one_line(status: int, want: int, output: str) -> None:
    assert status == want, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "Application startup failed" not in output, output[-3000:]
    assert "queued requests answered 503" not in output, output[-3000:]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model") / "attn"
    mha_engine.save_model(nn.MultiheadAttention(32, 4, batch_first=True), path)
    return path


def test_http_port_in_use_names_the_port_and_the_flag(taken_port: int) -> None:
    status, line, output = start("--port", str(taken_port), "--grpc-port", "0")
    one_line(status, EXIT_PORT, output)
    assert f"HTTP port {taken_port} is already in use" in line and "--port" in line, line
    assert "--grpc-port" not in line
    # checked before the model loads: nothing else happened, nothing else is printed
    assert output.strip().splitlines() == [PREFIX + line], output


def test_http_port_in_use_with_workers(taken_port: int) -> None:
    """--workers: the supervisor binds the port, with the same one line."""
    status, line, output = start("--workers", "2", "--port", str(taken_port))
    one_line(status, EXIT_PORT, output)
    assert f"HTTP port {taken_port} is already in use" in line, line


def test_grpc_port_in_use_names_the_port_and_the_flag(taken_port: int) -> None:
    status, line, output = start("--port", str(free_port()), "--grpc-port", str(taken_port))
    one_line(status, EXIT_PORT, output)
    assert f"gRPC port {taken_port} is already in use" in line, line
    assert "--grpc-port / MHA_GRPC_PORT" in line, line


def test_missing_model_directory_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    status, line, output = start("--model-dir", str(missing), "--port", str(free_port()))
    one_line(status, EXIT_MODEL_DIR, output)
    assert f"--model-dir / MHA_MODEL_DIR {missing} does not exist" in line, line


@pytest.mark.parametrize(
    ("config", "says"),
    [(None, "has no config.json"), ("{", "has a config.json that is not valid JSON")],
)
def test_a_directory_that_is_not_a_model_names_the_file(tmp_path: Path, config, says) -> None:
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    status, line, output = start("--model-dir", str(tmp_path), "--port", str(free_port()))
    one_line(status, EXIT_MODEL_DIR, output)
    assert f"{tmp_path} {says}" in line, line


def test_a_model_that_fails_to_load_names_model_and_file(model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    args = ("--model-dir", str(broken), "--port", str(free_port()), "--grpc-port", "0")
    status, line, output = start(*args)
    one_line(status, EXIT_MODEL_LOAD, output)
    assert line.startswith(f"model 'broken' at {broken} failed to load"), line
    assert f"{broken / 'model.safetensors'} is not a valid safetensors file" in line, line

    status, line_debug, output = start(*args, "--log-level", "debug")
    assert status == EXIT_MODEL_LOAD and line_debug == line
    assert "Traceback" in output, "--log-level debug shows where it failed"


def test_each_kind_of_failure_has_its_own_status() -> None:
    codes = {EXIT_CONFIG, EXIT_PORT, EXIT_MODEL_DIR, EXIT_MODEL_LOAD}
    assert len(codes) == 4 and 0 not in codes and 1 not in codes
    status, line, output = start("--port", "-1")  # a bad flag value: the configuration's
    assert status == EXIT_CONFIG and "--port" in line, output[-2000:]


def test_a_good_start_is_unaffected(model_dir: Path) -> None:
    """The same checks pass on a good directory and free ports: the server serves."""
    from tests.support import run_server

    with run_server(model_dir.parent, "--model-dir", str(model_dir)) as server:
        assert server.metric("mha_ready", model="attn") == 1
