"""Fixtures shared by the test packages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import Server, run_server


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The built-in demo model with default settings, shared by tests that don't disturb it."""
    with run_server(tmp_path_factory.mktemp("demo")) as server:
        yield server
