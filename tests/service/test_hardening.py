"""Hardening round 2, in process (real app and lifespan over httpx's ASGI transport): shapes that
overflow int64, strict JSON decoding, HEAD on GET routes, log escaping, the API key on every
route, and the JSON-with-binary-header body decoded off the event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable

import httpx
import numpy as np
import pytest

from tests.inprocess import asgi_client

INFER = "/v2/models/mha/infer"
ATTENTION = "/v2/models/mha/attention"
HUGE = [4294967296, 4294967296]  # 2**64 elements: wraps to 0 in int64


def run(test: Callable[[httpx.AsyncClient], Awaitable[None]], **settings: object) -> None:
    async def main() -> None:
        async with asgi_client(**settings) as client:
            await test(client)

    asyncio.run(main())


def tensor_json(name: str, shape: list[int], datatype: str, data: object) -> dict:
    return {"name": name, "shape": shape, "datatype": datatype, "data": data}


def binary_header(*inputs: tuple[str, list[int], str, int]) -> tuple[bytes, dict[str, str]]:
    header = {
        "inputs": [
            {"name": n, "shape": s, "datatype": d, "parameters": {"binary_data_size": size}}
            for n, s, d, size in inputs
        ]
    }
    head = json.dumps(header).encode()
    return head, {"Inference-Header-Content-Length": str(len(head))}


def ok_body() -> bytes:
    data = np.full((1, 2, 512), 0.25, np.float32).tolist()
    return json.dumps({"inputs": [tensor_json("input", [1, 2, 512], "FP32", data)]}).encode()


OVERFLOW_CASES = {
    "json input": lambda: (
        json.dumps({"inputs": [tensor_json("input", [1, *HUGE], "FP32", [])]}).encode(),
        {},
    ),
    "json mask": lambda: (
        json.dumps(
            {
                "inputs": [
                    tensor_json("input", [1, 2, 512], "FP32", [0.5] * 1024),
                    tensor_json("key_padding_mask", HUGE, "BOOL", []),
                ]
            }
        ).encode(),
        {},
    ),
    "binary input": lambda: binary_header(("input", [1, *HUGE], "FP32", 0)),
    "binary mask": lambda: binary_header(
        ("key_padding_mask", HUGE, "BOOL", 0), ("input", [1, 2, 512], "FP32", 0)
    ),
    "zero-size with huge dims": lambda: binary_header(("input", [0, 2**62, 2**62], "FP32", 0)),
}


@pytest.mark.parametrize("route", [INFER, ATTENTION])
def test_overflowing_shapes_are_400_naming_the_input(route: str) -> None:
    async def test(client: httpx.AsyncClient) -> None:
        for case, build in OVERFLOW_CASES.items():
            body, headers = build()
            response = await client.post(route, content=body, headers=headers)
            assert response.status_code == 400, (case, response.text)
            error = response.json()["error"]
            name = "key_padding_mask" if "mask" in case else "input"
            assert f"input '{name}'" in error, (case, error)
        assert (await client.post(INFER, content=ok_body())).status_code == 200

    run(test, debug_endpoint=True)


def test_float_data_must_be_json_numbers() -> None:
    async def test(client: httpx.AsyncClient) -> None:
        bad = {
            "strings": ["0.1"] * 1024,
            "booleans": [True] * 1024,
            "a boolean among numbers": [0.5] * 1023 + [False],
            "nested boolean": [[[0.5] * 512, [0.5] * 511 + [True]]],
            "null": [0.5] * 1023 + [None],
        }
        for datatype in ("FP32", "FP16", "BF16"):
            for case, data in bad.items():
                body = {"inputs": [tensor_json("input", [1, 2, 512], datatype, data)]}
                response = await client.post(INFER, content=json.dumps(body).encode())
                assert response.status_code == 400, (datatype, case, response.text)
                assert "JSON numbers" in response.json()["error"], (datatype, case)
        # Integers are JSON numbers; a `true` elsewhere in the body is no reason to refuse.
        body = {
            "inputs": [tensor_json("input", [1, 2, 512], "FP32", [1] * 1024)],
            "parameters": {"is_causal": True},
        }
        assert (await client.post(INFER, content=json.dumps(body).encode())).status_code == 200

    run(test)


def test_binary_flags_and_header_length_are_strict() -> None:
    async def test(client: httpx.AsyncClient) -> None:
        base = json.loads(ok_body())
        for where, params in (
            ("outputs", {"outputs": [{"name": "output", "parameters": {"binary_data": "false"}}]}),
            ("request", {"parameters": {"binary_data_output": "true"}}),
            ("outputs", {"outputs": [{"name": "output", "parameters": {"binary_data": 1}}]}),
        ):
            response = await client.post(INFER, content=json.dumps({**base, **params}).encode())
            assert response.status_code == 400, params
            assert "must be true or false" in response.json()["error"], where
        head, headers = binary_header(("input", [1, 2, 512], "FP32", 4096))
        body = head + np.zeros(1024, np.float32).tobytes()
        length = len(head)
        bad: str | bytes
        for bad in (
            f"+{length}",
            f" {length}",
            f"{length} ",
            "١٢٣".encode(),
            f"0x{length:x}",
            "1_0",
        ):
            response = await client.post(
                INFER, content=body, headers={"Inference-Header-Content-Length": bad}
            )
            assert response.status_code == 400, bad
            assert "plain decimal integer" in response.json()["error"], bad
        response = await client.post(INFER, content=body, headers=headers)
        assert response.status_code == 200, response.text

    run(test)


def test_head_is_answered_wherever_get_is() -> None:
    async def test(client: httpx.AsyncClient) -> None:
        for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/mha", "/metrics"):
            got = await client.get(path)
            head = await client.head(path)
            assert head.status_code == got.status_code == 200, path
            assert head.content == b"", path
            assert head.headers["content-type"] == got.headers["content-type"], path
        assert (await client.head("/v2/models/nope")).status_code == 404
        assert (await client.head(INFER)).status_code == 405  # POST only: never runs inference

    run(test)


def test_client_supplied_path_cannot_forge_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    forged = "/v2/health/live%0A2026-11-23 07:00:00,000 INFO service.access: GET /admin 200"

    async def test(client: httpx.AsyncClient) -> None:
        await client.get(forged)
        await client.post("/v2/models/x%0D%0Ay/infer", content=b"{}")

    with caplog.at_level(logging.INFO, logger="service.access"):
        run(test)
    lines = [r.getMessage() for r in caplog.records if r.name == "service.access"]
    assert any("\\n2026-11-23" in line for line in lines), lines
    assert any("x\\r\\ny" in line for line in lines), lines
    assert not any("\n" in line or "\r" in line for line in lines), lines


def test_api_key_guards_every_route_but_health_and_metrics() -> None:
    key = {"Authorization": "Bearer K"}

    async def test(client: httpx.AsyncClient) -> None:
        attention = json.dumps(
            {"inputs": [tensor_json("input", [1, 2, 512], "FP32", [0.5] * 1024)]}
        ).encode()
        for method, path, body in (
            ("POST", ATTENTION, attention),
            ("GET", "/v2/models/mha/heads", None),
            ("POST", INFER, ok_body()),
            ("GET", "/v2/models/mha", None),
            ("GET", "/docs", None),
            ("GET", "/openapi.json", None),
            ("GET", "/v2/health/live/../../models/mha", None),
        ):
            response = await client.request(method, path, content=body)
            assert response.status_code == 401, (path, response.status_code)
            response = await client.request(method, path, content=body, headers=key)
            assert response.status_code in (200, 404), (path, response.text)
        for scheme in ("bearer", "BEARER", "BeArEr"):
            response = await client.get("/v2/models/mha", headers={"Authorization": f"{scheme} K"})
            assert response.status_code == 200, scheme
        assert (await client.get("/v2/models/mha", headers={"Authorization": "Basic K"})).is_error
        for path in ("/v2/health/live", "/v2/health/ready", "/metrics"):
            assert (await client.get(path)).status_code == 200, path

    run(test, api_key="K", debug_endpoint=True)


def test_debug_token_is_a_second_guard_on_top_of_the_api_key() -> None:
    async def test(client: httpx.AsyncClient) -> None:
        heads = "/v2/models/mha/heads"
        assert (await client.get(heads, headers={"X-Debug-Token": "D"})).status_code == 401
        only_key = await client.get(heads, headers={"Authorization": "Bearer K"})
        assert only_key.status_code == 401 and "X-Debug-Token" in only_key.json()["error"]
        wrong = {"Authorization": "Bearer K", "X-Debug-Token": "nope"}
        assert (await client.get(heads, headers=wrong)).status_code == 403
        both = {"Authorization": "bearer K", "X-Debug-Token": "D"}
        assert (await client.get(heads, headers=both)).status_code == 200

    run(test, api_key="K", debug_endpoint=True, debug_token="D")


def test_debug_token_scheme_is_case_insensitive_without_an_api_key() -> None:
    async def test(client: httpx.AsyncClient) -> None:
        heads = "/v2/models/mha/heads"
        assert (await client.get(heads)).status_code == 401
        assert (await client.get(heads, headers={"Authorization": "bEaReR D"})).status_code == 200
        assert (await client.get(heads, headers={"X-Debug-Token": "D"})).status_code == 200

    run(test, debug_endpoint=True, debug_token="D")


def test_json_body_with_binary_header_is_decoded_off_the_event_loop() -> None:
    """A big JSON body announced with Inference-Header-Content-Length (no binary part) used to be
    parsed on the event loop, stalling health probes for the whole parse. A profile hook on the
    event-loop thread records where decode_request runs."""
    data = np.random.default_rng(0).standard_normal((1, 256, 512)).astype(np.float32).tolist()
    body = json.dumps({"inputs": [tensor_json("input", [1, 256, 512], "FP32", data)]}).encode()
    headers = {"Inference-Header-Content-Length": str(len(body))}
    on_loop: list[str] = []

    def profile(frame, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_name in ("decode_request", "prepare"):
            on_loop.append(frame.f_code.co_name)

    async def test(client: httpx.AsyncClient) -> None:
        sys.setprofile(profile)  # this (event-loop) thread only
        try:
            response = await client.post(INFER, content=body, headers=headers)
        finally:
            sys.setprofile(None)
        assert response.status_code == 200, response.text
        assert on_loop == [], f"{on_loop} ran on the event loop"

    run(test)
