"""The documentation site, built once for the tests that read it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# `browser`: the debug page's fixture, Debian's chromium through Playwright (skips, saying why,
# without either), for test_site_browser.py
from tests.service.test_debug_page_browser import browser  # noqa: F401
from tests.support import ROOT


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-6000:]}"
    return out
