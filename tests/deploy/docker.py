"""A real Docker engine for tests/deploy: the CLI, the image build, containers that clean up.

deploy/ci/docker.sh (run by .ci/run, as root) installs Debian's docker.io, starts dockerd and
makes the local base images. Without a daemon these tests skip, saying why, unless
MHA_REQUIRE_DOCKER=1 (set by .ci/run once docker.sh succeeded): then a missing daemon fails.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT

BASE_IMAGE = os.environ.get("MHA_BASE_IMAGE", "mha-serve-ci/python:3.11-bookworm")
IMAGE = "mha-serve:cpu"  # the tag docker-compose.yml runs
SETUP = "deploy/ci/docker.sh (as root; .ci/run runs it)"
# A fixed port for the local wheel server, so the build argument (and the layer cache) is the
# same from one run to the next; another free port is used if it is taken.
WHEELS_PORT = 38765


def _unavailable(reason: str) -> None:
    if os.environ.get("MHA_REQUIRE_DOCKER") == "1":
        pytest.fail(f"{reason} (MHA_REQUIRE_DOCKER=1: Docker was set up for this run)")
    pytest.skip(f"{reason}; run {SETUP}")


@functools.cache
def _daemon_error(cli: str) -> str | None:
    try:
        probe = subprocess.run([cli, "info"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]


def docker_cli() -> str:
    """Debian's docker client (BuildKit built in), or skip/fail when no daemon answers."""
    cli = os.environ.get("MHA_DOCKER") or (
        "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker")
    )
    if cli is None:
        _unavailable("no docker client installed")
    error = _daemon_error(cli)
    if error is not None:
        _unavailable(f"no Docker daemon answers: {error}")
    return cli


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """`docker ARGS`, text output captured; raises with stderr when `check` and it fails."""
    result = subprocess.run(
        [docker_cli(), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} -> {result.returncode}\n{result.stderr}")
    return result


def require_image(tag: str) -> None:
    if docker("image", "inspect", tag, check=False).returncode != 0:
        _unavailable(f"image {tag} missing")


def find_links_dir() -> Path | None:
    """pip's local find-links directory (`pip config`), where the CPU torch wheel lies."""
    configured = os.environ.get("MHA_TORCH_FIND_LINKS_DIR")
    if configured is None:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        configured = result.stdout.strip().split()[0] if result.returncode == 0 else ""
    path = Path(configured) if configured else None
    return path if path is not None and any(path.glob("torch-*.whl")) else None


@contextlib.contextmanager
def serve_directory(directory: Path) -> Iterator[str]:
    """The directory on a loopback HTTP server (a find-links page for pip in the build)."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass
class Built:
    tag: str
    seconds: float
    size_bytes: int


def build_image() -> Built:
    """The Dockerfile's CPU target on the local base, torch from the local find-links dir."""
    docker_cli()
    require_image(BASE_IMAGE)
    args = ["--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}", "--build-arg", "VARIANT=cpu"]
    wheels = find_links_dir()
    with contextlib.ExitStack() as stack:
        if wheels is not None:
            url = stack.enter_context(serve_directory(wheels))
            # PyPI for torch's own dependencies; the local +cpu wheel outranks PyPI's torch.
            args += ["--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple"]
            args += ["--build-arg", f"TORCH_FIND_LINKS={url}"]
        start = time.monotonic()
        result = subprocess.run(
            [docker_cli(), "build", "--network", "host", *args, "-t", IMAGE, "."],
            cwd=ROOT,
            env={**os.environ, "DOCKER_BUILDKIT": "1"},
            capture_output=True,
            text=True,
            timeout=1500,
        )
        seconds = time.monotonic() - start
    assert result.returncode == 0, f"docker build failed:\n{result.stderr[-6000:]}"
    size = int(docker("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    return Built(IMAGE, seconds, size)


@dataclass
class Container:
    name: str

    def inspect(self, template: str) -> str:
        return docker("inspect", "--format", template, self.name).stdout.strip()

    def port(self, container_port: int) -> int:
        """The loopback host port published for `container_port`."""
        out = docker("port", self.name, f"{container_port}/tcp").stdout.split()[0]
        return int(out.rsplit(":", 1)[1])

    def logs(self) -> str:
        result = docker("logs", self.name, check=False)
        return result.stdout + result.stderr

    def wait_ready(self, url: str, timeout: float = 180) -> None:
        """Poll GET /v2/health/ready until 200; fails with the container's log otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.inspect("{{.State.Running}}") != "true":
                pytest.fail(f"container {self.name} exited:\n{self.logs()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                    return
            time.sleep(0.5)
        pytest.fail(f"{self.name} not ready after {timeout:g} s:\n{self.logs()[-4000:]}")

    def wait_healthy(self, timeout: float = 180) -> None:
        """Until the image's HEALTHCHECK says healthy (it runs every 10 s)."""
        deadline = time.monotonic() + timeout
        while (status := self.inspect("{{.State.Health.Status}}")) != "healthy":
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name} is {status} after {timeout:g} s:\n{self.logs()[-4000:]}")
            time.sleep(1)


@contextlib.contextmanager
def run_container(image: str, *args: str, name_prefix: str = "mha-test") -> Iterator[Container]:
    """`docker run -d` with the given options; force-removed afterwards, whatever happened."""
    name = f"{name_prefix}-{uuid.uuid4().hex[:8]}"
    docker("run", "-d", "--name", name, *args, image)
    try:
        yield Container(name)
    finally:
        docker("rm", "-f", "-v", name, check=False, timeout=60)
