"""The Dockerfile: hadolint-clean, and what it promises (non-root, health check, exec CMD).

The image itself is built and run by a real Docker engine in test_image.py; these checks need no
engine: the HEALTHCHECK command run against a real server, the build context against
.dockerignore, the wheel the build stage installs.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.deploy.tools import binary, run
from tests.support import ROOT, Server, free_port

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        current += " " + line.removesuffix("\\").strip() if current else line.removesuffix("\\")
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in lines]


def final_stage() -> list[tuple[str, str]]:
    """The instructions of the last stage: the image `docker build .` produces."""
    stages: list[list[tuple[str, str]]] = []
    for instruction in instructions():
        if instruction[0] == "FROM":
            stages.append([])
        elif stages:
            stages[-1].append(instruction)
    return stages[-1]


# The image, and the Debian nginx/Prometheus stand-ins CI builds (deploy/ci/docker.sh).
DOCKERFILES = [DOCKERFILE, *sorted((ROOT / "deploy" / "ci").glob("*.Dockerfile"))]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(path) -> None:
    result = run(binary("hadolint"), "--format", "json", str(path))
    assert result.returncode == 0 and json.loads(result.stdout or "[]") == [], result.stdout


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_ignores_are_justified(path) -> None:
    """Each `# hadolint ignore=` is preceded by a comment naming the rule and why."""
    lines = path.read_text().splitlines()
    ignores = [i for i, line in enumerate(lines) if "hadolint ignore=" in line]
    for i in ignores:
        rules = re.search(r"ignore=(\S+)", lines[i]).group(1).split(",")
        reason = lines[i - 1]
        for rule in rules:
            above = "\n".join(lines[max(0, i - 4) : i])
            assert f"{rule} (" in above, f"line {i + 1}: no justification for {rule}"
        assert reason.startswith("#") and len(reason) > 20, f"line {i + 1}: {reason!r}"


def test_hadolint_catches_problems(tmp_path) -> None:
    """The linter is live: a root image with `pip install` of an unpinned package fails."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\nCMD mha-serve\n")
    result = run(binary("hadolint"), "--format", "json", str(bad))
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert result.returncode != 0 and {"DL3006", "DL3013", "DL3025"} <= codes, codes


def test_runtime_stage_promises() -> None:
    stage = final_stage()
    kinds = [kind for kind, _ in stage]
    (user,) = [args for kind, args in stage if kind == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root uid (k8s runAsNonRoot checks it)"
    assert ("EXPOSE", "8000 8001") in stage  # HTTP and the OIP gRPC listener
    (cmd,) = [args for kind, args in stage if kind == "CMD"]
    assert json.loads(cmd) == ["mha-serve"], "exec form: mha-serve is PID 1 and gets SIGTERM"
    assert "ENTRYPOINT" not in kinds, "no wrapper between the runtime and the server"
    (volume,) = [args for kind, args in stage if kind == "VOLUME"]
    assert json.loads(volume) == ["/models"]
    env = " ".join(args for kind, args in stage if kind == "ENV")
    assert "MHA_HOST=0.0.0.0" in env and "MHA_MODEL_DIR" not in env, "demo model by default"
    assert sum(kind == "FROM" for kind, _ in instructions()) >= 3, "multi-stage"


def healthcheck_command() -> list[str]:
    (args,) = [args for kind, args in final_stage() if kind == "HEALTHCHECK"]
    command = json.loads(args[args.index("CMD") + 3 :])
    assert "/v2/health/ready" in " ".join(command)
    return command


def test_healthcheck_command_against_a_real_server(demo_server: Server) -> None:
    """The image's HEALTHCHECK, run as Docker would (exec form, MHA_PORT from the env)."""
    command = healthcheck_command()
    assert command[0] == "python"
    argv = [sys.executable, *command[1:]]
    ready = subprocess.run(argv, env={**os.environ, "MHA_PORT": str(demo_server.port)}, timeout=30)
    assert ready.returncode == 0
    nobody = subprocess.run(
        argv, env={**os.environ, "MHA_PORT": str(free_port())}, capture_output=True, timeout=30
    )
    assert nobody.returncode != 0, "no server must mean unhealthy"


def copied_sources() -> list[str]:
    """Build-context paths the Dockerfile COPYs (not those copied from another stage)."""
    sources = []
    for kind, args in instructions():
        if kind == "COPY" and not args.startswith("--from"):
            sources += args.split()[:-1]
    return sources


def test_build_stage_installs_a_complete_package(tmp_path) -> None:
    """The build stage's non-editable `pip install .`, from only what the image's build stage
    copies: the wheel must hold every module, int8's C source and the `mha-serve` entry point,
    and import."""
    context = tmp_path / "context"
    for source in ("pyproject.toml", "README.md", "mha_engine", "service"):
        assert source in copied_sources(), f"the build stage no longer copies {source}"
        if (ROOT / source).is_dir():
            shutil.copytree(
                ROOT / source, context / source, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            context.mkdir(exist_ok=True)
            shutil.copy(ROOT / source, context / source)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    pip = [sys.executable, "-m", "pip"]
    built = run(
        *pip, "wheel", "-q", "--no-deps", *isolation, "-w", str(tmp_path / "dist"), str(context)
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("mha_serve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("service", "mha_engine"):
        for module in (ROOT / package).rglob("*.py"):
            assert module.relative_to(ROOT).as_posix() in names, f"{module} not in the wheel"
    for source in (ROOT / "mha_engine").glob("*.c"):  # compiled at first use (cbuild.py)
        assert source.relative_to(ROOT).as_posix() in names, f"{source} not in the wheel"
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    assert "mha-serve = service.__main__:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    site = tmp_path / "site"
    installed = run(*pip, "install", "-q", "--no-deps", "--target", str(site), str(wheel))
    assert installed.returncode == 0, installed.stderr
    probe = subprocess.run(
        [sys.executable, "-c", "import service.app, mha_engine; print(service.app.__file__)"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0 and probe.stdout.startswith(str(site)), probe.stderr


def dockerignore_excludes(path: str) -> bool:
    """.dockerignore semantics for our patterns: last match wins, `!` re-includes."""
    excluded = False
    for raw in DOCKERIGNORE.read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        glob = pattern.replace("**/", "*")
        if any(fnmatch.fnmatchcase(p, glob) or fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            excluded = not negate
    return excluded


def test_build_context_has_what_the_dockerfile_copies() -> None:
    sources = copied_sources()
    assert sources, "no COPY found"
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repo"
        assert not dockerignore_excludes(source), f"COPY {source}: excluded by .dockerignore"
        if (ROOT / source).is_dir():
            for file in (ROOT / source).rglob("*.py"):
                if "__pycache__" not in file.parts and "results" not in file.parts:
                    relative = file.relative_to(ROOT).as_posix()
                    assert not dockerignore_excludes(relative), relative
    for kept_out in (".venv", ".git", "tests", "service/__pycache__", "loadtest/results"):
        assert dockerignore_excludes(kept_out), f"{kept_out} would be sent to the daemon"
