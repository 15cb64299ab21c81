"""OIP JSON bodies whose float `data` arrays go straight into numpy: simdjson (pysimdjson)
parses and validates the whole document in C and exports each flat array of numbers as one
buffer of doubles, with no Python float per number.

Only the plain case is taken here; anything else returns None and goes through
`codecs.decode_request`'s orjson path, which then accepts or refuses it with its own message:
a body with a backslash (escapes), a float datatype whose `data` is not a flat array of JSON
numbers (strings, booleans, null, nested lists), a non-float datatype, a document simdjson
refuses, or pysimdjson not installed. So a request is accepted with the same values, bit for bit
(both parsers round each number correctly to a double, which is then cast), or handled as before.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import orjson

try:
    import simdjson
except ImportError:  # optional: without it every JSON body takes the orjson path
    simdjson = None

MIN_BYTES = 4096  # smaller bodies: orjson's Python floats cost less than a second parser
FLOAT_DATATYPES = frozenset({"FP32", "FP16", "BF16"})
# From 2**53 on, a JSON integer is exact in orjson's int and rounded in a double: rounding it
# again to the datatype could differ from rounding the exact integer once.
BIG = float(2**53)

_parsers = threading.local()  # a simdjson Parser holds one document: one per thread


class Numbers:
    """A `data` array already parsed: its values as float64, flat (the codec reshapes)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


def _parser() -> Any:
    parser = getattr(_parsers, "parser", None)
    if parser is None:
        parser = _parsers.parser = simdjson.Parser()
    return parser


def _plain(value: Any) -> Any:
    """A simdjson value (a small one: not a `data` array) as plain Python objects."""
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


def parse_header(body: bytes | bytearray | memoryview) -> dict[str, Any] | None:
    """The request as orjson would parse it, each input's `data` a Numbers; or None when the
    body is not the plain case (see the module's docstring)."""
    if simdjson is None or len(body) < MIN_BYTES:
        return None
    raw = bytes(body) if isinstance(body, memoryview) else body
    if b"\\" in raw:
        return None
    try:
        doc = _parser().parse(raw)
    except (ValueError, RuntimeError, TypeError):
        return None
    try:
        return _header(doc, raw)
    except (ValueError, RuntimeError, TypeError, KeyError, IndexError):
        return None
    finally:
        del doc


def _header(doc: Any, raw: bytes | bytearray) -> dict[str, Any] | None:
    if not isinstance(doc, simdjson.Object):
        return None
    inputs = doc.get("inputs")
    if not isinstance(inputs, simdjson.Array) or len(inputs) == 0:
        return None
    header = {key: _plain(doc[key]) for key in doc.keys() if key != "inputs"}  # noqa: SIM118
    tensors = []
    for tensor in inputs:
        if not isinstance(tensor, simdjson.Object):
            return None
        # keys(), then each value but data's: items() would build a proxy of the data too
        fields = {key: _plain(tensor[key]) for key in tensor.keys() if key != "data"}  # noqa: SIM118
        data = tensor.get("data")
        if data is not None:
            if fields.get("datatype") not in FLOAT_DATATYPES or not isinstance(
                data, simdjson.Array
            ):
                return None
            values = np.frombuffer(data.as_buffer(of_type="d"), np.float64)
            if values.size != len(data):  # a nested list somewhere: as_buffer flattens
                return None
            # an integer orjson keeps exact (max and min: no temporary array, unlike abs)
            if values.size and (values.max() >= BIG or values.min() <= -BIG):
                return None
            fields["data"] = Numbers(values)
        tensors.append(fields)
    header["inputs"] = tensors
    # Every '[' of the body is accounted for by the header without its data (which dumps each
    # '[' of a string as it is: the body has no escapes) and one per data array: a nested list
    # in a data array (e.g. [[], [1, 2]], which flattens to as many values) has more.
    skeleton = {**header, "inputs": [_without_numbers(t) for t in tensors]}
    if raw.count(b"[") != orjson.dumps(skeleton).count(b"["):
        return None
    return header


def _without_numbers(tensor: dict[str, Any]) -> dict[str, Any]:
    return {k: [] if isinstance(v, Numbers) else v for k, v in tensor.items()}
