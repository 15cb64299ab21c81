"""Every HTTP request body goes through here: one bounded reader (--max-body-bytes, also after
gzip/deflate) and one JSON parser with one set of rules (orjson: no lone surrogates, no NaN;
objects only where a route needs one). Routes never take a body parsed by FastAPI."""

from __future__ import annotations

import zlib
from typing import Any

import orjson
from fastapi import Request

from service.pipeline.errors import BadInput, ClientDisconnected, PayloadTooLarge


async def read_body(request: Request, limit: int) -> bytes | bytearray:
    """The (decompressed) request body, refusing anything over `limit` bytes with 413. A body
    that arrives in one piece is used as it is (no copy)."""
    too_large = PayloadTooLarge(
        f"request body is over the limit of {limit} bytes (--max-body-bytes)"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body: bytes | bytearray = b""
    parts: bytearray | None = None
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":  # gone mid-body: 499, not a server error
            raise ClientDisconnected("client disconnected while sending the body")
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        if parts is None and not more:
            body = chunk
            break
        parts = bytearray() if parts is None else parts
        parts += chunk
        if len(parts) > limit:
            raise too_large
        if not more:
            body = parts
            break
    if len(body) > limit:
        raise too_large
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding in ("gzip", "deflate"):
        inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        try:
            body = bytearray(inflater.decompress(body, limit + 1))
        except zlib.error as exc:
            raise BadInput(f"body is not valid {encoding} data: {exc}") from None
        if len(body) > limit or inflater.unconsumed_tail:
            raise too_large
    elif encoding != "identity":
        raise BadInput(f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
    return body


def parse_json(body: bytes | bytearray | memoryview) -> Any:
    """The body as JSON; 400 naming the problem (malformed, lone surrogates, bad UTF-8)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadInput(f"body is not valid JSON: {exc}") from None


async def read_json(request: Request, limit: int, empty: Any = ...) -> Any:
    """The bounded body parsed as JSON (`empty` for a blank body when given)."""
    raw = await read_body(request, limit)
    if empty is not ... and not bytes(raw).strip():
        return empty
    return parse_json(raw)


async def read_object(request: Request, limit: int) -> dict[str, Any]:
    """The bounded body as a JSON object; 400 for any other JSON value."""
    data = await read_json(request, limit)
    if not isinstance(data, dict):
        raise BadInput(f"body must be a JSON object, got {type(data).__name__}")
    return data
