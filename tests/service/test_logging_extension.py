"""Triton's logging extension on a real server with the unmodified tritonclient (HTTP and
gRPC): the settings read back, updates change what the log holds (levels, verbose, access-log
sampling), and bad settings are refused naming them, in the protocol's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import httpx
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from tests.support import Server, free_port, run_server, wait_for

DEFAULTS = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "text",
    "access_log_sample_rate": 1.0,
    "access_log_probes": True,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    port = free_port()
    with run_server(tmp_path_factory.mktemp("logging"), "--grpc-port", str(port)) as http:
        yield http, f"127.0.0.1:{port}"


@pytest.fixture
def clients(server) -> Iterator[tuple[thttp.InferenceServerClient, tgrpc.InferenceServerClient]]:
    http, address = server
    h, g = thttp.InferenceServerClient(http.address), tgrpc.InferenceServerClient(address)
    yield h, g
    h.update_log_settings(DEFAULTS)  # each test starts from the server's start-up settings


def _log(server: Server) -> str:
    return server.log_path.read_text()


def test_settings_read_back_over_http_and_grpc(server, clients):
    h, g = clients
    assert h.get_log_settings() == DEFAULTS
    settings = g.get_log_settings(as_json=True)["settings"]
    assert settings["log_info"] == {"bool_param": True}
    assert settings["log_verbose_level"] == {"uint32_param": 0}
    assert settings["access_log_sample_rate"] == {"string_param": "1.0"}
    assert "logging" in h.get_server_metadata()["extensions"]
    assert "logging" in g.get_server_metadata(as_json=True)["extensions"]


def test_sampling_zero_keeps_failures_only_and_grpc_changes_it_back(server, clients):
    http, _ = server
    h, g = clients
    got = h.update_log_settings({"access_log_sample_rate": 0.0})
    assert got == {**DEFAULTS, "access_log_sample_rate": 0.0}
    mark = len(_log(http))
    assert httpx.get(f"{http.url}/v2/models/mha/ready").status_code == 200
    assert httpx.get(f"{http.url}/v2/models/sampled-out").status_code == 404
    wait_for(lambda: "/v2/models/sampled-out 404" in _log(http)[mark:], timeout=10)
    # tritonclient.grpc sends a setting it does not know as a bool: true is rate 1.0
    g.update_log_settings({"access_log_sample_rate": True})
    assert h.get_log_settings()["access_log_sample_rate"] == 1.0
    assert httpx.get(f"{http.url}/v2/models/mha/config").status_code == 200
    wait_for(lambda: "/v2/models/mha/config 200" in _log(http)[mark:], timeout=10)
    # the 200 answered while the rate was 0 never got a line
    assert "/v2/models/mha/ready" not in _log(http)[mark:]


def test_log_info_off_silences_info_lines_and_verbose_turns_debug_on(server, clients):
    http, _ = server
    h, g = clients
    mark = len(_log(http))
    h.update_log_settings({"log_info": False})
    httpx.get(f"{http.url}/v2/models/info-off")  # access-log lines are INFO records
    got = g.update_log_settings({"log_info": True, "log_verbose_level": 1}, as_json=True)
    assert got["settings"]["log_verbose_level"] == {"uint32_param": 1}
    httpx.get(f"{http.url}/v2/models/info-on")
    wait_for(lambda: "/v2/models/info-on 404" in _log(http)[mark:], timeout=10)
    assert "info-off" not in _log(http)[mark:]
    assert " DEBUG service.logging: log settings now: " in _log(http)[mark:]  # verbose


def test_log_format_switches_to_json_lines(server, clients):
    http, _ = server
    h, _ = clients
    mark = len(_log(http))
    assert h.update_log_settings({"log_format": "json"})["log_format"] == "json"
    httpx.get(f"{http.url}/v2/models/json-line", headers={"x-request-id": "json-line-id"})
    wait_for(lambda: "json-line-id" in _log(http)[mark:], timeout=10)
    (line,) = [x for x in _log(http)[mark:].splitlines() if "json-line-id" in x]
    entry = json.loads(line)
    assert entry["path"] == "/v2/models/json-line" and entry["status"] == 404


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"log_colour": True}, "unknown log setting(s) ['log_colour']"),
        ({"log_info": "yes"}, "'log_info' must be true or false"),
        ({"log_verbose_level": -1}, "'log_verbose_level' must be an integer >= 0"),
        ({"log_format": "ISO8601"}, "'log_format' must be one of ['text', 'json']"),
        ({"log_file": "/tmp/x.log"}, "'log_file' must be \"\""),
        ({"access_log_sample_rate": 2}, "'access_log_sample_rate' must be a number in [0, 1]"),
    ],
)
def test_bad_settings_are_400_naming_them_and_change_nothing(server, settings, words):
    http, _ = server
    response = httpx.post(f"{http.url}/v2/logging", json=settings)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]
    assert httpx.get(f"{http.url}/v2/logging").json() == DEFAULTS


def test_grpc_bad_settings_are_invalid_argument(server, clients):
    _, g = clients
    with pytest.raises(InferenceServerException) as info:
        g.update_log_settings({"log_colour": True})
    assert info.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert "unknown log setting(s) ['log_colour']" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        g.update_log_settings({"log_format": "ISO8601"})
    assert "'log_format' must be one of" in info.value.message()
    assert g.get_log_settings(as_json=True)["settings"]["log_info"] == {"bool_param": True}


def test_log_settings_need_the_api_key(tmp_path):
    port = free_port()
    env = {"MHA_API_KEY": "log-key"}
    with run_server(tmp_path, "--grpc-port", str(port), env=env) as http:
        h = thttp.InferenceServerClient(http.address)
        g = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
        auth = {"authorization": "Bearer log-key"}
        with pytest.raises(InferenceServerException) as info:
            h.update_log_settings({"log_info": False})
        assert info.value.status() == "401"
        with pytest.raises(InferenceServerException) as info:
            g.get_log_settings()
        assert info.value.status() == str(grpc.StatusCode.UNAUTHENTICATED)
        assert h.get_log_settings(headers=auth)["log_info"] is True  # nothing changed
        got = g.update_log_settings({"log_warning": False}, headers=auth, as_json=True)
        assert got["settings"]["log_warning"] == {"bool_param": False}
