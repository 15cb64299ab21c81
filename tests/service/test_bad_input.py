"""Every kind of bad request gets a 4xx naming the problem; the server stays healthy."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.support import Server, binary_request, run_server

E = 60  # embed_dim of the served nn.MultiheadAttention (kdim 48, vdim 40)


def tensor(name: str, shape: list[int], data: list | None = None, datatype: str = "FP32") -> dict:
    count = int(np.prod(shape))
    return {
        "name": name,
        "shape": shape,
        "datatype": datatype,
        "data": data if data is not None else [0.5] * count,
    }


def body(*inputs: dict, **extra: object) -> bytes:
    return json.dumps({"inputs": list(inputs), **extra}).encode()


q = tensor("input", [1, 4, E])
k = tensor("key", [1, 5, 48])
v = tensor("value", [1, 5, 40])


def binary_inputs(bad: str, value: float, mask: bool = False) -> tuple[bytes, dict[str, str]]:
    """A binary request to the cross-attention model, finite but for one `value` in `bad`;
    with `mask`, that value sits at a key position the key_padding_mask ignores."""
    arrays = {
        "input": np.full((1, 4, E), 0.5, dtype=np.float32),
        "key": np.full((1, 5, 48), 0.25, dtype=np.float32),
        "value": np.full((1, 5, 40), -0.5, dtype=np.float32),
    }
    arrays[bad][0, -1, 7] = value
    if mask:
        arrays["key_padding_mask"] = np.array([[False, False, False, False, True]])
    inputs = [
        {
            "name": name,
            "shape": list(a.shape),
            "datatype": "BOOL" if a.dtype == bool else "FP32",
            "parameters": {"binary_data_size": a.nbytes},
        }
        for name, a in arrays.items()
    ]
    return binary_request({"inputs": inputs}, *(a.tobytes() for a in arrays.values()))


# NaN/Inf inputs are found from the outputs they poison (no pass over every input value), then
# named; a masked key or value poisons its sequence's output too.
NONFINITE_CASES = [
    (f"{value} in binary {name}{' (masked key)' if mask else ''}",
     *binary_inputs(name, value, mask), 400, f"input '{name}' holds NaN or Inf")
    for name, value, mask in (
        ("input", np.nan, False), ("key", np.inf, False), ("value", -np.inf, False),
        ("key", np.nan, True), ("value", np.nan, True),
    )
]  # fmt: skip
header_only = {
    "inputs": [
        {
            "name": "input",
            "shape": [1, 2, E],
            "datatype": "FP32",
            "parameters": {"binary_data_size": 2 * E * 4},
        }
    ]
}
header_bytes = json.dumps(header_only).encode()

CASES = [
    # (id, body bytes, extra headers, status, words the error must contain)
    ("malformed json", b'{"inputs": [', {}, 400, "malformed JSON"),
    ("not an object", b"[1, 2]", {}, 400, "JSON object"),
    ("missing input", body(tensor("key", [1, 5, 48]), v), {}, 400, "missing input 'input'"),
    ("self-attention on kdim model", body(q), {}, 400, "needs inputs 'key' and 'value'"),
    ("no inputs", body(), {}, 400, "inputs"),
    ("only key", body(q, k), {}, 400, "'key' and 'value' go together"),
    ("unknown input", body(q, tensor("bogus", [1])), {}, 400, "bogus"),
    ("wrong rank", body(tensor("input", [1, 1, 4, E])), {}, 400, "expected [B, T, embed_dim]"),
    ("wrong embed dim", body(tensor("input", [1, 4, E + 1])), {}, 400, "embed_dim is 60"),
    ("wrong kdim", body(q, tensor("key", [1, 5, 47]), v), {}, 400, "kdim is 48"),
    ("shape vs data", body(tensor("input", [1, 4, E], [0.5] * 10)), {}, 400, "needs 240 values"),
    ("unsupported datatype", body(tensor("input", [1, 4, E], datatype="INT32")), {}, 400, "INT32"),
    ("unknown datatype", body(tensor("input", [1, 4, E], datatype="FP99")), {}, 400, "FP99"),
    ("strings in data", body(tensor("input", [1, 1, 2], ["a", "b"])), {}, 400, "JSON numbers"),
    *NONFINITE_CASES,
    (
        "infinity in json",
        body(tensor("input", [1, 1, 2], "[1e999, 0]")).replace(b'"[1e999, 0]"', b"[1e999, 0]"),
        {},
        400,
        "malformed JSON",
    ),
    ("zero length", body(tensor("input", [1, 0, E], [])), {}, 400, "length 0"),
    ("too long", body(tensor("input", [1, 65, E])), {}, 400, "--max-seq-len"),
    ("too many sequences", body(tensor("input", [9, 1, E])), {}, 400, "--max-batch-size"),
    ("zero batch", body(tensor("input", [0, 4, E], [])), {}, 400, "batch size 0"),
    ("key/value lengths", body(q, k, tensor("value", [1, 6, 40])), {}, 400, "must match"),
    (
        "key batch",
        body(q, tensor("key", [2, 5, 48]), tensor("value", [2, 5, 40])),
        {},
        400,
        "batch 2",
    ),
    (
        "mask shape",
        body(q, k, v, tensor("key_padding_mask", [1, 3], [False] * 3, "BOOL")),
        {},
        400,
        "expected [1, 5]",
    ),
    (
        "mask type",
        body(q, k, v, tensor("key_padding_mask", [1, 5], [0.0] * 5)),
        {},
        400,
        "must be BOOL",
    ),
    (
        "mask values",
        body(q, k, v, tensor("key_padding_mask", [1, 5], [1, 0, 0, 0, 0], "BOOL")),
        {},
        400,
        "true/false",
    ),
    (
        "fully masked",
        body(q, k, v, tensor("key_padding_mask", [1, 5], [True] * 5, "BOOL")),
        {},
        400,
        "every key",
    ),
    ("causal cross", body(q, k, v, parameters={"is_causal": True}), {}, 400, "is_causal"),
    ("causal not bool", body(q, k, v, parameters={"is_causal": "yes"}), {}, 400, "true or false"),
    ("bad timeout", body(q, k, v, parameters={"timeout": -1}), {}, 400, "timeout"),
    ("unknown output", body(q, k, v, outputs=[{"name": "attn"}]), {}, 400, "unknown output"),
    (
        "header length not int",
        body(q, k, v),
        {"Inference-Header-Content-Length": "x"},
        400,
        "integer",
    ),
    (
        "header length too big",
        body(q, k, v),
        {"Inference-Header-Content-Length": "99999"},
        400,
        "the body has",
    ),
    (
        "binary size mismatch",
        *binary_request(
            {
                "inputs": [
                    {
                        "name": "input",
                        "shape": [1, 2, E],
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": 12},
                    }
                ]
            },
            b"\0" * 12,
        ),
        400,
        "binary_data_size is 12",
    ),
    (
        "binary truncated",
        header_bytes + b"\0" * 100,
        {"Inference-Header-Content-Length": str(len(header_bytes))},
        400,
        "past the end",
    ),
    (
        "binary trailing bytes",
        *binary_request(header_only, b"\0" * (2 * E * 4 + 8)),
        400,
        "after the last binary input",
    ),
    ("binary without header", header_bytes, {}, 400, "no Inference-Header-Content-Length"),
    ("too large", b"{" + b" " * 70_000 + b"}", {}, 413, "--max-body-bytes"),
    ("bad encoding", body(q, k, v), {"Content-Encoding": "br"}, 400, "Content-Encoding"),
    ("bad gzip", b"not gzip", {"Content-Encoding": "gzip"}, 400, "gzip"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    import torch
    from torch import nn

    import mha_engine

    torch.manual_seed(0)
    module = nn.MultiheadAttention(E, 5, kdim=48, vdim=40, batch_first=True)
    model_dir = tmp_path_factory.mktemp("bad") / "cross"
    mha_engine.save_model(module, model_dir)
    args = [
        "--model-dir",
        str(model_dir),
        "--max-seq-len",
        "64",
        "--max-batch-size",
        "8",
        "--max-body-bytes",
        "65536",
    ]
    with run_server(model_dir.parent, *args) as srv:
        yield srv


@pytest.mark.parametrize(
    ("content", "headers", "status", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_request_is_named(server: Server, content, headers, status, words) -> None:
    response = httpx.post(f"{server.url}/v2/models/cross/infer", content=content, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error, error


def test_gzip_body_is_accepted(server: Server) -> None:
    import gzip

    x = np.full((1, 3, E), 0.25, dtype=np.float32)
    plain = body(tensor("input", [1, 3, E], x.ravel().tolist()), k, v)
    response = httpx.post(
        f"{server.url}/v2/models/cross/infer",
        content=gzip.compress(plain),
        headers={"Content-Encoding": "gzip"},
    )
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["shape"] == [1, 3, E]


def test_server_healthy_after_bad_requests(server: Server) -> None:
    for case in CASES:
        httpx.post(f"{server.url}/v2/models/cross/infer", content=case[1], headers=case[2])
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
    ok = httpx.post(f"{server.url}/v2/models/cross/infer", content=body(q, k, v))
    assert ok.status_code == 200, ok.text
    assert server.metric("mha_request_failures_total", reason="bad_input") >= len(CASES) - 1
    # Nothing that was rejected reached the engine.
    assert server.metric("mha_batches_total", outcome="error") == 0
