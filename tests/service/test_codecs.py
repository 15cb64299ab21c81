"""Property tests of the OIP codecs against tritonclient's own encoder and decoder."""

from __future__ import annotations

import contextlib
import json

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from service.oip.codecs import OutputTensor, decode_request, encode_response
from service.pipeline.errors import BadInput

NUMPY = {
    "FP32": np.float32,
    "FP16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "FP64": np.float64,
    "INT32": np.int32,
    "INT64": np.int64,
    "INT8": np.int8,
    "UINT8": np.uint8,
    "BOOL": np.bool_,
}
shapes = st.lists(st.integers(0, 5), min_size=1, max_size=4).map(tuple)
fast = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw: st.DrawFn) -> tuple[str, np.ndarray]:
    datatype = draw(st.sampled_from(sorted(NUMPY)))
    shape = draw(shapes)
    if datatype == "BF16":  # hypothesis has no bfloat16: draw float32 values and round them
        values = draw(arrays(np.float32, shape, elements=st.floats(-1e3, 1e3, width=32)))
        return datatype, values.astype(ml_dtypes.bfloat16)
    if datatype in (
        "FP32",
        "FP16",
        "FP64",
    ):  # finite: JSON has no NaN/Inf (the service refuses them)
        width = {"FP16": 16, "FP32": 32, "FP64": 64}[datatype]
        finite = st.floats(allow_nan=False, allow_infinity=False, width=width)
        return datatype, draw(arrays(NUMPY[datatype], shape, elements=finite))
    return datatype, draw(arrays(NUMPY[datatype], shape))


def triton_body(datatype: str, array: np.ndarray, binary: bool) -> tuple[bytes, str | None]:
    item = triton.InferInput("x", list(array.shape), datatype)
    item.set_data_from_numpy(array, binary_data=binary)
    body, json_size = triton.InferenceServerClient.generate_request_body([item])
    return body, None if json_size is None else str(json_size)


def as_values(datatype: str, array: np.ndarray) -> np.ndarray:
    """What our decoder holds, as comparable values (BF16 is kept as raw uint16 bits)."""
    if datatype == "BF16":
        return array.view(np.uint16) if array.dtype != np.uint16 else array
    return array


@fast
@given(tensors(), st.booleans())
def test_decode_what_tritonclient_encodes(tensor: tuple[str, np.ndarray], binary: bool) -> None:
    datatype, array = tensor
    if datatype == "BF16" and not binary:
        binary = True  # tritonclient only sends BF16 as binary
    body, header_length = triton_body(datatype, array, binary)
    decoded = decode_request(bytearray(body), header_length).inputs["x"]
    assert decoded.datatype == datatype and decoded.shape == array.shape
    expected = as_values(datatype, array)
    if datatype in ("FP32", "FP64", "FP16") and not binary:
        # JSON floats round-trip through Python's repr: exact for these widths.
        np.testing.assert_array_equal(decoded.array.astype(np.float64), array.astype(np.float64))
    else:
        np.testing.assert_array_equal(decoded.array, expected)


@fast
@given(tensors(), st.booleans())
def test_tritonclient_decodes_what_we_encode(tensor: tuple[str, np.ndarray], binary: bool) -> None:
    datatype, array = tensor
    ours = array.view(np.uint16) if datatype == "BF16" else array
    body, header_length = encode_response(
        "m", "1", "id-1", [OutputTensor("y", datatype, ours)], {"y": binary or datatype == "BF16"}
    )
    result = triton.InferResult.from_response_body(body, header_length=header_length)
    got = result.as_numpy("y")
    assert result.get_response()["id"] == "id-1"
    assert got.shape == array.shape
    if datatype == "BF16":
        np.testing.assert_array_equal(got.astype(np.float32), array.astype(np.float32))
    else:
        np.testing.assert_array_equal(got.astype(array.dtype), array)


@fast
@given(st.data())
def test_truncated_binary_bodies_are_bad_input(data: st.DataObject) -> None:
    shape = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple))
    body, header_length = triton_body("FP32", data.draw(arrays(np.float32, shape)), True)
    cut = data.draw(st.integers(1, len(body)))
    with pytest.raises(BadInput):
        decode_request(bytearray(body[:-cut]), header_length)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)
field_names = st.sampled_from(["name", "shape", "datatype", "data", "parameters", "id", "outputs"])
fuzzed_inputs = st.lists(
    st.dictionaries(field_names, json_values | st.sampled_from(["FP32", "BOOL"])), max_size=3
)
fuzzed_requests = st.fixed_dictionaries(
    {"inputs": fuzzed_inputs}, optional={"parameters": json_values, "outputs": json_values}
)


@fast
@given(
    st.one_of(st.binary(max_size=300), fuzzed_requests.map(lambda r: json.dumps(r).encode())),
    st.one_of(st.none(), st.integers(-5, 400).map(str)),
)
def test_malformed_requests_only_raise_bad_input(body: bytes, header_length: str | None) -> None:
    """Random bytes and randomly shaped JSON requests: BadInput or a decoded request, never else."""
    with contextlib.suppress(BadInput):
        decode_request(bytearray(body), header_length)


@fast
@given(st.integers(1, 10**12))
def test_oversized_binary_claims_are_refused(extra: int) -> None:
    """A header claiming more data than the body holds is refused without allocating it."""
    header = {
        "inputs": [
            {
                "name": "x",
                "shape": [2 + extra],
                "datatype": "FP32",
                "parameters": {"binary_data_size": (2 + extra) * 4},
            }
        ]
    }
    head = json.dumps(header).encode()
    with pytest.raises(BadInput, match=r"runs past the end|larger than a body of"):
        decode_request(bytearray(head + b"\0" * 8), str(len(head)))
