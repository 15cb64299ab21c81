"""Run a page's shell and Python snippets, in order, against a real `mha-serve` on loopback.

A page is read as its fenced blocks. `bash` and `python` blocks run; a `text` block right after
one is the output it must print (`...` matches any text). A `bash` block that starts the server
(`.venv/bin/mha-serve ARGS`, alone or at the end of the README's Run command) starts a real one
on free ports instead, replacing the previous; the install part of the Run command is checked to
be the README's and not re-run. The test suite's own command (pip install ... pytest) is skipped.
Addresses 127.0.0.1:8000 / :8001 become the server's HTTP and gRPC ports.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support import ROOT, Server, free_port, run_server

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
RUN_PREFIX = "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && "
SERVE = ".venv/bin/mha-serve"
SNIPPET_TIMEOUT = 120  # seconds per snippet; each takes well under one


@dataclass
class Snippet:
    lang: str
    code: str
    expected: str | None  # the `text` block that follows, if any


def snippets(markdown: str) -> list[Snippet]:
    """The runnable blocks of a page, each with the output block that follows it."""
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(markdown)]
    found = []
    for i, (lang, code) in enumerate(blocks):
        if lang not in ("bash", "python"):
            continue
        following = blocks[i + 1] if i + 1 < len(blocks) else None
        expected = following[1] if following and following[0] == "text" else None
        found.append(Snippet(lang, code, expected))
    return found


def matches(expected: str, actual: str) -> bool:
    """`expected` with each `...` standing for any text, against the whole output."""
    pattern = ".*?".join(re.escape(part) for part in expected.strip().split("..."))
    return re.fullmatch(pattern, actual.strip(), re.S) is not None


def server_args(code: str) -> list[str] | None:
    """The arguments of a block that starts the server, or None for any other block."""
    line = code.strip()
    if line.startswith(RUN_PREFIX):
        line = line.removeprefix(RUN_PREFIX)
    if "\n" in line or not line.startswith(SERVE):
        return None
    return shlex.split(line)[1:]


class PageRunner:
    """Runs one page's snippets in a scratch directory; owns the server they talk to."""

    def __init__(self, workdir: Path, logs: Path) -> None:
        self.workdir = workdir
        self.logs = logs
        self.stack = contextlib.ExitStack()
        self.server: Server | None = None
        self.grpc_port = 0

    def __enter__(self) -> PageRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def start(self, args: list[str]) -> None:
        self.stack.close()
        self.stack = contextlib.ExitStack()
        resolved = [str(self.workdir / a) if (self.workdir / a).exists() else a for a in args]
        self.grpc_port = free_port()
        self.server = self.stack.enter_context(
            run_server(self.logs, *resolved, "--grpc-port", str(self.grpc_port))
        )

    def localize(self, code: str) -> str:
        assert self.server is not None, "a snippet runs before any block starts the server"
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{self.server.port}")
        code = code.replace("127.0.0.1:8001", f"127.0.0.1:{self.grpc_port}")
        return code.replace(".venv/bin/python", sys.executable)

    def run(self, snippet: Snippet) -> str:
        """Run one snippet; returns what it printed (fails the test if it exits non-zero)."""
        code = self.localize(snippet.code)
        python = snippet.lang == "python"
        command = [sys.executable, "-c", code] if python else ["bash", "-ec", code]
        done = subprocess.run(
            command,
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=SNIPPET_TIMEOUT,
            env={"PYTHONPATH": str(ROOT), "PATH": _path()},
        )
        assert done.returncode == 0, f"{snippet.code}\nexit {done.returncode}\n{done.stderr}"
        return done.stdout


def _path() -> str:
    """The venv's bin first, so `mha-serve`, `python` and the tools resolve to it."""
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def run_page(page: Path, workdir: Path, logs: Path) -> int:
    """Run every snippet of `page`; returns how many ran. Fails on the first wrong output."""
    text = page.read_text()
    ran = 0
    with PageRunner(workdir, logs) as runner:
        for snippet in snippets(text):
            if ".venv/bin/pip install" in snippet.code and "pytest" in snippet.code:
                continue  # the test suite's own command
            args = server_args(snippet.code) if snippet.lang == "bash" else None
            if args is not None:
                runner.start(args)
                ran += 1
                continue
            assert ".venv/bin/pip install" not in snippet.code, (
                f"{page.name}: an install step this test cannot check: {snippet.code}"
            )
            output = runner.run(snippet)
            if snippet.expected is not None:
                assert matches(snippet.expected, output), (
                    f"{page.name}: {snippet.code}\nprinted:\n{output}\nthe page says:\n"
                    f"{snippet.expected}"
                )
            ran += 1
    return ran
