"""Operator-facing behaviour, in process: CLI errors and help, offline /docs, CORS, JSON log
timestamps, dropping probe access lines, and the request-body rate limit."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import subprocess
import sys

import httpx
import pytest

from service.__main__ import parse_settings
from service.app import create_app
from service.runtime.logs import configure_logging
from service.runtime.settings import Settings
from tests.support import ROOT

INFER = "/v2/models/mha/infer"
pytestmark = pytest.mark.anyio  # async tests run on asyncio (anyio_backend defaults to it)


def _client(**settings: object) -> httpx.AsyncClient:
    app = create_app(Settings(**settings))  # no lifespan: these routes need no model
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


# -- CLI ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["--max-batch-size", "abc"], {}, ("--max-batch-size", "MHA_MAX_BATCH_SIZE", "'abc'")),
        ([], {"MHA_MAX_QUEUE": "0"}, ("--max-queue", "MHA_MAX_QUEUE", "greater than or equal")),
        (["--header-timeout-s", "-1"], {}, ("--header-timeout-s", "MHA_HEADER_TIMEOUT_S")),
    ],
)
def test_bad_value_is_one_line_exit_2(
    argv: list[str], env: dict[str, str], names: tuple[str, ...], monkeypatch, capsys
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exited:
        parse_settings(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert all(name in err for name in names), err


def test_bad_value_from_the_real_command_has_no_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service", "--max-batch-size", "abc"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("mha-serve: error: --max-batch-size / MHA_MAX_BATCH_SIZE")
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1


def test_help_shows_plain_types_and_env_vars(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "{Path,null}" not in text and "null" not in text and "SecretStr" not in text
    assert "--model-dir PATH" in text and "--max-batch-size INT" in text
    assert "--api-key TEXT" in text
    flags = set(re.findall(r"^  --([a-z-]+)", text, re.M)) - {"help", "version"}
    assert len(flags) >= len(Settings.model_fields) - 2  # bool flags show as --x, --no-x
    for name in Settings.model_fields:
        assert f"MHA_{name.upper()}" in text, name


def test_version(capsys) -> None:
    from service import __version__

    with pytest.raises(SystemExit) as exited:
        parse_settings(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"mha-serve {__version__}"


# -- /docs offline -----------------------------------------------------------------------------
async def test_docs_reference_only_local_assets() -> None:
    async with _client() as client:
        page = await client.get("/docs")
        assert page.status_code == 200
        urls = re.findall(r"""(?:src|href)=["']([^"']+)""", page.text)
        assert urls and not [u for u in urls if "//" in u], urls  # nothing off this server
        assert "cdn" not in page.text.lower()
        for url in urls:
            asset = await client.get(url)
            assert asset.status_code == 200 and len(asset.content) > 100, url
        js = next(u for u in urls if u.endswith(".js"))
        assert "SwaggerUIBundle" in (await client.get(js)).text
        assert (await client.get("/openapi.json")).status_code == 200


async def test_docs_behind_an_api_key() -> None:
    """--api-key guards every route but health and metrics, the docs and their assets too."""
    async with _client(api_key="k") as client:
        assert (await client.get("/docs")).status_code == 401
        assert (await client.get("/docs/assets/swagger-ui.css")).status_code == 401
        key = {"Authorization": "Bearer k"}
        assert (await client.get("/docs", headers=key)).status_code == 200
        assert (await client.get("/docs/assets/swagger-ui.css", headers=key)).status_code == 200


# -- CORS --------------------------------------------------------------------------------------
PREFLIGHT = {
    "Origin": "https://ui.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type,authorization",
}


async def test_cors_preflight_answered_when_configured() -> None:
    async with _client(cors_origins="https://ui.example, https://b.example", api_key="k") as c:
        answer = await c.options(INFER, headers=PREFLIGHT)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "https://ui.example"
        assert "POST" in answer.headers["access-control-allow-methods"]
        other = await c.options(INFER, headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        denied = await c.post(INFER, headers={"Origin": "https://ui.example"})
        assert denied.status_code == 401  # CORS is no way around the API key
        assert denied.headers["access-control-allow-origin"] == "https://ui.example"


async def test_cors_off_by_default() -> None:
    async with _client() as client:
        answer = await client.options(INFER, headers=PREFLIGHT)
        assert answer.status_code == 405 and "access-control-allow-origin" not in answer.headers


# -- logs --------------------------------------------------------------------------------------
@pytest.fixture
def restore_logging():
    """configure_logging changes the root logger; put pytest's set-up back afterwards."""
    root, access = logging.getLogger(), logging.getLogger("service.access")
    saved = (root.level, list(root.handlers), list(access.filters))
    yield
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    access.filters[:] = saved[2]


def _captured(access_log_probes: bool) -> io.StringIO:
    configure_logging("info", "json", access_log_probes)
    stream = io.StringIO()
    logging.getLogger().handlers[0].setStream(stream)
    return stream


async def test_json_log_time_is_rfc3339_utc_millis(restore_logging) -> None:
    stream = _captured(True)
    async with _client() as client:
        await client.get("/docs")
        await client.get("/v2/health/live")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    paths = [line.get("path") for line in lines]
    assert "/docs" in paths and "/v2/health/live" in paths
    for line in lines:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"]), line


async def test_probe_access_lines_can_be_dropped(restore_logging) -> None:
    stream = _captured(False)
    async with _client() as client:
        for path in ("/v2/health/live", "/v2/health/ready", "/metrics", "/docs"):
            await client.get(path)
    paths = [json.loads(line).get("path") for line in stream.getvalue().splitlines()]
    assert "/docs" in paths
    assert not [p for p in paths if p and (p.startswith("/v2/health") or p == "/metrics")]


def test_grpc_probe_access_lines_can_be_dropped(restore_logging) -> None:
    """gRPC's health probes are the ServerLive / ServerReady calls (their lines' path); an HTTP
    path of the same name is not one."""
    stream = _captured(False)
    access = logging.getLogger("service.access")
    lines = [("GRPC", "ServerLive"), ("GRPC", "ServerReady"), ("GRPC", "ModelReady")]
    lines.append(("GET", "ServerLive"))
    for method, path in lines:
        access.info("%s %s", method, path, extra={"method": method, "path": path, "status": 0})
    kept = [
        (line["method"], line["path"]) for line in map(json.loads, stream.getvalue().splitlines())
    ]
    assert kept == [("GRPC", "ModelReady"), ("GET", "ServerLive")]


# -- body rate ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fast_path", [True, False])
async def test_slow_body_gets_408_and_close(fast_path: bool) -> None:
    async def trickle():
        yield b'{"inputs": ['
        await asyncio.sleep(5)  # far past grace + 12 bytes / 100 B/s
        yield b"]}"

    app = create_app(Settings(body_timeout_s=0.2, body_min_rate=100, fast_path=fast_path))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://t") as client,
    ):
        while not app.state.service.ready:  # warm-up: a few batches of the demo model
            await asyncio.sleep(0.05)
        started = asyncio.get_running_loop().time()
        answer = await client.post(INFER, content=trickle(), headers={"content-length": "14"})
        waited = asyncio.get_running_loop().time() - started
    assert answer.status_code == 408, answer.text
    assert "--body-min-rate" in answer.json()["error"]
    assert answer.headers["connection"] == "close"
    assert 0.2 < waited < 2.0
