"""Debian's nginx on loopback, configured from the repo's deploy/nginx files (tests only).

The load-balancing settings come from deploy/nginx/templates/mha-serve.conf.template, rendered
the way the nginx image renders it in docker-compose (envsubst of ${MHA_*} placeholders), so
the tests exercise the exact upstream/retry/keepalive settings the stack ships. Only the
process-level wrapper (pid, logs, temp dirs) is the test's own, because those must point into a
temporary directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, free_port

NGINX_DIR = ROOT / "deploy" / "nginx"
MAIN_CONF = NGINX_DIR / "nginx.conf"
TEMPLATE = NGINX_DIR / "templates" / "mha-serve.conf.template"
# What the nginx image's entrypoint substitutes (docker-compose sets NGINX_ENVSUBST_FILTER=^MHA_).
PLACEHOLDER = re.compile(r"\$\{(MHA_[A-Z0-9_]+)\}")

# $msec (ms resolution) lets a test tell which requests finished after a given moment.
TEST_MAIN_CONF = """\
worker_processes 1;
error_log {dir}/error.log info;
events {{ worker_connections 1024; }}
http {{
    client_body_temp_path {dir}/tmp/client_body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    log_format test '$msec $status $request_method $uri upstream=$upstream_addr '
                    'upstream_status=$upstream_status rid=$mha_request_id';
    access_log {dir}/access.log test;
    include {dir}/conf.d/mha-serve.conf;
}}
"""


def nginx_binary() -> str:
    """Path of Debian's nginx, or skip the test saying how to get it."""
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if found is None:
        pytest.skip(
            "nginx is not installed and could not be installed (.ci/run tries "
            "`apt-get install nginx`); install it to run the load-balancer tests"
        )
    return found


def render_template(values: dict[str, str], template: Path = TEMPLATE) -> str:
    """The template with its ${MHA_*} placeholders filled in, as the nginx image's envsubst does."""
    text = template.read_text()
    missing = sorted(set(PLACEHOLDER.findall(text)) - values.keys())
    if missing:
        raise KeyError(f"no value for placeholders {missing} of {template}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def make_dir() -> Path:
    """A temp dir nginx's workers can use: they run as `nobody` when the tests run as root."""
    path = Path(tempfile.mkdtemp(prefix="mha-nginx-"))
    path.chmod(0o755)
    (path / "conf.d").mkdir()
    (path / "tmp").mkdir()
    return path


def check_config(conf: Path, workdir: Path) -> subprocess.CompletedProcess:
    """`nginx -t` on `conf`; relative includes resolve against the config file's directory."""
    return subprocess.run(
        [
            nginx_binary(),
            "-t",
            "-c",
            str(conf),
            "-p",
            str(workdir),
            "-e",
            str(workdir / "error.log"),
            "-g",
            f"pid {workdir}/nginx.pid;",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )


@dataclass
class Nginx:
    """A running nginx in front of some upstreams."""

    process: subprocess.Popen
    port: int
    workdir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def access_log(self) -> list[str]:
        path = self.workdir / "access.log"
        return path.read_text().splitlines() if path.exists() else []

    def error_log(self) -> str:
        path = self.workdir / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""


@contextlib.contextmanager
def run_nginx(upstream_1: str, upstream_2: str) -> Iterator[Nginx]:
    """nginx on a free loopback port, balancing over two host:port upstreams; stopped after."""
    binary = nginx_binary()
    workdir = make_dir()
    port = free_port()
    conf_d = workdir / "conf.d" / "mha-serve.conf"
    conf_d.write_text(
        render_template(
            {
                "MHA_NGINX_LISTEN": f"127.0.0.1:{port}",
                "MHA_UPSTREAM_1": upstream_1,
                "MHA_UPSTREAM_2": upstream_2,
            }
        )
    )
    main = workdir / "nginx.conf"
    main.write_text(TEST_MAIN_CONF.format(dir=workdir))
    checked = check_config(main, workdir)
    if checked.returncode != 0:
        raise RuntimeError(f"nginx -t failed:\n{checked.stderr}")
    process = subprocess.Popen(
        [
            binary,
            "-c",
            str(main),
            "-p",
            str(workdir),
            "-e",
            str(workdir / "error.log"),
            "-g",
            f"daemon off; pid {workdir}/nginx.pid;",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    nginx = Nginx(process, port, workdir)
    try:
        deadline = time.monotonic() + 15
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"nginx exited with {process.returncode}:\n{nginx.error_log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{nginx.url}/nginx-health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"nginx not answering:\n{nginx.error_log()}")
            time.sleep(0.05)
        yield nginx
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGQUIT)  # graceful stop
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(workdir, ignore_errors=True)
