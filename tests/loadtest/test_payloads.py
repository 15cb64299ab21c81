"""The load generator's bodies and checks against a real server: what Locust sends is valid OIP,
JSON and binary bodies carry the same tensor, and the response check catches broken answers."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from loadtest.payloads import BINARY_HEADER, BodyFactory, LengthDistribution, check_response
from tests.support import Server

E = 512  # the demo model's embed_dim
URL = "/v2/models/mha/infer"


def send(server: Server, factory: BodyFactory, batch: int, seq_len: int) -> httpx.Response:
    body = factory.body(batch, seq_len)
    response = httpx.post(f"{server.url}{URL}", content=body.data, headers=body.headers, timeout=60)
    assert response.status_code == 200, response.text
    return response


def output_array(response: httpx.Response) -> np.ndarray:
    length = response.headers.get(BINARY_HEADER)
    if length is None:
        out = response.json()["outputs"][0]
        return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
    out = json.loads(response.content[: int(length)])["outputs"][0]
    return np.frombuffer(response.content[int(length) :], "<f4").reshape(out["shape"])


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize(("batch", "seq_len"), [(1, 16), (3, 7), (1, 200)])
def test_bodies_are_accepted_and_answers_pass_the_check(
    demo_server: Server, binary: bool, batch: int, seq_len: int
) -> None:
    factory = BodyFactory(E, 600, binary, np.random.default_rng(1))
    response = send(demo_server, factory, batch, seq_len)
    assert (response.headers.get(BINARY_HEADER) is not None) == binary
    shape = (batch, seq_len, E)
    assert check_response(response.content, response.headers.get(BINARY_HEADER), shape) is None
    assert output_array(response).shape == shape


def test_json_and_binary_bodies_carry_the_same_tensor(demo_server: Server) -> None:
    """Same seed, same pool: the spliced JSON text must decode to the binary bytes' values."""
    binary = send(demo_server, BodyFactory(E, 64, True, np.random.default_rng(7)), 2, 20)
    text = send(demo_server, BodyFactory(E, 64, False, np.random.default_rng(7)), 2, 20)
    np.testing.assert_allclose(output_array(text), output_array(binary), rtol=1e-5, atol=1e-5)


def test_binary_body_is_the_pool_prefix() -> None:
    factory = BodyFactory(8, 10, True, np.random.default_rng(0))
    body = factory.body(2, 3)
    head_len = int(body.headers[BINARY_HEADER])
    header = json.loads(body.data[:head_len])
    assert header["inputs"][0]["shape"] == [2, 3, 8]
    assert header["inputs"][0]["parameters"]["binary_data_size"] == 2 * 3 * 8 * 4
    assert len(body.data) == head_len + 2 * 3 * 8 * 4
    with pytest.raises(ValueError, match="exceed"):
        factory.body(4, 3)  # 12 tokens > the pool of 10


def test_check_flags_wrong_answers(demo_server: Server) -> None:
    response = send(demo_server, BodyFactory(E, 16, True, np.random.default_rng(2)), 1, 16)
    length = response.headers[BINARY_HEADER]
    content = response.content
    assert check_response(content, length, (1, 16, E)) is None

    nan = bytearray(content)
    nan[-4:] = np.array([np.nan], "<f4").tobytes()
    assert "NaN or Inf" in check_response(bytes(nan), length, (1, 16, E))
    assert "shape" in check_response(content, length, (1, 17, E))
    assert "binary_data_size" in check_response(content[:-4], length, (1, 16, E))
    assert "outside" in check_response(content, str(len(content) + 1), (1, 16, E))
    assert "not an OIP" in check_response(b"<html>busy</html>", None, (1, 16, E))

    head = json.loads(content[: int(length)])
    values = np.frombuffer(content[int(length) :], "<f4")
    as_json = dict(head, outputs=[dict(head["outputs"][0], data=values[:-1].tolist())])
    del as_json["outputs"][0]["parameters"]
    assert "values" in check_response(json.dumps(as_json).encode(), None, (1, 16, E))


def test_length_distributions() -> None:
    rng = np.random.default_rng(0)
    assert {LengthDistribution("64").sample(rng) for _ in range(10)} == {64}
    uniform = [LengthDistribution("uniform:16:256").sample(rng) for _ in range(2000)]
    assert min(uniform) == 16 and max(uniform) == 256
    log_uniform = [LengthDistribution("loguniform:16:256").sample(rng) for _ in range(2000)]
    assert min(log_uniform) >= 16 and max(log_uniform) <= 256
    assert np.median(log_uniform) < np.median(uniform)  # skewed towards short sequences
    choice = {LengthDistribution("choice:16,64,256").sample(rng) for _ in range(200)}
    assert choice == {16, 64, 256}
    assert LengthDistribution("choice:16,300").max == 300


@pytest.mark.parametrize(
    "spec", ["uniform:5", "uniform:9:3", "normal:1:2", "0", "choice:", "choice:4,-1", "x"]
)
def test_bad_length_distributions_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="length distribution"):
        LengthDistribution(spec)
