"""Attention weights for a sentence: text in, its tokens and every head's weights out.

A text request to the debug endpoint is the OIP JSON body with one BYTES input named `text`,
shape [1]: {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["..."]}],
"parameters": {"layer": 3}}. The text is tokenized by the served model's tokenizer exactly as
/v1/embeddings does (same special tokens, same truncation), then the model's embeddings layer
and encoder run on the engine thread with weights kept. The answer is OIP-shaped JSON:
`tokens` (BYTES), `token_ids`, `special_tokens_mask`, `attention_weights`, `output`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import torch

from service.debug.attention_weights import WEIGHTS_NAME, WeightsOptions, parse_options
from service.oip.datatypes import to_numpy
from service.oip.inputs import OUTPUT_NAME
from service.pipeline.errors import BadInput
from service.text.tokenizer import Labelled, TextTokenizer

TEXT_INPUT = "text"
TOKENS_NAME = "tokens"
TOKEN_IDS_NAME = "token_ids"
SPECIAL_NAME = "special_tokens_mask"
OUTPUTS = (TOKENS_NAME, TOKEN_IDS_NAME, SPECIAL_NAME, WEIGHTS_NAME, OUTPUT_NAME)
FIELDS = {"id", "inputs", "outputs", "parameters"}
CHARS_PER_TOKEN = 64  # texts over CHARS_PER_TOKEN * the token limit are refused untokenized


@dataclass
class TextRequest:
    """A validated text request of the debug endpoint."""

    id: str | None
    text: str
    options: WeightsOptions
    outputs: list[str]  # the outputs to send, in OUTPUTS order


def is_text_body(body: bytes | bytearray, binary_header: str | None) -> dict | None:
    """The parsed JSON header when `body` is a text request (a BYTES input), else None.

    Tensor requests never carry BYTES, so they skip the extra parse (a substring scan only).
    """
    if binary_header is not None or b'"BYTES"' not in body:
        return None
    try:
        header = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadInput(f"malformed JSON: {exc}") from None
    inputs = header.get("inputs") if isinstance(header, dict) else None
    if isinstance(inputs, list) and any(
        isinstance(i, dict) and i.get("datatype") == "BYTES" for i in inputs
    ):
        return header
    return None


def parse_text_request(
    header: dict, architecture: str, num_layers: int, max_tokens: int
) -> TextRequest:
    """Check the one `text` input, parameters and requested outputs; BadInput names problems."""
    unknown = sorted(set(header) - FIELDS)
    if unknown:
        raise BadInput(f"unknown field(s) {unknown}; a text request has {sorted(FIELDS)}")
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadInput("'id' must be a string")
    inputs = header["inputs"]
    names = [i.get("name") for i in inputs if isinstance(i, dict)]
    if len(inputs) != 1 or names != [TEXT_INPUT]:
        raise BadInput(
            f"a text request has exactly one input, '{TEXT_INPUT}' (BYTES, shape [1]); got {names}"
        )
    (raw,) = inputs
    if raw.get("datatype") != "BYTES":
        raise BadInput(f"input '{TEXT_INPUT}' must have datatype BYTES")
    if raw.get("shape") != [1]:
        raise BadInput(
            f"input '{TEXT_INPUT}' must have shape [1] (one text per request), got "
            f"{raw.get('shape')!r}"
        )
    if (raw.get("parameters") or {}).get("binary_data_size") is not None:
        raise BadInput(f"input '{TEXT_INPUT}' must be JSON data (a list of one string)")
    data = raw.get("data")
    if not isinstance(data, list) or len(data) != 1 or not isinstance(data[0], str):
        raise BadInput(f"input '{TEXT_INPUT}': 'data' must be a list of one string")
    text = data[0]
    if not text:
        raise BadInput(f"input '{TEXT_INPUT}' is an empty string; send at least one character")
    max_chars = CHARS_PER_TOKEN * max_tokens
    if len(text) > max_chars:
        raise BadInput(
            f"input '{TEXT_INPUT}' has {len(text)} characters; the debug endpoint takes at most "
            f"{max_chars} ({CHARS_PER_TOKEN} per token of its {max_tokens}-token limit)"
        )

    parameters = header.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadInput("request 'parameters' must be a JSON object")
    for flag in ("is_causal", "binary_data_output"):
        if parameters.get(flag, False) is not False:
            raise BadInput(f"parameter '{flag}' is not supported for text input (JSON answers)")
    options = parse_options(parameters, architecture, num_layers)

    outputs = list(OUTPUTS)
    asked = header.get("outputs")
    if asked is not None:
        if not isinstance(asked, list) or not all(
            isinstance(o, dict) and isinstance(o.get("name"), str) for o in asked
        ):
            raise BadInput("'outputs' must be a list of objects with a string 'name'")
        wanted = {o["name"] for o in asked}
        unknown = sorted(wanted - set(OUTPUTS))
        if unknown:
            raise BadInput(f"unknown output(s) {unknown}; text requests have {list(OUTPUTS)}")
        if any((o.get("parameters") or {}).get("binary_data") for o in asked):
            raise BadInput("text requests answer JSON only: drop 'binary_data' from 'outputs'")
        outputs = [name for name in OUTPUTS if name in wanted]
    return TextRequest(request_id, text, options, outputs)


def tokenize(tokenizer: TextTokenizer, text: str, max_tokens: int, flag: str) -> Labelled:
    """The text's tokens as /v1/embeddings makes them; 400 over the debug token limit."""
    labelled = tokenizer.label(text)
    count = len(labelled.tokens)
    if count > max_tokens:
        raise BadInput(
            f"input '{TEXT_INPUT}' has {count} tokens (after truncation to the model's "
            f"{tokenizer.max_length}); the debug endpoint takes at most {max_tokens} ({flag})"
        )
    return labelled


def compute(model: Any, ids: np.ndarray, options: WeightsOptions) -> tuple[np.ndarray, np.ndarray]:
    """On the engine thread: (output (1, T, D), weights ([L,] 1, [H,] T, T)) in float32."""
    hidden = model.embed_tokens(torch.from_numpy(ids)[None])  # (1, T, D)
    output, weights = model.attention_weights(
        hidden, layer=options.layer, average_attn_weights=options.average
    )
    return to_numpy(output, "FP32"), to_numpy(weights, "FP32")


def response(
    model_name: str,
    version: str | None,
    request: TextRequest,
    labelled: Labelled,
    output: np.ndarray,
    weights: np.ndarray,
    num_layers: int,
) -> bytes:
    """The OIP-shaped JSON answer; parameters say which layers and whether the text was cut."""
    count = len(labelled.tokens)
    tensors: dict[str, tuple[str, list[int], Any]] = {
        TOKENS_NAME: ("BYTES", [1, count], labelled.tokens),
        TOKEN_IDS_NAME: ("INT64", [1, count], labelled.encoded.ids),
        SPECIAL_NAME: ("BOOL", [1, count], labelled.special),
        WEIGHTS_NAME: ("FP32", list(weights.shape), weights.reshape(-1)),
        OUTPUT_NAME: ("FP32", list(output.shape), output.reshape(-1)),
    }
    layers = list(range(num_layers)) if request.options.layer is None else [request.options.layer]
    body: dict[str, Any] = {
        "model_name": model_name,
        "outputs": [
            dict(zip(("name", "datatype", "shape", "data"), (name, *tensors[name]), strict=True))
            for name in request.outputs
        ],
        "parameters": {"truncated": labelled.encoded.truncated, "layers": layers},
    }
    if version is not None:
        body["model_version"] = version
    if request.id is not None:
        body["id"] = request.id
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
