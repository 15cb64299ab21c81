"""OIP request bodies and response checks for load generation (numpy only, no Locust).

Bodies are cut from tensors built once per user, so a request costs a slice and a small JSON
header, not a fresh tensor: the load generator shares the CPU with the server on small machines.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

BINARY_HEADER = "Inference-Header-Content-Length"
INPUT_NAME = "input"
OUTPUT_NAME = "output"


@dataclass(frozen=True)
class Body:
    """One ready-to-send request: bytes, HTTP headers and the input shape (B, T, E)."""

    data: bytes
    headers: dict[str, str]
    shape: tuple[int, int, int]
    binary: bool


class LengthDistribution:
    """Sequence lengths T drawn from a spec: '64', 'uniform:16:256', 'loguniform:16:256' or
    'choice:16,64,256' (bounds inclusive)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec.strip()
        kind, _, rest = self.spec.partition(":")
        try:
            if not rest:
                self.kind, self.values = "constant", [int(kind)]
            elif kind in ("uniform", "loguniform"):
                low, high = (int(v) for v in rest.split(":"))
                self.kind, self.values = kind, [low, high]
            elif kind == "choice":
                self.kind, self.values = kind, [int(v) for v in rest.split(",")]
            else:
                raise ValueError(f"unknown distribution {kind!r}")
        except ValueError as exc:
            raise ValueError(
                f"bad length distribution {spec!r} ({exc}); use e.g. '64', 'uniform:16:256', "
                "'loguniform:16:256' or 'choice:16,64,256'"
            ) from None
        if min(self.values) < 1:
            raise ValueError(f"bad length distribution {spec!r}: lengths must be >= 1")
        if self.kind in ("uniform", "loguniform") and self.values[0] > self.values[1]:
            raise ValueError(f"bad length distribution {spec!r}: low bound above high bound")

    @property
    def max(self) -> int:
        return max(self.values)

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "constant":
            return self.values[0]
        if self.kind == "choice":
            return int(rng.choice(self.values))
        low, high = self.values
        if self.kind == "uniform":
            return int(rng.integers(low, high + 1))
        # loguniform: more short sequences than long ones, as in most real traffic.
        return min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high))))))


class BodyFactory:
    """Builds OIP bodies for [B, T, E] float32 inputs from one pool of random tokens.

    `max_tokens` bounds B*T. Binary bodies slice the pool's raw bytes; JSON bodies join
    per-token text fragments rendered once, so both stay cheap per request.
    """

    def __init__(
        self, embed_dim: int, max_tokens: int, binary: bool, rng: np.random.Generator
    ) -> None:
        self.embed_dim = embed_dim
        self.max_tokens = max_tokens
        self.binary = binary
        # Three decimals keep JSON bodies small; the values still exercise the whole layer.
        pool = np.round(rng.standard_normal((max_tokens, embed_dim)), 3).astype("<f4")  # (N, E)
        if binary:
            self._raw = pool.tobytes()
        else:
            self._tokens = [",".join(f"{v:.3f}" for v in row) for row in pool.tolist()]

    def body(self, batch: int, seq_len: int) -> Body:
        """A request for input shape [batch, seq_len, E]; the output comes back in the same
        encoding (binary or JSON) as the input."""
        tokens = batch * seq_len
        if tokens > self.max_tokens:
            raise ValueError(f"{batch}x{seq_len} tokens exceed the pool of {self.max_tokens}")
        shape = (batch, seq_len, self.embed_dim)
        outputs = [{"name": OUTPUT_NAME, "parameters": {"binary_data": self.binary}}]
        if self.binary:
            size = tokens * self.embed_dim * 4
            head = json.dumps(
                {
                    "inputs": [
                        {
                            "name": INPUT_NAME,
                            "shape": list(shape),
                            "datatype": "FP32",
                            "parameters": {"binary_data_size": size},
                        }
                    ],
                    "outputs": outputs,
                },
                separators=(",", ":"),
            ).encode()
            headers = {
                BINARY_HEADER: str(len(head)),
                "Content-Type": "application/octet-stream",
            }
            return Body(head + self._raw[:size], headers, shape, True)
        # The tensor text is spliced in as-is (meta[:-1] drops the closing brace so "data" can
        # follow); only the small fields go through json.dumps.
        meta = json.dumps({"name": INPUT_NAME, "shape": list(shape), "datatype": "FP32"})
        text = (
            f'{{"inputs":[{meta[:-1]},"data":[{",".join(self._tokens[:tokens])}]}}],'
            f'"outputs":{json.dumps(outputs)}}}'
        )
        return Body(text.encode(), {"Content-Type": "application/json"}, shape, False)


def check_response(content: bytes, header_length: str | None, shape: tuple[int, ...]) -> str | None:
    """None if `content` is an OIP response with one FP32 output of `shape`, all finite;
    otherwise a short description of what is wrong (used as the Locust failure message)."""
    json_end = len(content)
    if header_length is not None:
        try:
            json_end = int(header_length)
        except ValueError:
            return f"bad {BINARY_HEADER} {header_length!r}"
        if not 0 < json_end <= len(content):
            return f"{BINARY_HEADER} {json_end} outside a body of {len(content)} bytes"
    try:
        head = json.loads(content[:json_end])
        outputs = head["outputs"]
    except (ValueError, KeyError, TypeError):
        return "response is not an OIP JSON object with 'outputs'"
    if not isinstance(outputs, list) or len(outputs) != 1 or not isinstance(outputs[0], dict):
        return f"expected one output, got {outputs!r:.80}"
    out = outputs[0]
    if out.get("name") != OUTPUT_NAME or out.get("datatype") != "FP32":
        return f"unexpected output {out.get('name')!r} of {out.get('datatype')!r}"
    if out.get("shape") != list(shape):
        return f"output shape {out.get('shape')} != {list(shape)}"
    count = math.prod(shape)
    binary_size = (out.get("parameters") or {}).get("binary_data_size")
    if binary_size is not None:
        if binary_size != count * 4 or len(content) - json_end != binary_size:
            return (
                f"binary_data_size {binary_size}, {len(content) - json_end} bytes sent, "
                f"{count * 4} expected"
            )
        values = np.frombuffer(content, dtype="<f4", offset=json_end)
    else:
        try:
            values = np.asarray(out["data"], dtype=np.float32).reshape(-1)
        except (KeyError, ValueError, TypeError):
            return "output has neither numeric 'data' nor binary_data_size"
        if values.size != count:
            return f"output has {values.size} values, {count} expected"
    if not np.isfinite(values).all():
        return "output holds NaN or Inf"
    return None
