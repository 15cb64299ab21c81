"""deploy/nginx passes `nginx -t` as docker-compose assembles it, and matches the service."""

from __future__ import annotations

import re
import shutil

from service.runtime.settings import Settings
from tests.deploy.nginx import MAIN_CONF, TEMPLATE, check_config, make_dir, render_template

SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def directive(name: str) -> list[str]:
    """Every value of `name` in the template, e.g. directive('keepalive') -> ['32']."""
    pattern = re.compile(rf"^\s*{name}\s+([^;]+);", re.M)
    return [m.group(1).strip() for m in pattern.finditer(TEMPLATE.read_text())]


def test_nginx_t_accepts_the_compose_config() -> None:
    """The image's layout: nginx.conf + templates/ rendered into conf.d/ (loopback upstreams,
    since nginx resolves upstream names at load time and mha-serve-1 exists only in compose)."""
    workdir = make_dir()
    try:
        # Only the temp directories move into workdir (nginx -t creates them, and the compiled-in
        # defaults are system paths); everything else is the repo's nginx.conf as it is.
        main = MAIN_CONF.read_text()
        assert main.count("http {") == 1
        temp_paths = "".join(
            f"\n    {kind}_temp_path {workdir}/tmp/{kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (workdir / "nginx.conf").write_text(main.replace("http {", "http {" + temp_paths))
        rendered = render_template(
            {
                "MHA_NGINX_LISTEN": "127.0.0.1:8080",
                "MHA_UPSTREAM_1": "127.0.0.1:18001",
                "MHA_UPSTREAM_2": "127.0.0.1:18002",
            }
        )
        (workdir / "conf.d" / "mha-serve.conf").write_text(rendered)
        result = check_config(workdir / "nginx.conf", workdir)
        assert result.returncode == 0, result.stderr
        assert "test is successful" in result.stderr

        # ...and nginx -t really checks: a misspelt directive fails it.
        (workdir / "conf.d" / "mha-serve.conf").write_text(
            rendered.replace("keepalive_timeout", "keepalive_timeuot")
        )
        result = check_config(workdir / "nginx.conf", workdir)
        assert result.returncode != 0 and "keepalive_timeuot" in result.stderr
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_body_limit_matches_the_service() -> None:
    (size,) = directive("client_max_body_size")
    number, unit = re.fullmatch(r"(\d+)([kmg]?)", size.lower()).groups()
    assert int(number) * SIZE_UNITS[unit] == Settings().max_body_bytes


def test_upstream_keepalive_is_shorter_than_uvicorn() -> None:
    """nginx must drop an idle upstream connection before uvicorn does (5 s), or a request can
    be written onto a connection the replica is closing."""
    import uvicorn

    (timeout,) = [v for v in directive("keepalive_timeout") if v.endswith("s")]
    assert float(timeout[:-1]) < uvicorn.Config(app=None).timeout_keep_alive
    assert directive("proxy_http_version") == ["1.1"]
    assert directive("proxy_set_header Connection") == ['""']


def test_request_ids_nginx_passes_are_those_the_replica_keeps() -> None:
    """nginx forwards (and logs) a client's X-Request-ID only when the replica keeps it, so
    the two logs and the trace share the id; the rule is the replica's own."""
    from service.http.middleware import _SAFE_ID

    text = TEMPLATE.read_text()
    rule = re.search(r'"~(\^[^"]+\$)" \$http_x_request_id;', text)
    assert rule is not None and rule.group(1) == _SAFE_ID.pattern
    assert "proxy_set_header X-Request-ID $mha_request_id;" in text
