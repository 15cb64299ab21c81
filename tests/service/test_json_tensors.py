"""OIP JSON float data parsed straight into arrays (service.oip.json_tensors): the same values,
bit for bit, as orjson's path, and every case it does not take left to orjson's path."""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.oip import json_tensors
from service.oip.codecs import decode_request
from service.pipeline.errors import BadInput

SHAPE = [1, 64, 32]  # 2,048 values: over json_tensors.MIN_BYTES


def body(data: object, datatype: str = "FP32", shape: list[int] = SHAPE, **extra) -> bytes:
    tensor = {"name": "input", "shape": shape, "datatype": datatype, "data": data}
    return json.dumps({"inputs": [tensor], **extra}).encode()


def values() -> list[float]:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(2048) * 10.0 ** rng.integers(-40, 15, 2048)).tolist()
    x[:8] = [0, -0.0, 1, -7, 9007199254740991, 1e-45, 2.5e-308, 123456789]
    return x


def decoded(raw: bytes, simdjson: bool, monkeypatch: pytest.MonkeyPatch) -> object:
    with monkeypatch.context() as patch:
        if not simdjson:
            patch.setattr(json_tensors, "simdjson", None)
        try:
            return decode_request(raw, None).inputs["input"].array
        except BadInput as exc:
            return f"400: {exc.message}"


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
def test_parsed_arrays_are_bit_identical_to_orjsons(datatype, monkeypatch) -> None:
    raw = body(values(), datatype)
    assert json_tensors.parse_header(raw) is not None  # the case taken here
    fast, regular = (decoded(raw, s, monkeypatch) for s in (True, False))
    assert fast.dtype == regular.dtype and fast.shape == regular.shape == tuple(SHAPE)
    assert fast.tobytes() == regular.tobytes()


LEFT_TO_ORJSON = {
    "escape in a string": body(values(), id="a\\u005bb"),
    "nested lists": body(np.reshape(values(), (64, 32)).tolist()),
    "nested irregular": body([[], values()[:2]], shape=[2]) + b" " * 5000,
    "boolean": body([True, *values()[1:]]),
    "string": body(["1", *values()[1:]]),
    "null": body([None, *values()[1:]]),
    "integer datatype": body(list(range(2048)), "INT32"),
    "integer past 2**53": body([2**53 + 1, *values()[1:]]),
    "any value past 2**53": body([3.4e38, *values()[1:]]),
    "duplicate data": body(values()).replace(b'"data": [', b'"data": [1], "data": [', 1),
    "NaN": body(values()).replace(b"[0,", b"[NaN,", 1),
    "trailing garbage": body(values()) + b"x",
    "small body": body([1.0, 2.0], shape=[2]),
}


@pytest.mark.parametrize("case", LEFT_TO_ORJSON)
def test_other_bodies_take_orjsons_path_with_its_answer(case, monkeypatch) -> None:
    raw = LEFT_TO_ORJSON[case]
    assert json_tensors.parse_header(raw) is None
    fast, regular = (decoded(raw, s, monkeypatch) for s in (True, False))
    if isinstance(regular, str):
        assert fast == regular
    else:
        assert fast.tobytes() == regular.tobytes()


def test_count_mismatch_is_the_codecs_message(monkeypatch) -> None:
    raw = body(values(), shape=[1, 64, 33])
    assert json_tensors.parse_header(raw) is not None
    fast, regular = (decoded(raw, s, monkeypatch) for s in (True, False))
    assert fast == regular and "needs 2112 values, 'data' has 2048" in fast
