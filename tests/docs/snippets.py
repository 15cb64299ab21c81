"""Run a page's shell and Python snippets, in order, against a real `mha-serve` on loopback.

A page is read as its fenced blocks. `bash` and `python` blocks run; a `text` block right after
one is the output it must print (`...` matches any text). A `bash` block that starts the server
(`.venv/bin/mha-serve ARGS`, alone or at the end of the README's Run command) starts a real one
on free ports instead, replacing the previous. Install steps are checked, not re-run: the Run
command's must be the README's, and each `.venv/bin/pip install` must already be satisfied in
this environment (the package at that version, or every requirement of that extra). The test
suite's own command (pip install ... pytest) is skipped. Addresses 127.0.0.1:8000 / :8001
become the server's HTTP and gRPC ports.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

from tests.support import ROOT, Server, free_port, run_server

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
RUN_PREFIX = "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && "
SERVE = ".venv/bin/mha-serve"
PIP = ".venv/bin/pip install"
SNIPPET_TIMEOUT = 120  # seconds per snippet; each takes a few


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


def server_command(code: str) -> str | None:
    """The `mha-serve ...` line of a block that starts the server, or None for any other."""
    line = code.strip()
    if line.startswith(RUN_PREFIX):
        line = line.removeprefix(RUN_PREFIX)
    if "\n" in line or not line.startswith(SERVE):
        return None
    return line


def unsatisfied(install: str) -> list[str]:
    """What a `.venv/bin/pip install ...` line asks for that this environment lacks."""
    missing = []
    for spec in shlex.split(install.removeprefix(PIP)):
        if spec.startswith("-") and spec != "-e":
            continue  # --no-deps, -q
        if spec == "-e":
            continue
        if spec.startswith(".["):  # an extra of this project: each of its requirements
            for extra in spec[2:-1].split(","):
                for raw in importlib.metadata.requires("mha-serve") or []:
                    req = Requirement(raw)
                    if req.marker and req.marker.evaluate({"extra": extra}):
                        missing += _lacks(Requirement(req.name + str(req.specifier)))
        elif spec != ".":
            missing += _lacks(Requirement(spec))
    return missing


def _lacks(req: Requirement) -> list[str]:
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return [str(req)]
    return [] if req.specifier.contains(version, prereleases=True) else [f"{req} (has {version})"]


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

    def start(self, command: str) -> None:
        """Start `mha-serve ARGS` as the page wrote it, its arguments expanded by bash."""
        self.stack.close()
        self.stack = contextlib.ExitStack()
        args = command.removeprefix(SERVE).strip()
        words = self.shell(f'printf "%s\\0" {args}').split("\0")[:-1] if args else []
        resolved = [str(self.workdir / w) if (self.workdir / w).exists() else w for w in words]
        self.grpc_port = free_port()
        self.server = self.stack.enter_context(
            run_server(self.logs, *resolved, "--grpc-port", str(self.grpc_port))
        )

    def localize(self, code: str) -> str:
        if self.server is not None:
            code = code.replace("127.0.0.1:8000", f"127.0.0.1:{self.server.port}")
            code = code.replace("127.0.0.1:8001", f"127.0.0.1:{self.grpc_port}")
        return code.replace(".venv/bin/python", sys.executable)

    def shell(self, code: str) -> str:
        return self.execute(["bash", "-ec", self.localize(code)], code)

    def run(self, snippet: Snippet) -> str:
        """Run one snippet; returns what it printed (fails the test if it exits non-zero)."""
        assert self.server is not None, "a snippet runs before any block starts the server"
        if snippet.lang == "python":
            return self.execute([sys.executable, "-c", self.localize(snippet.code)], snippet.code)
        return self.shell(snippet.code)

    def execute(self, command: list[str], shown: str) -> str:
        done = subprocess.run(
            command,
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=SNIPPET_TIMEOUT,
            # the venv's bin first, so `mha-serve`, `python` and the tools resolve to it
            env={
                "PYTHONPATH": str(ROOT),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            },
        )
        assert done.returncode == 0, f"{shown}\nexit {done.returncode}\n{done.stderr}"
        return done.stdout


def run_page(page: Path, workdir: Path, logs: Path) -> int:
    """Run every snippet of `page`; returns how many ran. Fails on the first wrong output."""
    ran = 0
    with PageRunner(workdir, logs) as runner:
        for snippet in snippets(page.read_text()):
            if PIP in snippet.code and "pytest" in snippet.code:
                continue  # the test suite's own command
            command = server_command(snippet.code) if snippet.lang == "bash" else None
            if command is not None:
                runner.start(command)
            elif snippet.lang == "bash" and snippet.code.lstrip().startswith(PIP):
                for line in snippet.code.strip().splitlines():
                    assert line.startswith(PIP), f"{page.name}: mixed install block: {line}"
                    lacking = unsatisfied(line.split("#")[0].strip())
                    assert not lacking, f"{page.name}: `{line}` is not satisfied: {lacking}"
            else:
                assert PIP not in snippet.code, f"{page.name}: an unchecked install: {snippet.code}"
                output = runner.run(snippet)
                if snippet.expected is not None:
                    assert matches(snippet.expected, output), (
                        f"{page.name}: {snippet.code}\nprinted:\n{output}\nthe page says:\n"
                        f"{snippet.expected}"
                    )
            ran += 1
    return ran
