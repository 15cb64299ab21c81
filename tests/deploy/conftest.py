"""The image built once per test session, for the tests that run it (test_image, test_stack)."""

from __future__ import annotations

import pytest

from tests.deploy.docker import Built, build_image


@pytest.fixture(scope="session")
def built_image() -> Built:
    built = build_image()
    print(f"\nimage {built.tag}: {built.size_bytes / 1e6:.0f} MB, built in {built.seconds:.0f} s")
    return built
