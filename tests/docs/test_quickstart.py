"""docs/quickstart.md and README.md's examples, run as written against real servers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.snippets import RUN_PREFIX, SERVE, matches, run_page, snippets
from tests.support import ROOT

QUICKSTART = ROOT / "docs" / "quickstart.md"
README = ROOT / "README.md"


@pytest.mark.timeout(900)  # three real servers in turn (demo, own weights, MiniLM)
def test_quickstart_runs_as_written(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    assert run_page(QUICKSTART, work, logs) >= 8


def test_readme_examples_run_as_written(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    assert run_page(README, work, logs) >= 4  # the Run command and three examples


def test_quickstart_installs_with_the_readme_run_command() -> None:
    """The install line the quickstart shows is the README's, character for character."""
    run = f"{RUN_PREFIX}{SERVE}"
    assert run in README.read_text()
    first = snippets(QUICKSTART.read_text())[0]
    assert first.code.strip() == run


def test_ci_test_command_is_in_the_readme() -> None:
    """.ci/run greps the README for its test command: keep them one line, the same."""
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r'^TEST_CMD="(.*)"$', ci, re.M).group(1)
    assert command in README.read_text()


def test_output_matching() -> None:
    assert matches("[1, 4, 512] ...", "[1, 4, 512] 2048\n")
    assert matches("a\n...\nz", "a\nb\nc\nz")
    assert not matches("[1, 4, 512]", "[1, 4, 511]")
    assert not matches("200", "200 extra")


def test_readme_is_at_most_12_kib() -> None:
    """The README is a map: what it is, the two commands, examples; the rest is in docs/."""
    assert len(README.read_bytes()) <= 12 * 1024
