"""Fixtures shared by the test packages."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.support import Server, run_server

# Servers the tests start (in-process or as subprocesses, which inherit this) open no gRPC
# listener on the default port 8001 unless a test passes --grpc-port / grpc_port itself.
os.environ.setdefault("MHA_GRPC_PORT", "0")
# The engine's compiled C kernels are cached for this run alone (mha_engine/cbuild.py): it
# starts cold, leaves ~/.cache alone, and its servers compile each kernel once between them.
_KERNEL_CACHE = tempfile.mkdtemp(prefix="mha-kernel-cache-")
atexit.register(shutil.rmtree, _KERNEL_CACHE, ignore_errors=True)
os.environ.setdefault("MHA_ENGINE_CACHE_DIR", _KERNEL_CACHE)


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The built-in demo model with default settings, shared by tests that don't disturb it."""
    with run_server(tmp_path_factory.mktemp("demo")) as server:
        yield server
