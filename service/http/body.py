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
    declared, encoding = _body_headers(request.scope)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
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
            raise _too_large(limit)
        if not more:
            body = parts
            break
    if len(body) > limit:
        raise _too_large(limit)
    if encoding is None:
        return body
    encoding = encoding.lower()
    if encoding in ("gzip", "deflate"):
        inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        try:
            body = bytearray(inflater.decompress(body, limit + 1))
        except zlib.error as exc:
            raise BadInput(f"body is not valid {encoding} data: {exc}") from None
        if len(body) > limit or inflater.unconsumed_tail:
            raise _too_large(limit)
    elif encoding != "identity":
        raise BadInput(f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
    return body


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is over the limit of {limit} bytes (--max-body-bytes)")


def _body_headers(scope: Any) -> tuple[str | None, str | None]:
    """The first Content-Length and Content-Encoding of the request, in one pass over its raw
    headers (the values Starlette's `request.headers.get` would give; per request, so no
    Headers object)."""
    length = encoding = None
    for key, value in scope["headers"]:
        if key == b"content-length":
            if length is None:
                length = value.decode("latin-1")
        elif key == b"content-encoding" and encoding is None:
            encoding = value.decode("latin-1")
    return length, encoding


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
